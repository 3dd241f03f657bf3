"""Requests in flight on an agent channel: how each kind of reply is assembled, and how a call ends.

A call is registered under its request id by the channel
(:class:`~pytest_forkd.guest.client.AgentClient`), whose reader thread feeds it
every frame of its reply. Each kind keeps the guest within bounds of its own:
a whole message within a size limit (:class:`_MessageCall`), command output
within the credit the consumer returns (:class:`StreamCall`), a spawned
process's streams within a window per stream (:class:`ProcessCall`). A frame
that breaks the protocol raises :class:`_Violation`, which the channel counts
against the guest. The errors a call ends with live here too: the channel
closed, the agent too slow, or the agent's own error reply
(:func:`guest_error`).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any, Protocol

from ..errors import AgentError, CommandNotFound, NoSuchProcess, ProcessError, VMError
from . import wire

# The largest reply of the operations that answer with fields only (ping, write_file, stdin...).
MAX_SMALL_REPLY = 64 << 10


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


class Channel(Protocol):
    """What a call needs of the channel it runs on (:class:`~pytest_forkd.guest.client.AgentClient`)."""

    def _wait(self, call: _Call, wait: float | None) -> dict[str, Any]: ...

    def _forget(self, call: _Call, *, expected: bool = True) -> None: ...

    def _send_frame(self, fields: dict[str, Any], chunk: bytes | memoryview) -> None: ...

    def _send_credit(self, request_id: int, nbytes: int) -> None: ...


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
        client: Channel,
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
    ends, and a final frame once all output was delivered, which also says
    the exit (the frames before it that would say the same in one write are
    left out). The call stays
    registered for as long as the process runs; the listener's ``on_end``
    runs once however it ends (final frame, error reply, channel closed).
    """

    def __init__(self, client: Channel, op: str, listener: ProcessListener, *, window: int) -> None:
        super().__init__(op)
        self._client = client
        self._listener = listener
        self.window = window
        self.pid: int | None = None
        self.started = threading.Event()
        self._outstanding = {wire.STDOUT: 0, wire.STDERR: 0}
        self._uncredited = {wire.STDOUT: 0, wire.STDERR: 0}
        self._credit_lock = threading.Lock()
        self._exit_told = False
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
            # The final frame also says that the process exited: alone when nothing came between
            # (the agent then leaves out the exit and end-of-stream frames).
            if not self._exit_told and fields.get("exited") is True and type(fields.get("exit_code")) is int:
                self._exit_told = True
                self._listener.on_exit(fields["exit_code"])
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
            self._exit_told = True
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

    def __init__(self, client: Channel, op: str) -> None:
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


def _shown(fields: object) -> str:
    """A guest-provided value, shortened for a message."""
    text = repr(fields)
    return text if len(text) <= 200 else text[:200] + "..."


def guest_error(operation: str, error: object) -> AgentError:
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
