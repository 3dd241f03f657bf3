"""ProcessOutput, the host side of one output stream of a guest process, without an agent."""

from __future__ import annotations

import threading
from typing import Any

from pytest_forkd.core.process import ProcessOutput


class EndsWhenCredited:
    """The part of a GuestProcess a stream uses; the stream ends while the reader is giving credit.

    That is the moment the reader does not hold the stream's lock: an end (or data)
    arriving then must still wake it.
    """

    pid = 7
    command_line = "producer"

    def __init__(self) -> None:
        self.output: ProcessOutput | None = None
        self.credited: list[int] = []

    def _credit(self, fd: int, nbytes: int) -> None:
        self.credited.append(nbytes)
        assert self.output is not None
        self.output._end()

    def _ended_normally(self) -> bool:
        return True


def read_in_thread(output: ProcessOutput, method: str) -> tuple[threading.Thread, list[Any]]:
    result: list[Any] = []
    reader = threading.Thread(target=lambda: result.append(getattr(output, method)()), daemon=True)
    reader.start()
    return reader, result


def test_an_end_that_arrives_while_credit_is_given_wakes_the_reader() -> None:
    process = EndsWhenCredited()
    process.output = output = ProcessOutput(process, "stdout", 1, max_line=1024)  # type: ignore[arg-type]
    output._feed(b"head of the output", 0)
    reader, result = read_in_thread(output, "read")  # no timeout: only a notification can end it
    reader.join(timeout=10)
    assert not reader.is_alive(), "the reader missed the end of the stream"
    assert result == [b"head of the output"] and process.credited == [len(b"head of the output")]


def test_a_line_reader_sees_the_end_that_came_with_its_credit() -> None:
    process = EndsWhenCredited()
    process.output = output = ProcessOutput(process, "stdout", 1, max_line=1024)  # type: ignore[arg-type]
    output._feed(b"no newline yet", 0)
    reader, result = read_in_thread(output, "readline")
    reader.join(timeout=10)
    assert not reader.is_alive(), "the reader missed the end of the stream"
    assert result == [b"no newline yet"]
