"""A small synchronous QMP client.

QEMU's machine protocol is line-delimited JSON over a Unix socket. We need
three things the usual clients make awkward: passing file descriptors
(``getfd`` with SCM_RIGHTS, the only cheap way to hand QEMU 7.2 a migration
target), collecting asynchronous events (MIGRATION, STOP, SHUTDOWN) while
waiting for replies, and bounded waits that fail with a message naming the
command.
"""

from __future__ import annotations

import array
import json
import socket
import threading
from collections import deque
from typing import Any, Callable

from tenacity import RetryError, Retrying, retry_if_result, stop_after_delay, wait_fixed

from ..errors import VMError


class QMPError(VMError):
    """QEMU answered a QMP command with an error, or the monitor went away."""


class QMPClient:
    """Connected QMP session (greeting read, capabilities negotiated)."""

    def __init__(self, path: str, *, timeout: float = 30.0) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        self._sock.connect(path)
        self._buffer = b""
        self._lock = threading.Lock()
        self._next_id = 0
        self.events: deque[dict[str, Any]] = deque(maxlen=256)
        try:
            greeting = self._read_message()
        except socket.timeout as exc:
            raise QMPError(f"QEMU's monitor at {path} sent no greeting within {timeout:g} s") from exc
        if "QMP" not in greeting:
            raise QMPError(f"unexpected QMP greeting: {greeting!r}")
        self.version = greeting["QMP"].get("version", {}).get("qemu", {})
        self.execute("qmp_capabilities")

    # -- wire ------------------------------------------------------------
    def _read_message(self) -> dict[str, Any]:
        while b"\n" not in self._buffer:
            chunk = self._sock.recv(65536)  # socket.timeout propagates: the caller names what timed out
            if not chunk:
                raise QMPError("QEMU's monitor closed the connection (QEMU exited)")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def execute(self, command: str, arguments: dict[str, Any] | None = None, *,
                fds: list[int] | None = None, timeout: float | None = None) -> Any:
        """Run one command and return its ``return`` value; events seen meanwhile are kept."""
        with self._lock:
            self._next_id += 1
            request_id = f"forkd-{self._next_id}"
            message: dict[str, Any] = {"execute": command, "id": request_id}
            if arguments:
                message["arguments"] = arguments
            data = json.dumps(message).encode() + b"\n"
            previous = self._sock.gettimeout()
            if timeout is not None:
                self._sock.settimeout(timeout)
            try:
                if fds:
                    self._sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
                else:
                    self._sock.sendall(data)
                while True:
                    reply = self._read_message()
                    if "event" in reply:
                        self.events.append(reply)
                        continue
                    if reply.get("id") != request_id:
                        continue
                    if "error" in reply:
                        error = reply["error"]
                        raise QMPError(f"QMP {command} failed: {error.get('class')}: {error.get('desc')}")
                    return reply.get("return")
            except OSError as exc:
                if isinstance(exc, socket.timeout):
                    raise QMPError(f"QMP {command}: QEMU did not answer in time") from exc
                raise QMPError(f"QMP {command}: monitor connection lost ({exc})") from exc
            finally:
                self._sock.settimeout(previous)

    def wait_until(self, predicate: Callable[[], bool], *, timeout: float, what: str,
                   interval: float = 0.002) -> None:
        """Poll ``predicate`` (which usually runs a query command) until true or time out."""
        try:
            for attempt in Retrying(stop=stop_after_delay(timeout), wait=wait_fixed(interval),
                                    retry=retry_if_result(lambda done: not done)):
                with attempt:
                    done = predicate()
                if not attempt.retry_state.outcome.failed:
                    attempt.retry_state.set_result(done)
        except RetryError:
            raise QMPError(f"timed out after {timeout:g} s waiting for {what}") from None

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
