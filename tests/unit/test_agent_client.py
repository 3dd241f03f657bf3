"""The host client against a fake agent whose every frame the test writes by hand."""

from __future__ import annotations

import errno
import socket
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from pytest_forkd.errors import AgentError, ExecTimeout, VMError
from pytest_forkd.guest import client as client_module
from pytest_forkd.guest import wire
from pytest_forkd.guest.client import AgentClient, AgentTimeout, ChannelClosed, GuestOSError


class FakeAgent:
    """The guest end of the channel, played by the test."""

    def __init__(self, sock: socket.socket) -> None:
        sock.settimeout(5)
        self.sock = sock
        self._reader = wire.FrameReader(sock.recv)

    def receive(self) -> wire.Frame:
        frame = self._reader.read_frame()
        assert frame is not None, "the client closed the channel"
        return frame

    def send(self, fields: dict, payload: bytes = b"") -> None:
        self.sock.sendall(wire.encode_header(fields, len(payload)) + payload)


@pytest.fixture
def channel() -> Iterator[tuple[socket.socket, FakeAgent]]:
    host_end, guest_end = socket.socketpair()
    yield host_end, FakeAgent(guest_end)
    guest_end.close()


@pytest.fixture
def client(channel: tuple[socket.socket, FakeAgent]) -> Iterator[AgentClient]:
    with AgentClient(channel[0]) as client:
        yield client


@pytest.fixture
def fake(channel: tuple[socket.socket, FakeAgent]) -> FakeAgent:
    return channel[1]


@pytest.fixture
def background() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=4) as pool:
        yield pool


def ping_reply(request_id: int, pid: int = 42, clock_error: float = 0.0) -> dict:
    return {"id": request_id, "pid": pid, "monotonic": 1.0, "wall_time": time.time() + clock_error, "protocol": 1}


def test_stale_replies_and_line_noise_are_ignored(client: AgentClient, fake: FakeAgent, background) -> None:
    answer: Future = background.submit(client.ping)
    request = fake.receive().fields

    fake.send(ping_reply(request["id"] - 1, pid=1))  # frozen in flight by a snapshot
    fake.sock.sendall(b"tail of a frame cut in half")
    fake.send({"id": request["id"] + 1, "more": False}, b"stray continuation")
    fake.send(ping_reply(request["id"]))

    assert answer.result(timeout=5)["pid"] == 42


def test_requests_carry_the_epoch_until_a_new_one_starts(client: AgentClient, fake: FakeAgent, background) -> None:
    def ping_once() -> dict:
        answer = background.submit(client.ping)
        request = fake.receive().fields
        fake.send(ping_reply(request["id"]))
        answer.result(timeout=5)
        return request

    first, second = ping_once(), ping_once()
    client.new_epoch()
    third = ping_once()

    assert first["epoch"] == second["epoch"] != third["epoch"]
    assert first["seed"] == second["seed"] != third["seed"]
    assert len(bytes.fromhex(third["seed"])) == 32
    assert second["time"] >= first["time"]
    assert second["id"] == first["id"] + 1


def test_ping_sets_a_wrong_guest_clock_again_with_a_new_epoch(client: AgentClient, fake: FakeAgent, background) -> None:
    answer = background.submit(client.ping)
    stale = fake.receive().fields
    fake.send(ping_reply(stale["id"], pid=1, clock_error=-4.0))  # the request waited while the guest booted

    again = fake.receive().fields
    assert again["op"] == "ping"
    assert again["epoch"] != stale["epoch"] and again["time"] > stale["time"]
    fake.send(ping_reply(again["id"], pid=2))

    assert answer.result(timeout=5)["pid"] == 2


def test_ping_with_a_correct_guest_clock_asks_once(client: AgentClient, fake: FakeAgent, background) -> None:
    answer = background.submit(client.ping)
    first = fake.receive().fields
    fake.send(ping_reply(first["id"]))
    assert answer.result(timeout=5)["pid"] == 42

    answer = background.submit(client.read_file, "/next")
    following = fake.receive().fields  # the read, not a second ping

    assert following["op"] == "read_file"
    assert following["epoch"] == first["epoch"]
    fake.send({"id": following["id"], "more": False}, b"content")
    assert answer.result(timeout=5) == b"content"


