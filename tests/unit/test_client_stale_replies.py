"""A restored VM's first frames may be replies its snapshot froze in flight: dropped quietly, until it answers.

A snapshot taken just as the agent sent the last frame of a command holds
that frame, and every VM restored from it sends it to its new client, for a
request of the client that served the snapshot's VM (seen on E2B's fork and
pause right after ``commands.run``). The new client knows it serves a
restored VM (``expect_stale_replies``): such frames are counted as ``stale``
without a warning until the agent first answers it; after that an unknown id
is a violation again, and a client of a booted VM warns from the start.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from pytest_forkd.guest import wire
from pytest_forkd.guest.client import AgentClient

#: An id no client here issued: the old client's ids start at a random number of their own.
OLD_CLIENT_ID = 12345


@pytest.fixture
def channel() -> Iterator[tuple[AgentClient, socket.socket]]:
    host_end, guest_end = socket.socketpair()
    guest_end.settimeout(10)
    client = AgentClient(host_end)
    yield client, guest_end
    client.close()
    guest_end.close()


def send(sock: socket.socket, fields: dict[str, object]) -> None:
    sock.sendall(wire.encode_header(fields, 0))


def ping_through(client: AgentClient, guest: socket.socket, *, before_answer: list[dict[str, object]]) -> None:
    """A ping the guest answers after sending ``before_answer``."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        answer = pool.submit(client.ping, 10)
        request = wire.FrameReader(guest.recv).read_frame()
        assert request is not None and request.fields["op"] == "ping"
        for fields in before_answer:
            send(guest, fields)
        send(guest, {"id": request.fields["id"], "pid": 7, "monotonic": 1.0, "wall_time": time.time()})
        assert answer.result(timeout=10)["pid"] == 7


def stale_frame() -> dict[str, object]:
    """The last frame of a command the snapshot's client ran (as E2B's fork and pause froze it)."""
    return {"id": OLD_CLIENT_ID, "exited": True, "exit_code": 0, "signal": None}


def test_a_restored_vms_stale_frames_are_counted_not_warned(
    channel: tuple[AgentClient, socket.socket], caplog: pytest.LogCaptureFixture
) -> None:
    client, guest = channel
    client.expect_stale_replies()
    with caplog.at_level(logging.WARNING, logger="pytest_forkd.guest.client"):
        ping_through(client, guest, before_answer=[stale_frame(), stale_frame()])
        assert client.protocol_errors == {"stale": 2}
        assert caplog.records == []
        # The agent answers this client now: a frame for nobody is a violation again, and said so.
        ping_through(client, guest, before_answer=[stale_frame()])
    assert client.protocol_errors == {"stale": 2, "unknown_id": 1}
    assert [record.getMessage() for record in caplog.records] == [
        f"guest agent channel: a reply frame for request {OLD_CLIENT_ID}, which nobody waits for"
    ]


def test_a_booted_vms_client_warns_from_the_first_frame(
    channel: tuple[AgentClient, socket.socket], caplog: pytest.LogCaptureFixture
) -> None:
    client, guest = channel
    with caplog.at_level(logging.WARNING, logger="pytest_forkd.guest.client"):
        ping_through(client, guest, before_answer=[stale_frame()])
    assert client.protocol_errors == {"unknown_id": 1}
    assert len(caplog.records) == 1
