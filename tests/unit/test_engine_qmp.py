"""The QMP client against a scripted server on a Unix socket: replies, events, errors, fds, timeouts."""

from __future__ import annotations

import array
import json
import os
import socket
import threading
from pathlib import Path
from typing import Callable, Iterator

import pytest

from pytest_forkd.engine.qmp import QMPClient, QMPError

GREETING = {"QMP": {"version": {"qemu": {"major": 7, "minor": 2, "micro": 22}}, "capabilities": []}}

# A handler gets one command and the fds that came with it, and returns the
# messages to send back; None closes the connection instead.
Handler = Callable[[dict, list[int]], "list[dict] | None"]


class FakeQMPServer:
    """Greets like QEMU, accepts ``qmp_capabilities`` and answers other commands with ``handler``."""

    def __init__(self, path: Path, handler: Handler, greeting: dict = GREETING) -> None:
        self.path = path
        self.handler = handler
        self.greeting = greeting
        self.commands: list[str] = []
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        self._listener.listen(1)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        connection, _ = self._listener.accept()
        with connection:
            self._send(connection, [self.greeting])
            buffer = b""
            fds: list[int] = []
            while True:
                data, ancillary, _, _ = connection.recvmsg(65536, socket.CMSG_SPACE(16 * 4))
                if not data:
                    return
                for level, kind, payload in ancillary:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        received = array.array("i")
                        received.frombytes(payload[: len(payload) - len(payload) % 4])
                        fds.extend(received)
                buffer += data
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    command = json.loads(line)
                    self.commands.append(command["execute"])
                    if command["execute"] == "qmp_capabilities":
                        replies: list[dict] | None = [{"return": {}, "id": command["id"]}]
                    else:
                        replies = self.handler(command, fds)
                    fds = []
                    if replies is None:
                        return
                    self._send(connection, replies)

    @staticmethod
    def _send(connection: socket.socket, messages: list[dict]) -> None:
        connection.sendall(b"".join(json.dumps(message).encode() + b"\r\n" for message in messages))

    def close(self) -> None:
        self._listener.close()
        self._thread.join(timeout=5)


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., FakeQMPServer]]:
    servers: list[FakeQMPServer] = []

    def start(handler: Handler, **options: dict) -> FakeQMPServer:
        server = FakeQMPServer(tmp_path / f"qmp{len(servers)}.sock", handler, **options)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def reply(command: dict, value: object) -> dict:
    return {"return": value, "id": command["id"]}


def test_connecting_negotiates_capabilities_and_reads_the_version(serve: Callable[..., FakeQMPServer]) -> None:
    server = serve(lambda command, fds: [reply(command, {"status": "running"})])

    client = QMPClient(str(server.path))
    try:
        assert client.version == {"major": 7, "minor": 2, "micro": 22}
        assert client.execute("query-status") == {"status": "running"}
        assert server.commands == ["qmp_capabilities", "query-status"]
    finally:
        client.close()


def test_events_are_kept_and_replies_to_other_requests_skipped(serve: Callable[..., FakeQMPServer]) -> None:
    def handler(command: dict, fds: list[int]) -> list[dict]:
        return [
            {"event": "STOP", "timestamp": {"seconds": 1, "microseconds": 0}},
            {"return": "a stale reply", "id": "forkd-0"},
            {"event": "MIGRATION", "data": {"status": "completed"}},
            reply(command, {"status": "paused"}),
        ]

    client = QMPClient(str(serve(handler).path))
    try:
        assert client.execute("query-status") == {"status": "paused"}
        assert [event["event"] for event in client.events] == ["STOP", "MIGRATION"]
    finally:
        client.close()


def test_error_reply_raises_naming_the_command_and_qemu_reason(serve: Callable[..., FakeQMPServer]) -> None:
    def handler(command: dict, fds: list[int]) -> list[dict]:
        error = {"class": "GenericError", "desc": "There's a migration process in progress"}
        return [{"error": error, "id": command["id"]}]

    client = QMPClient(str(serve(handler).path))
    try:
        with pytest.raises(QMPError, match="QMP migrate failed: GenericError: There's a migration process in progress"):
            client.execute("migrate", {"uri": "fd:x"})
    finally:
        client.close()


def test_arguments_and_file_descriptors_reach_qemu(serve: Callable[..., FakeQMPServer], tmp_path: Path) -> None:
    received: dict[str, object] = {}

    def handler(command: dict, fds: list[int]) -> list[dict]:
        received["arguments"] = command.get("arguments")
        received["content"] = [os.pread(fd, 100, 0) for fd in fds]
        for fd in fds:
            os.close(fd)
        return [reply(command, {})]

    state = tmp_path / "state.bin"
    state.write_bytes(b"device state")
    client = QMPClient(str(serve(handler).path))
    fd = os.open(state, os.O_RDONLY)
    try:
        client.execute("getfd", {"fdname": "forkd-state"}, fds=[fd])
    finally:
        os.close(fd)
        client.close()
    assert received == {"arguments": {"fdname": "forkd-state"}, "content": [b"device state"]}


def test_qemu_exiting_during_a_command_raises(serve: Callable[..., FakeQMPServer]) -> None:
    client = QMPClient(str(serve(lambda command, fds: None).path))
    try:
        with pytest.raises(QMPError, match="closed the connection"):
            client.execute("quit")
    finally:
        client.close()


def test_a_command_qemu_never_answers_times_out(serve: Callable[..., FakeQMPServer]) -> None:
    client = QMPClient(str(serve(lambda command, fds: []).path))
    try:
        with pytest.raises(QMPError, match="did not answer in time"):
            client.execute("query-migrate", timeout=0.2)
    finally:
        client.close()


def test_a_timed_out_command_is_named_in_the_error(serve: Callable[..., FakeQMPServer]) -> None:
    client = QMPClient(str(serve(lambda command, fds: []).path))
    try:
        with pytest.raises(QMPError, match="query-migrate"):
            client.execute("query-migrate", timeout=0.2)
    finally:
        client.close()


def test_something_that_is_not_qemu_is_refused(serve: Callable[..., FakeQMPServer]) -> None:
    server = serve(lambda command, fds: [], greeting={"hello": "I am not QEMU"})

    with pytest.raises(QMPError, match="unexpected QMP greeting"):
        QMPClient(str(server.path))


def test_wait_until_polls_and_gives_up_naming_what_it_waited_for(serve: Callable[..., FakeQMPServer]) -> None:
    client = QMPClient(str(serve(lambda command, fds: []).path))
    answers = iter([False, False, True])
    try:
        client.wait_until(lambda: next(answers), timeout=5, what="the device state to load", interval=0.001)
        with pytest.raises(QMPError, match="waiting for the device state to load"):
            client.wait_until(lambda: False, timeout=0.05, what="the device state to load", interval=0.001)
    finally:
        client.close()