def test_each_client_starts_its_ids_at_a_random_number() -> None:
    first_ids = set()
    for _ in range(3):
        host_end, guest_end = socket.socketpair()
        # The client closes first, so the unanswered ping ends at once.
        with ThreadPoolExecutor() as pool, AgentClient(host_end) as client:
            pool.submit(client.ping)
            first_ids.add(FakeAgent(guest_end).receive().fields["id"])
        guest_end.close()

    assert len(first_ids) == 3


def test_replies_reach_their_own_requests_in_any_order(client: AgentClient, fake: FakeAgent, background) -> None:
    answers = [background.submit(client.exec, f"echo {n}") for n in range(3)]
    requests = [fake.receive().fields for _ in range(3)]

    for request in reversed(requests):
        fake.send({"id": request["id"], "more": True, "fd": 1}, request["shell"].encode())
        fake.send({"id": request["id"], "exit_code": 0, "duration_ms": 1.0})

    assert [answer.result(timeout=5).stdout for answer in answers] == [f"echo {n}" for n in range(3)]


def test_exec_splits_payload_and_raises_on_timeout(channel, fake: FakeAgent, background) -> None:
    with AgentClient(channel[0]) as client:
        answer = background.submit(client.exec, ["ls", "-l"], timeout=3)
        request = fake.receive().fields
        assert (request["argv"], request["timeout"]) == (["ls", "-l"], 3.0)
        fake.send({"id": request["id"], "more": True, "fd": 1}, b"out")
        fake.send({"id": request["id"], "more": True, "fd": 2}, b"err")
        fake.send({"id": request["id"], "exit_code": 2, "duration_ms": 5.0})
        result = answer.result(timeout=5)
        assert (result.stdout_bytes, result.stderr_bytes, result.exit_code) == (b"out", b"err", 2)

        answer = background.submit(client.exec, "sleep 9", timeout=1)
        request = fake.receive().fields
        fake.send({"id": request["id"], "more": True, "fd": 1}, b"part")
        fake.send({"id": request["id"], "exit_code": -9, "signal": 9, "duration_ms": 1000.0, "timed_out": True})
        with pytest.raises(ExecTimeout) as caught:
            answer.result(timeout=5)

    assert caught.value.result.stdout == "part"


def test_multi_frame_reply_is_assembled(client: AgentClient, fake: FakeAgent, background) -> None:
    answer = background.submit(client.read_file, "/big")
    request = fake.receive().fields
    assert (request["op"], request["path"]) == ("read_file", "/big")

    fake.send({"id": request["id"], "more": True}, b"one,")
    fake.send({"id": request["id"], "more": True}, b"two,")
    fake.send({"id": request["id"], "more": False}, b"three")

    assert answer.result(timeout=5) == b"one,two,three"


def test_error_frame_ends_a_reply_in_the_middle(client: AgentClient, fake: FakeAgent, background) -> None:
    answer = background.submit(client.read_file, "/flaky")
    request_id = fake.receive().fields["id"]

    fake.send({"id": request_id, "more": True}, b"partial")
    error = {"type": "OSError", "message": "/flaky: Input/output error", "errno": errno.EIO, "path": "/flaky"}
    fake.send({"id": request_id, "more": False, "error": error})

    with pytest.raises(GuestOSError) as caught:
        answer.result(timeout=5)
    assert (caught.value.errno, caught.value.path) == (errno.EIO, "/flaky")
    assert "read_file in the guest failed: /flaky: Input/output error" in str(caught.value)


