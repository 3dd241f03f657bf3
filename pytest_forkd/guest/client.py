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
from typing import Any, Protocol

from pytest_forkd.guest.exec_result import ExecResult

from ..errors import (
    AgentError,
    CommandNotFound,
    ExecTimeout,
    GuestProtocolError,
    InvalidArgument,
    NoSuchProcess,
    ProcessError,
    VMError,
)
from . import wire
from .capture import OutputCapture

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
#: Bytes of each output stream (stdout, stderr) an exec keeps by default.
DEFAULT_MAX_OUTPUT = wire.DEFAULT_MAX_OUTPUT
#: The largest file read_file accepts by default.
DEFAULT_MAX_FILE_SIZE = 64 << 20
# The largest reply of the other operations (ping, write_file): fields only.
MAX_SMALL_REPLY = 64 << 10
# Misbehaviour budget: a guest may commit this many protocol violations in a
# burst, and this many more per second, before it is cut off. A guest that
# answers properly commits none; a restored one a few (stale replies).
PROTOCOL_ERROR_BURST = 100
PROTOCOL_ERROR_RATE = 5.0
# Ids of calls that ended recently: the rest of their replies is expected noise.
RECENT_IDS = 256
# Warnings logged per kind of violation before the rest only go to debug.
_WARNINGS_PER_KIND = 5


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


class _Call:
    """One request in flight; the reader thread feeds it the frames of its reply."""

    def __init__(self, op: str) -> None:
        self.op = op
        self.request_id = 0
        self.done = threading.Event()
        self.fields: dict[str, Any] | None = None
        self.complete = False
        self.error: dict[str, Any] | None = None
        self.failure: BaseException | None = None

    def feed(self, frame: wire.Frame) -> None:
        """Take one frame of the reply; raise _Violation when the guest broke the protocol."""
        raise NotImplementedError

    def fail(self, failure: BaseException) -> None:
        self.failure = failure
        self.done.set()


class _Violation(Exception):
    """A reply frame broke the protocol; ``quiet``: the rest of this reply is no further offence."""

    def __init__(self, message: str, *, counts: bool = True) -> None:
        super().__init__(message)
        self.counts = counts


class _MessageCall(_Call):
    """A reply assembled whole (ping, read_file...), refused once it grows past ``limit`` bytes."""

    def __init__(self, op: str, limit: int, too_large: Callable[[int], BaseException] | None = None) -> None:
        super().__init__(op)
        self._limit = limit
        self._too_large = too_large
        self._payload = bytearray()

    def feed(self, frame: wire.Frame) -> None:
        if self.fields is None:
            self.fields = frame.fields
        if frame.payload:
            if len(self._payload) + len(frame.payload) > self._limit:
                if self._too_large is not None:
                    self.fail(self._too_large(self._limit))
                    raise _Violation("", counts=False)
                raise _Violation(f"its reply to {self.op!r} grew past {self._limit} bytes")
            self._payload += frame.payload
        if frame.fields.get("more") is not True:
            self.complete = True
            self.done.set()

    def payload(self) -> bytes:
        return bytes(self._payload)


