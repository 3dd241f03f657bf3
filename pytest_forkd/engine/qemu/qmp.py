"""A small synchronous QMP client.

QEMU's machine protocol is line-delimited JSON over a Unix socket. We need
three things the usual clients make awkward: passing file descriptors
(``getfd`` with SCM_RIGHTS, the only cheap way to hand QEMU 7.2 a migration
target), skipping asynchronous events (MIGRATION, STOP, SHUTDOWN) while
waiting for replies (callers poll the state they need: ``query-migrate``,
``query-status``), and bounded waits that fail with a message naming the
command.
"""

from __future__ import annotations

import array
import json
import socket
import threading
from typing import Any, Callable

from pytest_forkd.engine.base import EngineError
from pytest_forkd.waiting import poll_until


class QMPError(EngineError):
    """QEMU answered a QMP command with an error, or the monitor went away."""


class QMPConnectionError(QMPError):
    """The monitor socket could not be used: refused, reset, closed, timed out or garbled.

    ``cause`` keeps the low-level exception so callers that wait for a starting
    QEMU can tell "not listening yet" from "QEMU went away". The client's
    socket is closed whenever this is raised.
    """

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.cause = cause

    @property
    def not_listening_yet(self) -> bool:
        """True when the socket file is missing or nobody accepts on it (QEMU still starting)."""
        return isinstance(self.cause, (FileNotFoundError, ConnectionRefusedError))


class QMPClient:
    """Connected QMP session (greeting read, capabilities negotiated).

    Every transport failure (refused or reset connection, end of stream,
    malformed JSON, timeout) surfaces as :class:`QMPConnectionError` and closes
    the socket: a QEMU that aborts right after accepting the connection (as a
    failing KVM start does) must look like any other failed start.
    """

    def __init__(self, path: str, *, timeout: float = 30.0, greeting_timeout: float | None = None) -> None:
        self.path = path
        self._buffer = b""
        self._lock = threading.Lock()
        self._next_id = 0
        self._closed = False
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            first_wait = timeout if greeting_timeout is None else greeting_timeout
            self._sock.settimeout(first_wait)
            self._sock.connect(path)
            try:
                greeting = self._read_message()
            except QMPConnectionError as exc:
                if isinstance(exc.cause, socket.timeout):
                    raise QMPConnectionError(
                        f"QEMU's monitor at {path} sent no greeting within {first_wait:g} s", exc.cause
                    ) from exc
                raise
            self._sock.settimeout(timeout)
            if not isinstance(greeting, dict) or "QMP" not in greeting:
                raise QMPConnectionError(f"unexpected QMP greeting from {path}: {greeting!r:.200}")
            self.version = greeting["QMP"].get("version", {}).get("qemu", {})
            self.execute("qmp_capabilities")
        except OSError as exc:
            self.close()
            raise QMPConnectionError(f"cannot connect to QEMU's monitor at {path}: {exc}", exc) from exc
        except BaseException:
            self.close()
            raise

    # -- wire ------------------------------------------------------------
    def _read_message(self) -> object:
        """The next JSON value (one line, checked by the caller).

        Any transport failure closes the socket and raises QMPConnectionError.
        """
        try:
            while b"\n" not in self._buffer:
                chunk = self._sock.recv(65536)
                if not chunk:
                    raise QMPConnectionError("QEMU's monitor closed the connection (QEMU exited)")
                self._buffer += chunk
            line, self._buffer = self._buffer.split(b"\n", 1)
            return json.loads(line)
        except QMPConnectionError:
            self.close()
            raise
        except socket.timeout as exc:
            self.close()
            raise QMPConnectionError("QEMU's monitor did not answer in time", exc) from exc
        except OSError as exc:
            self.close()
            raise QMPConnectionError(f"QEMU's monitor connection failed ({exc})", exc) from exc
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            self.close()
            raise QMPConnectionError(f"QEMU's monitor sent a malformed message ({exc})", exc) from exc

    def execute(
        self,
        command: str,
        arguments: dict[str, Any] | None = None,
        *,
        fds: list[int] | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Run one command and return its ``return`` value; events that arrive meanwhile are skipped."""
        with self._lock:
            self._next_id += 1
            request_id = f"forkd-{self._next_id}"
            message: dict[str, Any] = {"execute": command, "id": request_id}
            if arguments:
                message["arguments"] = arguments
            data = json.dumps(message).encode() + b"\n"
            if self._closed:
                raise QMPConnectionError(f"QMP {command}: the monitor connection is closed (QEMU went away)")
            previous = self._sock.gettimeout()
            try:
                if timeout is not None:
                    self._sock.settimeout(timeout)
                if fds:
                    self._sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
                else:
                    self._sock.sendall(data)
                while True:
                    reply = self._read_message()
                    if not isinstance(reply, dict):
                        continue
                    if "event" in reply or reply.get("id") != request_id:
                        continue
                    if "error" in reply:
                        error = reply["error"]
                        raise QMPError(f"QMP {command} failed: {error.get('class')}: {error.get('desc')}")
                    return reply.get("return")
            except QMPConnectionError as exc:
                self.close()
                if isinstance(exc.cause, socket.timeout):
                    raise QMPConnectionError(f"QMP {command}: QEMU did not answer in time", exc.cause) from exc
                raise QMPConnectionError(f"QMP {command}: {exc}", exc.cause) from exc
            except OSError as exc:
                self.close()
                raise QMPConnectionError(f"QMP {command}: monitor connection lost ({exc})", exc) from exc
            finally:
                if timeout is not None and not self._closed:
                    self._sock.settimeout(previous)

    def wait_until(self, predicate: Callable[[], bool], *, timeout: float, what: str, interval: float = 0.002) -> None:
        """Poll ``predicate`` (which usually runs a query command) until true or time out."""
        poll_until(predicate, timeout=timeout, interval=interval, what=what, error=QMPError)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close the socket (idempotent); later commands fail with QMPConnectionError."""
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass
