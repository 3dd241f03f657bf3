"""Host side of the guest agent protocol (see :mod:`pytest_forkd.guest.wire`).

One :class:`AgentClient` owns the connected socket of one VM's agent channel.
A reader thread decodes reply frames and hands each to the request waiting
for its id; frames nobody waits for (stale replies that a snapshot froze in
flight, replies to requests that timed out) are dropped. Any number of
threads may send requests at the same time.

Request ids start at a random number per client: a VM restored from a
snapshot may emit a reply to a request of the client that served its parent,
possibly in another process, and that reply must not match a new request.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence

from ..errors import AgentError, ExecTimeout, VMError
from ..exec_result import ExecRecord, ExecResult
from . import wire

logger = logging.getLogger(__name__)

PING_TIMEOUT = 10.0
FILE_TIMEOUT = 120.0
# Extra time granted to an exec reply beyond the command's own timeout: the
# agent needs it to kill the command and ship its output.
EXEC_REPLY_GRACE = 15.0
# A guest that accepts no data for this long while we send a frame is hung.
SEND_STALL_TIMEOUT = 60.0
# How far the guest's wall clock may be off before ping() sets it again.
CLOCK_TOLERANCE = 0.5


class ChannelClosed(VMError):
    """The agent channel reached end of stream or failed: the VM or its agent died."""


class AgentTimeout(VMError):
    """The guest agent did not answer within the allotted time."""


class GuestOSError(AgentError):
    """An operating-system error in the guest (no such file, permission denied...).

    Carries ``errno`` (compare with the :mod:`errno` constants, e.g.
    ``exc.errno == errno.ENOENT``), ``strerror`` and ``path`` like OSError.
    It is not an OSError itself, so that a guest failure is never mistaken
    for one of the host.
    """

    def __init__(self, message: str, errno: int, strerror: str, path: str | None) -> None:
        super().__init__(message)
        self.errno = errno
        self.strerror = strerror
        self.path = path


class _PendingReply:
    """The reply to one request, assembled by the reader thread."""

    __slots__ = ("chunks", "complete", "done", "error", "fields")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.complete = False
        self.fields: dict | None = None
        self.chunks: list[bytes] = []
        self.error: dict | None = None


class AgentClient:
    """Talks to the guest agent over a connected stream socket, which it owns.

    ``log``: if given, every finished exec appends an :class:`ExecRecord` to
    it, so a failing test's report can show the VM's last commands.
    """

    def __init__(self, sock: socket.socket, *, log: deque[ExecRecord] | None = None) -> None:
        self._sock = sock
        # Bounds sends to a hung guest; the reader simply retries on timeout.
        sock.settimeout(SEND_STALL_TIMEOUT)
        self._log = log
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._pending: dict[int, _PendingReply] = {}
        self._next_id = int.from_bytes(os.urandom(6), "big")
        self._closed_reason: str | None = None
        self._epoch: dict[str, str] = {}
        self.new_epoch()
        self._frames = wire.FrameReader(self._recv)
        self._reader = threading.Thread(target=self._read_replies, name="forkd-agent-replies", daemon=True)
        self._reader.start()

    # -- public API -------------------------------------------------------------

    def ping(self, timeout: float = PING_TIMEOUT) -> dict:
        """Return the agent's ``pid``, ``monotonic``, ``wall_time`` and ``protocol``.

        If the guest's wall clock turns out to be off, start a new epoch and
        ping again, which sets it. That happens to a booting VM: its first
        request waits in the channel until the agent starts, so the host time
        it carries is stale when the agent applies it.
        """
        reply, clock_error = self._ping_once(timeout)
        if abs(clock_error) > CLOCK_TOLERANCE:
            self.new_epoch()
            reply, _ = self._ping_once(timeout)
        return reply

    def exec(
        self,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | str | None = None,
    ) -> ExecResult:
        """Run a command in the guest and return its result, whatever its exit code.

        A string runs under ``/bin/sh -c``; a sequence is an argv. ``env`` is
        merged over the agent's environment. On ``timeout`` the command's whole
        process group is killed and ExecTimeout is raised with the partial
        output in its ``result``. Without a timeout, waits as long as it runs.
        """
        request: dict = {"op": "exec", **_command_fields(command)}
        if timeout is not None:
            if not timeout > 0:
                raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
            request["timeout"] = float(timeout)
        if env is not None:
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
                raise TypeError("env must map str to str")
            request["env"] = dict(env)
        if cwd is not None:
            request["cwd"] = cwd
        stdin_bytes = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
        wait = None if timeout is None else timeout + EXEC_REPLY_GRACE
        reply, payload = self._request(request, stdin_bytes, wait=wait)
        try:
            stdout_length = reply["stdout_len"]
            result = ExecResult(
                command=command if isinstance(command, str) else tuple(command),
                exit_code=int(reply["exit_code"]),
                stdout_bytes=payload[:stdout_length],
                stderr_bytes=payload[stdout_length:],
                duration_ms=float(reply["duration_ms"]),
                timed_out=bool(reply.get("timed_out", False)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise AgentError(
                f"the guest agent sent a malformed exec reply ({exc!r} in {reply!r}); "
                "the guest image's agent may not match this pytest-forkd: rebuild the image"
            ) from None
        if self._log is not None:
            self._log.append(result.record())
        if result.timed_out:
            raise ExecTimeout(
                f"command {result.command_line!r} did not finish within {timeout:g} s; it was killed "
                "with its whole process group (the partial output is in .result)",
                result,
            )
        return result

    def read_file(self, path: str, *, timeout: float = FILE_TIMEOUT) -> bytes:
        """Return the contents of a guest file; GuestOSError if it cannot be read."""
        _, payload = self._request({"op": "read_file", "path": path}, wait=timeout)
        return payload

    def write_file(
        self, path: str, data: bytes | str, *, mode: int | None = None, timeout: float = FILE_TIMEOUT
    ) -> None:
        """Replace a guest file atomically; ``mode`` defaults to the old file's, else 0o666 & ~umask."""
        request: dict = {"op": "write_file", "path": path}
        if mode is not None:
            request["mode"] = mode
        self._request(request, data.encode() if isinstance(data, str) else data, wait=timeout)

    def new_epoch(self) -> None:
        """Make the next request reset the guest's wall clock and reseed its random pool.

        Call it after the VM behind this channel was restored from a snapshot.
        A new client starts a new epoch by itself.
        """
        with self._lock:
            self._epoch = {"epoch": secrets.token_hex(8), "seed": os.urandom(32).hex()}

    def close(self) -> None:
        """Close the channel; requests still waiting raise ChannelClosed."""
        self._fail("the agent client was closed")
        with contextlib.suppress(OSError):  # already disconnected
            self._sock.shutdown(socket.SHUT_RDWR)
        self._reader.join()
        self._sock.close()

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- requests ----------------------------------------------------------------

    def _ping_once(self, timeout: float) -> tuple[dict, float]:
        """Ping; also return how far the guest's clock lies outside the round trip, in seconds."""
        sent = time.time()
        fields, _ = self._request({"op": "ping"}, wait=timeout)
        received = time.time()
        guest_time = float(fields.get("wall_time", sent))
        clock_error = min(0.0, guest_time - sent) + max(0.0, guest_time - received)
        return {name: value for name, value in fields.items() if name not in ("id", "more")}, clock_error

    def _request(self, request: dict, payload: bytes = b"", *, wait: float | None) -> tuple[dict, bytes]:
        """Send one request and wait at most ``wait`` seconds (None: forever) for its reply."""
        pending = _PendingReply()
        with self._lock:
            if self._closed_reason is not None:
                raise ChannelClosed(self._closed_reason)
            request_id = self._next_id
            self._next_id += 1
            self._pending[request_id] = pending
            # Every request carries the epoch: the agent acts on the first one it sees.
            fields = {"id": request_id, **request, **self._epoch, "time": time.time()}
        try:
            self._send_message(fields, payload)
            if not pending.done.wait(wait):
                raise AgentTimeout(
                    f"the guest agent did not answer {request['op']!r} within {wait:g} s; "
                    "the guest may be hung or overloaded (see its console log)"
                )
        finally:
            with self._lock:
                del self._pending[request_id]
        if pending.error is not None:
            raise _guest_error(request["op"], pending.error)
        if not pending.complete or pending.fields is None:
            raise ChannelClosed(self._closed_reason)
        return pending.fields, b"".join(pending.chunks)

    def _send_message(self, fields: dict, payload: bytes) -> None:
        for frame_fields, chunk in wire.message_frames(fields, payload):
            header = wire.encode_header(frame_fields, len(chunk))
            with self._write_lock:
                if self._closed_reason is not None:
                    raise ChannelClosed(self._closed_reason)
                try:
                    self._sock.sendall(header)
                    if chunk:  # an empty send after a complete frame could fail for a peer that already left
                        self._sock.sendall(chunk)
                except TimeoutError:
                    # Part of a frame may be sent: the stream cannot be trusted any more.
                    reason = f"the guest agent accepted no data for {SEND_STALL_TIMEOUT:g} s"
                    self._fail(reason)
                    self._sock.shutdown(socket.SHUT_RDWR)
                    raise AgentTimeout(f"{reason}; the guest is hung (see its console log)") from None
                except OSError as exc:
                    self._fail(f"cannot send to the guest agent: {exc}")
                    raise ChannelClosed(self._closed_reason) from None

    # -- replies (reader thread) ---------------------------------------------------

    def _recv(self, size: int) -> bytes:
        while True:
            try:
                return self._sock.recv(size)
            except TimeoutError:
                continue  # the timeout exists for sends; reads wait for the agent

    def _read_replies(self) -> None:
        while True:
            try:
                frame = self._frames.read_frame()
            except wire.MalformedFrame as exc:
                logger.warning("guest agent channel: %s", exc)
                continue
            except OSError as exc:
                self._fail(f"the guest agent channel failed: {exc}")
                return
            if frame is None:
                self._fail("the guest agent closed its channel: the VM stopped or its agent died")
                return
            self._deliver(frame)

    def _deliver(self, frame: wire.Frame) -> None:
        fields = frame.fields
        with self._lock:
            pending = self._pending.get(fields["id"])
        if pending is None or pending.done.is_set():
            logger.debug("ignoring a reply frame nobody waits for: %r", frame)
            return
        if "error" in fields:
            pending.error = fields["error"]
        else:
            if pending.fields is None:
                pending.fields = fields
            if frame.payload:
                pending.chunks.append(frame.payload)
            if fields.get("more"):
                return
            pending.complete = True
        pending.done.set()

    def _fail(self, reason: str) -> None:
        """Mark the channel unusable and wake every waiting request; the first reason sticks."""
        with self._lock:
            if self._closed_reason is None:
                self._closed_reason = reason
            waiting = list(self._pending.values())
        for pending in waiting:
            pending.done.set()


def _command_fields(command: str | Sequence[str]) -> dict:
    if isinstance(command, str):
        return {"shell": command}
    argv = list(command)
    if not argv or not all(isinstance(arg, str) for arg in argv):
        raise TypeError(f"command must be a shell string or a non-empty sequence of str, got {command!r}")
    return {"argv": argv}


def _guest_error(operation: str, error: object) -> AgentError:
    if not isinstance(error, dict):
        return AgentError(f"the guest agent failed {operation!r} with an unreadable error: {error!r}")
    message = f"{operation} in the guest failed: {error.get('message', error)}"
    errno = error.get("errno")
    if isinstance(errno, int):
        return GuestOSError(message, errno, os.strerror(errno), error.get("path"))
    return AgentError(message)
