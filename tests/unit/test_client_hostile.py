"""The host client against a guest that breaks the protocol: it stays bounded, reports and recovers."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from pytest_forkd.errors import AgentError, ForkdError, GuestProtocolError
from pytest_forkd.guest import client as client_module
from pytest_forkd.guest import wire
from pytest_forkd.guest.client import AgentClient, AgentTimeout, ChannelClosed


class HostileGuest:
    """The guest end of the channel, sending whatever the test wants."""

    def __init__(self, sock: socket.socket) -> None:
        sock.settimeout(10)
        self.sock = sock
        self._reader = wire.FrameReader(sock.recv)

    def receive(self, op: str | None = None) -> dict:
        """The next request (credit frames skipped unless asked for)."""
        while True:
            frame = self._reader.read_frame()
            assert frame is not None, "the client closed the channel"
            if op is not None or frame.fields.get("op") != "credit":
                if op is None or frame.fields.get("op") == op:
                    return frame.fields

    def send(self, fields: dict, payload: bytes = b"") -> None:
        self.sock.sendall(wire.encode_header(fields, len(payload)) + payload)

    def send_raw_json(self, body: bytes) -> None:
        self.sock.sendall(wire.HEADER.pack(wire.MAGIC, len(body), 0) + body)

    def answer_ping(self, request: dict) -> None:
        self.send({"id": request["id"], "pid": 7, "monotonic": 1.0, "wall_time": time.time(), "protocol": 2})


@pytest.fixture
def pair() -> Iterator[tuple[AgentClient, HostileGuest]]:
    host_end, guest_end = socket.socketpair()
    client = AgentClient(host_end)
    yield client, HostileGuest(guest_end)
    client.close()
    guest_end.close()


@pytest.fixture
def background() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=4) as pool:
        yield pool


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_deep_huge_and_undecodable_json_are_counted_and_the_reader_goes_on(pair, background) -> None:
    client, guest = pair
    answer = background.submit(client.ping)
    request = guest.receive()

    guest.send_raw_json(b"[" * 500_000 + b"]" * 500_000)  # RecursionError in json.loads
    guest.send_raw_json(b'{"id": ' + b"9" * 100_000 + b"}")  # too many digits for int()
    guest.send_raw_json(b'{"id": 1, "x": "\xff\xfe"}')  # not UTF-8
    guest.send({"id": request["id"] + 5, "junk": "x" * 900_000})  # huge JSON, unknown id
    guest.send_raw_json(b'["not", "an", "object"]')
    guest.answer_ping(request)

    assert answer.result(timeout=10)["pid"] == 7
    assert client.protocol_errors == {"json": 3, "unknown_id": 1, "id": 1}
    assert client.closed_reason is None


def test_a_guest_that_sends_hostile_frames_and_then_behaves_is_served_again(pair, background) -> None:
    client, guest = pair
    for _ in range(3):
        answer = background.submit(client.ping)
        request = guest.receive()
        guest.sock.sendall(b"\x00garbage\xff" * 1000)
        guest.send_raw_json(b"[" * 100_000)
        guest.send({"id": request["id"] + 1000, "more": True}, b"stray")
        guest.answer_ping(request)
        assert answer.result(timeout=10)["pid"] == 7

    assert sum(client.protocol_errors.values()) == 9


def test_endless_continuation_frames_do_not_grow_host_memory(pair, background) -> None:
    client, guest = pair
    answer = background.submit(client.read_file, "/endless", max_size=8 << 20)
    request = guest.receive()
    before = rss_bytes()
    peak = before
    chunk = b"\xab" * wire.MAX_PAYLOAD_SIZE
    sent = 0
    try:
        while sent < 160 << 20:  # far more than the host may keep
            guest.send({"id": request["id"], "more": True}, chunk)
            sent += len(chunk)
            peak = max(peak, rss_bytes())
    except (BrokenPipeError, ConnectionResetError):
        pass

    with pytest.raises(AgentError, match="larger than max_size"):
        answer.result(timeout=10)
    assert peak - before < 64 << 20, f"host memory grew by {(peak - before) >> 20} MiB"


def test_endless_continuation_of_a_small_reply_is_a_protocol_error(pair, background) -> None:
    client, guest = pair
    answer = background.submit(client.ping, 30)
    request = guest.receive()
    for _ in range(20):
        guest.send({"id": request["id"], "more": True}, b"x" * 65536)

    with pytest.raises(GuestProtocolError, match="grew past"):
        answer.result(timeout=10)


def test_a_guest_flooding_garbage_is_cut_off_and_every_call_says_why(pair, background) -> None:
    client, guest = pair
    answer = background.submit(client.exec, "true")
    guest.receive()

    def flood() -> None:
        try:
            for _ in range(400):
                guest.sock.sendall(b"not a frame " * 30_000)  # no magic anywhere
        except OSError:
            pass  # cut off

    flooder = threading.Thread(target=flood)
    flooder.start()
    with pytest.raises(GuestProtocolError, match="cut off") as caught:
        answer.result(timeout=30)
    flooder.join()

    assert "garbage" in str(caught.value)
    with pytest.raises(GuestProtocolError, match="cut off"):
        client.ping(timeout=1)


def test_replies_with_wrong_ids_past_the_budget_cut_the_guest_off(pair, background) -> None:
    client, guest = pair
    answer = background.submit(client.ping, 60)
    request = guest.receive()
    with pytest.raises(OSError):  # noqa: PT012 - the host shuts the channel while we send
        for offset in range(1, 100_000):
            guest.send({"id": request["id"] + offset, "pid": 1})

    with pytest.raises(GuestProtocolError, match="unknown_id"):
        answer.result(timeout=10)


def test_a_dead_reply_reader_fails_pending_and_later_calls(pair, background, monkeypatch) -> None:
    client, guest = pair
    answer = background.submit(client.exec, "sleep 100")  # no timeout: waits for the channel
    guest.receive()

    def broken(*args: object) -> None:
        raise RuntimeError("decoder bug")

    monkeypatch.setattr(client, "_deliver", broken)
    guest.send({"id": 1, "pid": 1})

    with pytest.raises(GuestProtocolError, match="reader .* stopped: RuntimeError"):
        answer.result(timeout=10)
    with pytest.raises(GuestProtocolError):
        client.ping(timeout=1)


def test_a_call_without_timeout_ends_when_the_channel_breaks(pair, background) -> None:
    client, guest = pair
    answer = background.submit(client.exec, "sleep 1000")
    guest.receive()
    guest.sock.shutdown(socket.SHUT_RDWR)

    with pytest.raises(ChannelClosed, match="closed its channel"):
        answer.result(timeout=10)
    assert isinstance(ChannelClosed("x"), ForkdError)


def test_exec_output_is_captured_head_and_tail_whatever_the_guest_sends(pair, background) -> None:
    client, guest = pair
    answer = background.submit(client.exec, "spam", max_output=1000)
    request = guest.receive()
    assert request["max_output"] == 1000
    body = bytes(range(256)) * 4096  # 1 MiB
    for _ in range(8):  # the guest ignores max_output and sends 8 MiB
        guest.send({"id": request["id"], "more": True, "fd": 1}, body)
    credits = []
    while sum(credits) < 6 * len(body):  # the host hands out credit as it consumes
        credit = guest.receive(op="credit")
        assert credit["ref"] == request["id"]
        credits.append(credit["bytes"])
    guest.send({"id": request["id"], "more": True, "fd": 2}, b"e" * 10)
    guest.send({"id": request["id"], "exit_code": 0, "signal": None, "duration_ms": 3.0, "timed_out": False})

    result = answer.result(timeout=10)
    assert result.truncated
    assert result.stdout_bytes == body[:500] + body[-500:]
    assert result.stderr_bytes == b"e" * 10


def test_an_output_frame_without_a_stream_is_a_protocol_error(pair, background) -> None:
    client, guest = pair
    answer = background.submit(client.exec, "x")
    request = guest.receive()
    guest.send({"id": request["id"], "more": True, "fd": 3}, b"?")

    with pytest.raises(GuestProtocolError, match="bad 'fd'"):
        answer.result(timeout=10)


def test_a_hung_guest_times_out_within_the_timeout(pair) -> None:
    client, _guest = pair
    with pytest.raises(AgentTimeout, match=r"did not answer 'ping' within 0\.05 s"):
        client.ping(timeout=0.05)  # the guest never answers: any timeout takes this path


def test_budget_constants_allow_a_burst_and_refill() -> None:
    budget = client_module._Budget(3, 1000.0)
    assert all(budget.spend() for _ in range(3))
    time.sleep(0.01)
    assert budget.spend()
