"""The QMP client against a scripted server on a Unix socket: replies, events, errors, fds, timeouts."""

from __future__ import annotations

import array
import json
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Callable, Iterator

import pytest

from pytest_forkd.engine.qemu import qmp as qmp_module
from pytest_forkd.engine.qemu.qmp import QMPClient, QMPConnectionError, QMPError
from pytest_forkd.errors import ForkdError

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


def test_events_and_replies_to_other_requests_are_skipped(serve: Callable[..., FakeQMPServer]) -> None:
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
            client.execute("query-migrate", timeout=0.05)
    finally:
        client.close()


def test_a_timed_out_command_is_named_in_the_error(serve: Callable[..., FakeQMPServer]) -> None:
    client = QMPClient(str(serve(lambda command, fds: []).path))
    try:
        with pytest.raises(QMPError, match="query-migrate"):
            client.execute("query-migrate", timeout=0.05)
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


# -- transport failures: every one is a ForkdError and leaves no socket open -------------------


class RawServer:
    """Accepts one connection and does ``behaviour(connection)`` with it: resets, garbage, silence."""

    def __init__(self, path: Path, behaviour: Callable[[socket.socket], None]) -> None:
        self.path = path
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        self._listener.listen(1)
        self._done = threading.Event()

        def serve() -> None:
            connection, _ = self._listener.accept()
            try:
                behaviour(connection)
            finally:
                self._done.wait(5)
                connection.close()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._done.set()
        self._listener.close()
        self._thread.join(timeout=5)


def reset_at_once(connection: socket.socket) -> None:
    """What QEMU aborting right after accepting the monitor connection looks like: a TCP-style reset."""
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    connection.close()


def greet_then(behaviour: Callable[[socket.socket], None]) -> Callable[[socket.socket], None]:
    def run(connection: socket.socket) -> None:
        connection.sendall(json.dumps(GREETING).encode() + b"\r\n")
        capabilities = json.loads(connection.recv(65536))
        connection.sendall(json.dumps({"return": {}, "id": capabilities["id"]}).encode() + b"\r\n")
        connection.recv(65536)  # the command under test
        behaviour(connection)

    return run


@pytest.fixture
def raw(tmp_path: Path) -> Iterator[Callable[[Callable[[socket.socket], None]], RawServer]]:
    servers: list[RawServer] = []

    def start(behaviour: Callable[[socket.socket], None]) -> RawServer:
        server = RawServer(tmp_path / f"raw{len(servers)}.sock", behaviour)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


@pytest.fixture
def client_sockets(monkeypatch: pytest.MonkeyPatch) -> list[socket.socket]:
    """Every socket the QMP client creates, to check that a failure leaves each one closed."""
    created: list[socket.socket] = []
    real = socket.socket

    def recording(*args: object, **kwargs: object) -> socket.socket:
        sock = real(*args, **kwargs)
        if sys._getframe(1).f_globals.get("__name__") == qmp_module.__name__:
            created.append(sock)
        return sock

    monkeypatch.setattr(qmp_module.socket, "socket", recording)
    return created


@pytest.mark.parametrize(
    "behaviour, timeout, message",
    [
        (lambda connection: connection.close(), 2, "closed the connection"),
        (lambda connection: connection.sendall(b"{not json\n"), 2, "malformed message"),
        (lambda connection: connection.sendall(b"\xff\xfe\n"), 2, "malformed message"),
        (lambda connection: None, 0.05, "sent no greeting within 0.05 s"),  # waits the whole timeout
    ],
)
def test_a_broken_greeting_is_a_connection_error_and_closes_the_socket(
    raw, client_sockets, behaviour, timeout, message
) -> None:
    server = raw(behaviour)
    with pytest.raises(QMPConnectionError, match=message) as info:
        QMPClient(str(server.path), greeting_timeout=timeout)
    assert isinstance(info.value, ForkdError)
    assert len(client_sockets) == 1 and client_sockets[0].fileno() == -1


def test_a_reset_right_after_accepting_is_a_connection_error(raw, client_sockets) -> None:
    server = raw(reset_at_once)
    with pytest.raises(QMPConnectionError) as info:
        QMPClient(str(server.path), greeting_timeout=2)
    assert not info.value.not_listening_yet
    assert client_sockets[0].fileno() == -1


def test_nobody_listening_is_a_connection_error_that_says_not_yet(tmp_path: Path) -> None:
    with pytest.raises(QMPConnectionError, match="cannot connect") as info:
        QMPClient(str(tmp_path / "missing.sock"))
    assert info.value.not_listening_yet


@pytest.mark.parametrize(
    "behaviour, message",
    [
        (reset_at_once, "QMP query-status: "),
        (lambda connection: connection.sendall(b'{"return": \n'), "malformed message"),
        (lambda connection: connection.close(), "closed the connection"),
    ],
)
def test_a_transport_failure_during_a_command_closes_the_client(raw, client_sockets, behaviour, message) -> None:
    client = QMPClient(str(raw(greet_then(behaviour)).path))
    with pytest.raises(QMPConnectionError, match=message):
        client.execute("query-status", timeout=2)
    assert client.closed and client_sockets[0].fileno() == -1
    with pytest.raises(QMPConnectionError, match="connection is closed"):
        client.execute("query-status")


def test_a_timed_out_command_closes_the_client(serve: Callable[..., FakeQMPServer]) -> None:
    """A reply that arrives after the timeout would answer the next command: the session is over."""
    client = QMPClient(str(serve(lambda command, fds: []).path))
    with pytest.raises(QMPConnectionError, match="did not answer in time"):
        client.execute("query-migrate", timeout=0.05)
    assert client.closed