class StreamCall(_Call):
    """A request whose reply streams output frames before its final frame (exec).

    ``on_output(fd, data, skipped)`` runs in the reader thread for each chunk
    (``fd`` 1 stdout, 2 stderr); it must be quick and must not block. With
    ``auto_credit`` the chunk is credited back as soon as ``on_output``
    returns; otherwise the consumer calls :meth:`credit` when it has taken
    the data, and the guest stops sending (and the command stops running
    once its pipe is full) ``window`` bytes ahead of it.
    """

    def __init__(
        self,
        client: AgentClient,
        op: str,
        on_output: Callable[[int, bytes, int], None],
        *,
        window: int = wire.OUTPUT_WINDOW,
        auto_credit: bool = True,
    ) -> None:
        super().__init__(op)
        self._client = client
        self._on_output = on_output
        self.window = window
        self._auto_credit = auto_credit
        self._uncredited = 0
        self._credit_lock = threading.Lock()

    def feed(self, frame: wire.Frame) -> None:
        fields = frame.fields
        if fields.get("more") is not True:
            self.fields = fields
            self.complete = True
            self.done.set()
            return
        fd = fields.get("fd")
        skipped = fields.get("skipped", 0)
        if fd not in (wire.STDOUT, wire.STDERR) or type(skipped) is not int or skipped < 0:
            raise _Violation(f"an output frame of {self.op!r} has a bad 'fd' or 'skipped': {_shown(fields)}")
        self._on_output(fd, frame.payload, skipped)
        if self._auto_credit:
            self.credit(len(frame.payload))

    def credit(self, nbytes: int) -> None:
        """Tell the guest that ``nbytes`` more of the output were consumed (sent in batches)."""
        with self._credit_lock:
            self._uncredited += nbytes
            if self._uncredited < max(self.window // 4, 1) or self.done.is_set():
                return
            nbytes, self._uncredited = self._uncredited, 0
        self._client._send_credit(self.request_id, nbytes)

    def wait(self, timeout: float | None) -> dict[str, Any]:
        """The final reply fields; raises like any call (timeout, channel closed, guest error)."""
        return self._client._wait(self, timeout)


#: Bytes of each output stream of a spawned process the agent may send ahead of the host's reading.
PROCESS_WINDOW = 256 << 10


class ProcessListener(Protocol):
    """What a :class:`ProcessCall` tells about its process; called in the reader thread, must not block."""

    def on_output(self, fd: int, data: bytes, skipped: int) -> None: ...

    def on_eof(self, fd: int) -> None: ...

    def on_exit(self, exit_code: int) -> None: ...

    def on_end(self, call: ProcessCall) -> None: ...


class _NotifyingEvent(threading.Event):
    """An Event that runs a callback once when first set (the call ended, whichever way)."""

    def __init__(self, on_set: Callable[[], None]) -> None:
        super().__init__()
        self._on_set = on_set
        self._notified = False
        self._notify_lock = threading.Lock()

    def set(self) -> None:
        super().set()
        with self._notify_lock:
            if self._notified:
                return
            self._notified = True
        self._on_set()


class ProcessCall(_Call):
    """The stream of a spawned process (``spawn`` or ``attach``): its pid, output, exit and end.

    Frames: ``{"pid"}`` first, then output ``{"fd", "skipped"?}`` within
    per-stream credit (``window`` bytes each; the consumer returns it with
    :meth:`credit` as it takes the data, so a stream nobody reads stops
    here and the guest keeps, bounded, what follows), ``{"fd", "eof"}`` when a
    stream ends, ``{"exited", "exit_code", "signal"}`` as soon as the process
    ends, and a final frame once all output was delivered. The call stays
    registered for as long as the process runs; the listener's ``on_end``
    runs once however it ends (final frame, error reply, channel closed).
    """

    def __init__(self, client: AgentClient, op: str, listener: ProcessListener, *, window: int) -> None:
        super().__init__(op)
        self._client = client
        self._listener = listener
        self.window = window
        self.pid: int | None = None
        self.started = threading.Event()
        self._outstanding = {wire.STDOUT: 0, wire.STDERR: 0}
        self._uncredited = {wire.STDOUT: 0, wire.STDERR: 0}
        self._credit_lock = threading.Lock()
        self.done = _NotifyingEvent(self._ended)

    def _ended(self) -> None:
        self.started.set()
        self._client._forget(self)
        self._listener.on_end(self)

    def feed(self, frame: wire.Frame) -> None:
        fields = frame.fields
        if fields.get("more") is not True:
            self.fields = fields
            self.complete = True
            self.done.set()
            return
        if "pid" in fields:
            if type(fields["pid"]) is not int:
                raise _Violation(f"the start frame of {self.op!r} has a bad pid: {_shown(fields)}")
            self.pid = fields["pid"]
            self.started.set()
            return
        if fields.get("exited") is True:
            if type(fields.get("exit_code")) is not int:
                raise _Violation(f"the exit frame of {self.op!r} has a bad exit code: {_shown(fields)}")
            self._listener.on_exit(fields["exit_code"])
            return
        fd = fields.get("fd")
        skipped = fields.get("skipped", 0)
        if fd not in (wire.STDOUT, wire.STDERR) or type(skipped) is not int or skipped < 0:
            raise _Violation(f"an output frame of {self.op!r} has a bad 'fd' or 'skipped': {_shown(fields)}")
        if fields.get("eof") is True:
            self._listener.on_eof(fd)
            return
        with self._credit_lock:
            self._outstanding[fd] += len(frame.payload)
            over = self._outstanding[fd] > self.window
        if over:
            raise _Violation(f"it sent more output of {self.op!r} than the {self.window} bytes it was allowed")
        self._listener.on_output(fd, frame.payload, skipped)

    def credit(self, fd: int, nbytes: int) -> None:
        """The consumer took ``nbytes`` of stream ``fd``: let the guest send more (in batches)."""
        with self._credit_lock:
            self._outstanding[fd] -= nbytes
            self._uncredited[fd] += nbytes
            if self._uncredited[fd] < max(self.window // 4, 1) or self.done.is_set():
                return
            nbytes, self._uncredited[fd] = self._uncredited[fd], 0
        with contextlib.suppress(VMError):  # a closed channel ends the call, which the consumer sees
            self._client._send_frame({"id": 0, "op": "credit", "ref": self.request_id, "bytes": nbytes, "fd": fd}, b"")

    def wait_started(self, timeout: float | None) -> int:
        """The process's pid once the agent started it (or found it); raises the agent's error otherwise."""
        if not self.started.wait(timeout):
            raise AgentTimeout(
                f"the guest agent did not answer {self.op!r} within {timeout:g} s; the guest may be hung or "
                "overloaded (see its console log)"
            )
        if self.pid is not None:
            return self.pid
        self._client._wait(self, 0)  # raises the reason it ended
        raise AgentError(f"the guest agent ended {self.op!r} without naming the process; rebuild the guest image")

    def early_end(self) -> BaseException | None:
        """Why the call ended early, as an exception to raise (None: it ended normally or has not ended)."""
        if not self.done.is_set() or self.complete:
            return None
        try:
            self._client._wait(self, 0)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            return exc
        return None


class UploadCall(_MessageCall):
    """A request whose payload the host streams in chunks it produces as it goes (copy_in).

    :meth:`send` each chunk, then :meth:`finish` to end the payload and wait
    for the reply. Nothing is buffered: a guest that reads slowly slows
    ``send`` down (the channel's own backpressure).
    """

    def __init__(self, client: AgentClient, op: str) -> None:
        super().__init__(op, MAX_SMALL_REPLY)
        self._client = client

    def send(self, chunk: bytes) -> None:
        """Send the next chunk of the payload (at most ``wire.MAX_PAYLOAD_SIZE`` bytes)."""
        if chunk:
            self._client._send_frame({"id": self.request_id, "more": True}, chunk)

    def finish(self, timeout: float | None) -> dict[str, Any]:
        """End the payload and return the reply fields; raises like any call."""
        self._client._send_frame({"id": self.request_id, "more": False}, b"")
        return self._client._wait(self, timeout)


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
        self, path: str, data: bytes | str, *, mode: int | None = None, timeout: float = FILE_TIMEOUT
    ) -> None:
        """Replace a guest file atomically; ``mode`` defaults to the old file's, else 0o666 & ~umask."""
        request: dict[str, Any] = {"op": "write_file", "path": path}
        if mode is not None:
            request["mode"] = mode
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
            raise _guest_error(call.op, call.error)
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
                self._offence("unknown_id", f"a reply frame for request {request_id}, which nobody waits for")
            return
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

    def _offence(self, kind: str, description: str) -> None:
        """Count one protocol violation; cut the guest off when it exhausts the budget."""
        self.protocol_errors[kind] += 1
        count = self.protocol_errors[kind]
        if count <= _WARNINGS_PER_KIND:
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


def exec_request(
    command: str | Sequence[str],
    *,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    max_output: int | None = DEFAULT_MAX_OUTPUT,
    pty: bool | tuple[int, int] = False,
    user: str | None = None,
) -> dict[str, Any]:
    """The fields of an exec request, checked; ``max_output`` None: the guest sends all output.

    ``user``: who runs it (``name``, ``uid``, ``name:group``, ``uid:gid``); None: the image's user.
    """
    request: dict[str, Any] = {"op": "exec", **_command_fields(command)}
    if pty:
        request["pty"] = terminal_size(pty)
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
        request["timeout"] = float(timeout)
    if env is not None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise TypeError("env must map str to str")
        request["env"] = dict(env)
    if cwd is not None:
        request["cwd"] = cwd
    if user is not None:
        request["user"] = user
    if max_output is not None:
        if isinstance(max_output, bool) or not isinstance(max_output, int) or max_output < 0:
            raise InvalidArgument(
                f"max_output must be a number of bytes >= 0, got {max_output!r}; pass e.g. 4 << 20 (4 MiB)"
            )
        request["max_output"] = max_output
    return request


def spawn_request(
    command: str | Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    max_output: int = DEFAULT_MAX_OUTPUT,
    pty: bool | tuple[int, int] = False,
    user: str | None = None,
) -> dict[str, Any]:
    """The fields of a spawn request, checked: an exec request without timeout, whose process outlives it."""
    request = exec_request(command, env=env, cwd=cwd, max_output=max_output, pty=pty, user=user)
    request["op"] = "spawn"
    return request


def terminal_size(pty: bool | tuple[int, int] | Sequence[int]) -> bool | list[int]:
    """The ``pty`` field: True (the guest's default 24x80) or ``[rows, columns]``."""
    if pty is True:
        return True
    if (
        isinstance(pty, (tuple, list))
        and len(pty) == 2
        and all(type(number) is int and 0 < number < 65536 for number in pty)
    ):
        return [pty[0], pty[1]]
    raise InvalidArgument(f"pty must be True, False or (rows, columns) between 1 and 65535, got {pty!r}")


def _integer(value: object) -> int:
    if type(value) is not int:
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def _shown(fields: object) -> str:
    """A guest-provided value, shortened for a message."""
    text = repr(fields)
    return text if len(text) <= 200 else text[:200] + "..."


def _command_fields(command: str | Sequence[str]) -> dict[str, Any]:
    if isinstance(command, str):
        return {"shell": command}
    argv = list(command)
    if not argv or not all(isinstance(arg, str) for arg in argv):
        raise TypeError(f"command must be a shell string or a non-empty sequence of str, got {command!r}")
    return {"argv": argv}


def _guest_error(operation: str, error: object) -> AgentError:
    if not isinstance(error, dict):
        return AgentError(f"the guest agent failed {operation!r} with an unreadable error: {error!r}")
    message = f"{operation} in the guest failed: {str(error.get('message', error))[:2000]}"
    error_class = _PROCESS_ERRORS.get(str(error.get("type")))
    if error_class is not None:
        return error_class(message)
    errno = error.get("errno")
    if isinstance(errno, int):
        return GuestOSError(message, errno, os.strerror(errno), error.get("path"))
    return AgentError(message)


_PROCESS_ERRORS: dict[str, type[AgentError]] = {
    "CommandNotFound": CommandNotFound,
    "NoSuchProcess": NoSuchProcess,
    "Detached": ProcessError,
    "StdinClosed": ProcessError,
    "BrokenPipe": ProcessError,
    "NoTerminal": ProcessError,
}
