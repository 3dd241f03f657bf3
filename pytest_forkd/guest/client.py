"""Host side of the guest agent protocol (see :mod:`pytest_forkd.guest.wire`).

One :class:`AgentClient` owns the connected socket of one VM's agent channel.
A reader thread decodes reply frames and hands each to the call waiting for
its id; frames nobody waits for (stale replies that a snapshot froze in
flight, the rest of a reply whose call gave up) are dropped. Any number of
threads may send requests at the same time.

The guest is not trusted: whatever it sends, the host's memory stays within
fixed limits (a frame's size, a reply's size, ``max_output`` per command
stream), a malformed frame is counted and skipped, and the reader thread
never dies of it. A guest that keeps misbehaving past a budget is cut off:
every waiting and later call fails with :class:`GuestProtocolError`.

Command output streams (:meth:`AgentClient.start_stream`): the agent sends it
as it is produced and the host returns credit as it consumes it, so a slow
consumer stops the command instead of filling memory on either side.

Request ids start at a random number per client: a VM restored from a
snapshot may emit a reply to a request of the client that served its parent,
possibly in another process, and that reply must not match a new request.

The calls in flight and how each kind of reply is assembled are in
:mod:`.calls`; the checked fields of ``exec`` and ``spawn`` requests in
:mod:`.requests`. Their public names are importable from here as well.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pytest_forkd.guest.exec_result import ExecResult

from ..errors import AgentError, ExecTimeout, GuestProtocolError, VMError
from . import wire
from .calls import (
    MAX_SMALL_REPLY,
    PROCESS_WINDOW,
    AgentTimeout,
    ChannelClosed,
    GuestOSError,
    ProcessCall,
    ProcessListener,
    StreamCall,
    UploadCall,
    _Call,
    _MessageCall,
    _shown,
    _Violation,
    guest_error,
)
from .capture import OutputCapture
from .requests import DEFAULT_MAX_OUTPUT, exec_request, spawn_request, terminal_size

# What other modules import from here, wherever it is defined (the asyncio cancel path builds a
# bare ``_MessageCall`` to send its cancel request unticketed).
__all__ = [
    "DEFAULT_MAX_FILE_SIZE",
    "DEFAULT_MAX_OUTPUT",
    "MAX_SMALL_REPLY",
    "PROCESS_WINDOW",
    "AgentClient",
    "AgentTimeout",
    "ChannelClosed",
    "GuestOSError",
    "ProcessCall",
    "ProcessListener",
    "StreamCall",
    "UploadCall",
    "_MessageCall",
    "exec_request",
    "spawn_request",
    "terminal_size",
]

logger = logging.getLogger(__name__)

PING_TIMEOUT = 10.0
FILE_TIMEOUT = 120.0
# Extra time granted to an exec reply beyond the command's own timeout: the
# agent needs it to kill the command (a fork bomb takes seconds to die) and ship its output.
EXEC_REPLY_GRACE = 30.0
# The agent answers a cancel once the target stopped, or after its own 5 s.
CANCEL_GRACE = 5.0
# A guest that accepts no data for this long while we send a frame is hung.
SEND_STALL_TIMEOUT = 60.0
# How far the guest's wall clock may be off before ping() sets it again.
CLOCK_TOLERANCE = 0.5
#: The largest file read_file accepts by default.
DEFAULT_MAX_FILE_SIZE = 64 << 20
# Misbehaviour budget: a guest may commit this many protocol violations in a
# burst, and this many more per second, before it is cut off. A guest that
# answers properly commits none; a restored one a few (stale replies).
PROTOCOL_ERROR_BURST = 100
PROTOCOL_ERROR_RATE = 5.0
# Ids of calls that ended recently: the rest of their replies is expected noise.
RECENT_IDS = 256
# Warnings logged per kind of violation before the rest only go to debug.
_WARNINGS_PER_KIND = 5


class _Budget:
    """A token bucket of protocol violations: ``burst`` at once, refilled at ``rate`` per second."""

    def __init__(self, burst: int, rate: float) -> None:
        self._burst = burst
        self._rate = rate
        self._tokens = float(burst)
        self._last = time.monotonic()

    def spend(self) -> bool:
        """Charge one violation; False when the budget is exhausted."""
        now = time.monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
        self._last = now
        self._tokens -= 1
        return self._tokens >= 0


class AgentClient:
    """Talks to the guest agent over a connected stream socket, which it owns.

    What a VM was asked to do is kept by its transcript
    (:class:`~pytest_forkd.analysis.transcript.Transcript`), not here.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        # Bounds sends to a hung guest; the reader simply retries on timeout.
        sock.settimeout(SEND_STALL_TIMEOUT)
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._pending: dict[int, _Call] = {}
        self._recent: deque[int] = deque(maxlen=RECENT_IDS)
        self._next_id = int.from_bytes(os.urandom(6), "big")
        self._closed_reason: str | None = None
        self._closed_error: type[VMError] = ChannelClosed
        self._budget = _Budget(PROTOCOL_ERROR_BURST, PROTOCOL_ERROR_RATE)
        self._stale_expected = False  # see expect_stale_replies
        self.protocol_errors: collections.Counter[str] = collections.Counter()
        """Protocol violations of the guest seen so far, by kind (garbage, json, id, unknown_id, ...)."""
        self._epoch: dict[str, str] = {}
        self.new_epoch()
        # Names this client to the agent: a VM restored from a snapshot hears from a new
        # client, and drops the process output streams of the old one (see ``spawn``).
        self._token = secrets.token_hex(8)
        self._frames = wire.FrameReader(self._recv)
        self._reader = threading.Thread(target=self._read_replies, name="forkd-agent-replies", daemon=True)
        self._reader.start()

    # -- public API -------------------------------------------------------------

    @property
    def closed_reason(self) -> str | None:
        """Why the channel is unusable, or None while it works."""
        return self._closed_reason

    def ping(self, timeout: float = PING_TIMEOUT) -> dict[str, Any]:
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
        max_output: int = DEFAULT_MAX_OUTPUT,
        pty: bool | tuple[int, int] = False,
        user: str | None = None,
    ) -> ExecResult:
        """Run a command in the guest and return its result, whatever its exit code.

        A string runs under ``/bin/sh -c``; a sequence is an argv. ``env`` is
        merged over the agent's environment. Of each of stdout and stderr at
        most ``max_output`` bytes are kept: the first and last halves, with
        ``truncated`` set when the middle was dropped. On ``timeout`` the
        command's whole cgroup is killed and ExecTimeout is raised with the
        partial output in its ``result``. Without a timeout, waits as long as
        it runs, or until the channel breaks. ``pty``: run it on a new
        pseudo-terminal (True: 24x80, or ``(rows, columns)``); its stdout is
        what it wrote to the terminal and stdin is typed in.
        """
        request = exec_request(command, timeout=timeout, env=env, cwd=cwd, max_output=max_output, pty=pty, user=user)
        stdin_bytes = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
        captures = {wire.STDOUT: OutputCapture(max_output), wire.STDERR: OutputCapture(max_output)}

        def on_output(fd: int, data: bytes, skipped: int) -> None:
            captures[fd].add(data, skipped)

        call = self.start_stream(request, on_output, stdin=stdin_bytes)
        reply = call.wait(None if timeout is None else timeout + EXEC_REPLY_GRACE)
        stdout, stderr = captures[wire.STDOUT], captures[wire.STDERR]
        try:
            signal_number = reply.get("signal")
            result = ExecResult(
                command=command if isinstance(command, str) else tuple(command),
                exit_code=_integer(reply["exit_code"]),
                stdout_bytes=stdout.value(),
                stderr_bytes=stderr.value(),
                duration_ms=float(reply["duration_ms"]),
                timed_out=bool(reply.get("timed_out", False)),
                truncated=stdout.truncated or stderr.truncated or bool(reply.get("truncated", False)),
                oom_killed=bool(reply.get("oom_killed", False)),
                signal=None if signal_number is None else _integer(signal_number),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise AgentError(
                f"the guest agent sent a malformed exec reply ({exc!r} in {_shown(reply)}); "
                "the guest image's agent may not match this pytest-forkd: rebuild the image"
            ) from None
        if result.timed_out:
            raise ExecTimeout(
                f"command {result.command_line!r} did not finish within {timeout:g} s; it was killed "
                "with everything it started (the partial output is in .result)",
                result,
            )
        return result

    def start_stream(
        self,
        request: dict[str, Any],
        on_output: Callable[[int, bytes, int], None],
        *,
        stdin: bytes = b"",
        window: int = wire.OUTPUT_WINDOW,
        auto_credit: bool = True,
    ) -> StreamCall:
        """Send a streaming request (``exec_request(...)``) and return its call; see :class:`StreamCall`."""
        call = StreamCall(self, request["op"], on_output, window=window, auto_credit=auto_credit)
        self._start(call, {**request, "window": window}, stdin)
        return call

    def spawn(self, request: dict[str, Any], listener: ProcessListener, *, window: int = PROCESS_WINDOW) -> ProcessCall:
        """Start a process (``spawn_request(...)``) whose output streams to ``listener``; see :class:`ProcessCall`.

        Returns once the request is sent; :meth:`ProcessCall.wait_started`
        gives the pid, or raises why the process could not start.
        """
        call = ProcessCall(self, "spawn", listener, window=window)
        self._start(call, {**request, "window": window})
        return call

    def attach(self, pid: int, listener: ProcessListener, *, window: int = PROCESS_WINDOW) -> ProcessCall:
        """Stream the output of process ``pid`` (spawned earlier, maybe before a snapshot) to ``listener``."""
        call = ProcessCall(self, "attach", listener, window=window)
        self._start(call, {"op": "attach", "pid": pid, "window": window})
        return call

    def process_stdin(self, pid: int, data: bytes, *, close: bool = False) -> None:
        """Write to a spawned process's stdin (waits while it does not read); ``close``: then end its input."""
        request: dict[str, Any] = {"op": "stdin", "pid": pid}
        if close:
            request["close"] = True
        self._small_request("stdin", request, data, None)

    def process_signal(self, pid: int, signal_number: int) -> bool:
        """Send a signal to a spawned process's group; False when it had already ended."""
        fields = self._small_request("signal", {"op": "signal", "pid": pid, "signal": signal_number})
        return bool(fields.get("delivered"))

    def process_resize(self, pid: int, rows: int, columns: int) -> None:
        """Set the window size of a spawned process's terminal."""
        self._small_request("resize", {"op": "resize", "pid": pid, "size": [rows, columns]})

    def processes(self) -> list[dict[str, Any]]:
        """The processes the agent tracks: ``{pid, command, exit_code}`` (exit_code None while running)."""
        fields = self._small_request("processes", {"op": "processes"})
        listed = fields.get("processes")
        if not isinstance(listed, list) or not all(
            isinstance(item, dict) and type(item.get("pid")) is int for item in listed
        ):
            raise AgentError(f"the guest agent sent a malformed process list {_shown(fields)}; rebuild the guest image")
        return listed

    def _small_request(
        self, op: str, request: dict[str, Any], payload: bytes = b"", timeout: float | None = FILE_TIMEOUT
    ) -> dict[str, Any]:
        call = _MessageCall(op, MAX_SMALL_REPLY)
        self._start(call, request, payload)
        return self._wait(call, timeout)

    def start_upload(self, request: dict[str, Any]) -> UploadCall:
        """Send the fields of a request whose payload follows in chunks; see :class:`UploadCall`."""
        call = UploadCall(self, request["op"])
        self._start(call, {**request, "more": True})
        return call

    def cancel(self, request_id: int, *, timeout: float = PING_TIMEOUT + CANCEL_GRACE) -> dict[str, Any]:
        """Stop request ``request_id`` in the guest (see ``cancel`` in wire.py); its ``{found, finished}``."""
        call = _MessageCall("cancel", MAX_SMALL_REPLY)
        self._start(call, {"op": "cancel", "target": request_id})
        return self._wait(call, timeout)

    def read_file(self, path: str, *, timeout: float = FILE_TIMEOUT, max_size: int = DEFAULT_MAX_FILE_SIZE) -> bytes:
        """Return the contents of a guest file; GuestOSError if it cannot be read.

        Files larger than ``max_size`` bytes are refused (AgentError) rather
        than filling the host's memory.
        """

        def too_large(limit: int) -> AgentError:
            return AgentError(f"{path} in the guest is larger than max_size={limit} bytes; pass a larger max_size")

        call = _MessageCall("read_file", max_size, too_large)
        self._start(call, {"op": "read_file", "path": path, "max_size": max_size})
        self._wait(call, timeout)
        return call.payload()

    def write_file(
        self,
        path: str,
        data: bytes | str,
        *,
        mode: int | None = None,
        timeout: float = FILE_TIMEOUT,
        user: str | None = None,
    ) -> None:
        """Replace a guest file atomically; ``mode`` defaults to the old file's, else 0o666 & ~umask.

        ``user`` (``name``, ``uid``, ``name:group``, ``uid:gid``; not root):
        write it in place as that user instead, its permissions checked and a
        new file its own, as ``cat > PATH`` run as the user would; the data
        streams straight into the file, so the guest never holds a second copy.
        """
        request: dict[str, Any] = {"op": "write_file", "path": path}
        if mode is not None:
            request["mode"] = mode
        if user is not None:
            request["user"] = user
        call = _MessageCall("write_file", MAX_SMALL_REPLY)
        self._start(call, request, data.encode() if isinstance(data, str) else data)
        self._wait(call, timeout)

    def new_epoch(self) -> None:
        """Make the next request reset the guest's wall clock and reseed its random pool.

        Call it after the VM behind this channel was restored from a snapshot.
        A new client starts a new epoch by itself.
        """
        with self._lock:
            self._epoch = {"epoch": secrets.token_hex(8), "seed": os.urandom(32).hex()}

    def expect_stale_replies(self) -> None:
        """The VM behind this channel was restored from a snapshot: drop its first stale frames without a warning.

        A snapshot taken while the agent was sending a reply (the last frame
        of a command that just ended, say) holds it, and the restored guest
        sends it before its agent hears from this client: a frame for a
        request of the client that served the snapshot's VM. Until this
        client's first answer arrives, such frames are counted (``stale``)
        and charged to the misbehaviour budget like any unexpected frame,
        but not warned about; after it, an unknown id is a violation again.
        """
        self._stale_expected = True

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

    def _ping_once(self, timeout: float) -> tuple[dict[str, Any], float]:
        """Ping; also return how far the guest's clock lies outside the round trip, in seconds."""
        sent = time.time()
        call = _MessageCall("ping", MAX_SMALL_REPLY)
        self._start(call, {"op": "ping"})
        fields = self._wait(call, timeout)
        received = time.time()
        wall_time = fields.get("wall_time", sent)
        guest_time = float(wall_time) if isinstance(wall_time, (int, float)) else sent
        clock_error = min(0.0, guest_time - sent) + max(0.0, guest_time - received)
        return {name: value for name, value in fields.items() if name not in ("id", "more")}, clock_error

    def _start(self, call: _Call, request: dict[str, Any], payload: bytes = b"") -> None:
        """Register ``call`` under a fresh id and send its request."""
        with self._lock:
            if self._closed_reason is not None:
                raise self._closed_error(self._closed_reason)
            call.request_id = self._next_id
            self._next_id += 1
            self._pending[call.request_id] = call
            # Every request carries the epoch: the agent acts on the first one it sees.
            fields = {"id": call.request_id, **request, **self._epoch, "client": self._token, "time": time.time()}
        try:
            self._send_message(fields, payload)
        except BaseException:
            self._forget(call)
            raise

    def _wait(self, call: _Call, wait: float | None) -> dict[str, Any]:
        """Wait at most ``wait`` seconds (None: until the channel breaks) for the reply of ``call``."""
        try:
            if not call.done.wait(wait):
                raise AgentTimeout(
                    f"the guest agent did not answer {call.op!r} within {wait:g} s; "
                    "the guest may be hung or overloaded (see its console log)"
                )
        finally:
            self._forget(call)
        if call.failure is not None:
            raise call.failure
        if call.error is not None:
            raise guest_error(call.op, call.error)
        if not call.complete or call.fields is None:
            raise self._closed_error(self._closed_reason or "the guest agent channel was closed")
        return call.fields

    def _forget(self, call: _Call, *, expected: bool = True) -> None:
        """Stop waiting for ``call``; ``expected``: the rest of its reply is noise, no offence."""
        with self._lock:
            if self._pending.pop(call.request_id, None) is not None and expected:
                self._recent.append(call.request_id)

    def _send_message(self, fields: dict[str, Any], payload: bytes) -> None:
        for frame_fields, chunk in wire.message_frames(fields, payload):
            self._send_frame(frame_fields, chunk)

    def _send_credit(self, request_id: int, nbytes: int) -> None:
        """Return output credit (reader thread); a failure closes the channel, which the call then sees."""
        with contextlib.suppress(VMError):
            self._send_frame({"id": 0, "op": "credit", "ref": request_id, "bytes": nbytes}, b"")

    def _send_frame(self, fields: dict[str, Any], chunk: bytes | memoryview) -> None:
        header = wire.encode_header(fields, len(chunk))
        with self._write_lock:
            if self._closed_reason is not None:
                raise self._closed_error(self._closed_reason)
            try:
                if chunk:  # one call, and no empty send after a complete frame to a peer that already left
                    sent = self._sock.sendmsg([header, chunk])
                    # A stream socket may take part of it: send the rest.
                    if sent < len(header):
                        self._sock.sendall(header[sent:])
                        sent = len(header)
                    if sent - len(header) < len(chunk):
                        self._sock.sendall(memoryview(chunk)[sent - len(header) :])
                else:
                    self._sock.sendall(header)
            except TimeoutError:
                # Part of a frame may be sent: the stream cannot be trusted any more.
                reason = f"the guest agent accepted no data for {SEND_STALL_TIMEOUT:g} s"
                self._fail(reason)
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)
                raise AgentTimeout(f"{reason}; the guest is hung (see its console log)") from None
            except OSError as exc:
                self._fail(f"cannot send to the guest agent: {exc}")
                raise self._closed_error(self._closed_reason) from None

    # -- replies (reader thread) ---------------------------------------------------

    def _recv(self, size: int) -> bytes:
        while True:
            try:
                return self._sock.recv(size)
            except TimeoutError:
                continue  # the timeout exists for sends; reads wait for the agent

    def _read_replies(self) -> None:
        """The reader thread: whatever happens here, waiting calls are woken with the reason."""
        try:
            while True:
                try:
                    frame = self._frames.read_frame()
                except wire.MalformedFrame as exc:
                    self._offence(exc.kind, str(exc))
                    continue
                if frame is None:
                    self._fail("the guest agent closed its channel: the VM stopped or its agent died")
                    return
                self._deliver(frame)
        except OSError as exc:
            self._fail(f"the guest agent channel failed: {exc}")
        except BaseException as exc:  # a bug or exhaustion here must not leave calls waiting forever
            self._fail(f"the reader of guest agent replies stopped: {exc!r}", GuestProtocolError)
            if not isinstance(exc, Exception):
                raise

    def _deliver(self, frame: wire.Frame) -> None:
        request_id = frame.fields["id"]
        with self._lock:
            call = self._pending.get(request_id)
            recent = request_id in self._recent
        if call is None or call.done.is_set():
            if call is None and not recent:
                if self._stale_expected:  # a reply the snapshot froze in flight (see expect_stale_replies)
                    self._offence("stale", f"a frame for request {request_id} of the snapshot's client", warn=False)
                else:
                    self._offence("unknown_id", f"a reply frame for request {request_id}, which nobody waits for")
            return
        self._stale_expected = False  # the agent answers this client now: it has dropped the old one's streams
        if "error" in frame.fields:
            call.error = frame.fields["error"]
            call.done.set()
            return
        try:
            call.feed(frame)
        except _Violation as exc:
            # A violator's further frames for this call count as offences too.
            self._forget(call, expected=not exc.counts)
            if exc.counts:
                call.fail(GuestProtocolError(f"the guest agent broke the protocol: {exc}"))
                self._offence("oversized" if "grew past" in str(exc) else "bad_reply", str(exc))
        except Exception as exc:  # a consumer's callback failed: that call fails, the channel goes on
            call.fail(exc)
            self._forget(call)

    def _offence(self, kind: str, description: str, *, warn: bool = True) -> None:
        """Count one protocol violation; cut the guest off when it exhausts the budget."""
        self.protocol_errors[kind] += 1
        count = self.protocol_errors[kind]
        if warn and count <= _WARNINGS_PER_KIND:
            logger.warning("guest agent channel: %s", description)
        else:
            logger.debug("guest agent channel: %s", description)
        if self._budget.spend():
            return
        summary = ", ".join(f"{number} {name}" for name, number in sorted(self.protocol_errors.items()))
        self._fail(
            f"the guest kept breaking the agent protocol ({summary}; last: {description}) and was cut off; "
            "its agent was replaced or damaged by what ran in it: start a fresh VM",
            GuestProtocolError,
        )
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def _fail(self, reason: str, error: type[VMError] = ChannelClosed) -> None:
        """Mark the channel unusable and wake every waiting call; the first reason sticks."""
        with self._lock:
            if self._closed_reason is None:
                self._closed_reason = reason
                self._closed_error = error
            waiting = list(self._pending.values())
        for call in waiting:
            call.done.set()


def _integer(value: object) -> int:
    if type(value) is not int:
        raise TypeError(f"expected an integer, got {value!r}")
    return value