def test_error_without_errno_is_a_plain_agent_error(client: AgentClient, fake: FakeAgent, background) -> None:
    answer = background.submit(client.ping)
    request_id = fake.receive().fields["id"]
    fake.send({"id": request_id, "error": {"type": "UnknownOperation", "message": "unknown operation 'ping'"}})

    with pytest.raises(AgentError) as caught:
        answer.result(timeout=5)
    assert not isinstance(caught.value, GuestOSError)
    assert "unknown operation" in str(caught.value)


def test_malformed_exec_reply_says_the_image_may_be_outdated(client: AgentClient, fake: FakeAgent, background) -> None:
    answer = background.submit(client.exec, "true")
    fake.send({"id": fake.receive().fields["id"], "exit_code": 0})

    with pytest.raises(AgentError, match="rebuild the image"):
        answer.result(timeout=5)


def test_write_file_streams_chunks(client: AgentClient, fake: FakeAgent, background) -> None:
    data = bytes(range(256)) * (wire.CHUNK_SIZE // 256) + b"rest"
    answer = background.submit(client.write_file, "/dest", data, mode=0o600)

    first = fake.receive()
    assert {k: first.fields[k] for k in ("op", "path", "mode", "more")} == {
        "op": "write_file",
        "path": "/dest",
        "mode": 0o600,
        "more": True,
    }
    second = fake.receive()
    assert second.fields == {"id": first.fields["id"], "more": False}
    assert first.payload + second.payload == data
    fake.send({"id": first.fields["id"], "size": len(data)})

    assert answer.result(timeout=5) is None


def test_peer_closing_raises_channel_closed(client: AgentClient, fake: FakeAgent, background) -> None:
    answer = background.submit(client.exec, "sleep 100")
    fake.receive()

    fake.sock.close()

    with pytest.raises(ChannelClosed, match="closed its channel") as caught:
        answer.result(timeout=5)
    assert isinstance(caught.value, VMError)
    with pytest.raises(ChannelClosed):
        client.ping()


def test_close_wakes_waiting_requests(client: AgentClient, fake: FakeAgent, background) -> None:
    answer = background.submit(client.exec, "sleep 100")
    fake.receive()

    client.close()

    with pytest.raises(ChannelClosed, match="client was closed"):
        answer.result(timeout=5)


def test_unanswered_request_times_out_and_its_late_reply_is_ignored(
    client: AgentClient, fake: FakeAgent, background
) -> None:
    with pytest.raises(AgentTimeout, match=r"did not answer 'ping' within 0\.05 s"):
        client.ping(timeout=0.05)
    late = fake.receive().fields
    fake.send(ping_reply(late["id"], pid=1))

    answer = background.submit(client.ping)
    fake.send(ping_reply(fake.receive().fields["id"], pid=2))

    assert answer.result(timeout=5)["pid"] == 2


def test_exec_reply_wait_is_bounded_by_timeout_plus_grace(client: AgentClient, monkeypatch) -> None:
    monkeypatch.setattr(client_module, "EXEC_REPLY_GRACE", 0.05)

    with pytest.raises(AgentTimeout, match=r"within 0\.1 s"):
        client.exec("true", timeout=0.05)


def test_guest_that_stops_reading_fails_the_channel(monkeypatch, fake: FakeAgent, channel) -> None:
    monkeypatch.setattr(client_module, "SEND_STALL_TIMEOUT", 0.05)
    with AgentClient(channel[0]) as client:
        with pytest.raises(AgentTimeout, match="accepted no data"):
            client.write_file("/dest", b"x" * (4 * wire.CHUNK_SIZE))
        with pytest.raises(ChannelClosed, match="accepted no data"):
            client.ping()


@pytest.mark.parametrize(
    ("command", "options", "error"),
    [
        ([], {}, TypeError),
        (["ls", 3], {}, TypeError),
        (b"ls", {}, TypeError),
        ("ls", {"timeout": 0}, ValueError),
        ("ls", {"env": {"A": 1}}, TypeError),
    ],
)
def test_exec_rejects_bad_arguments_before_sending(client: AgentClient, command, options: dict, error: type) -> None:
    with pytest.raises(error):
        client.exec(command, **options)
