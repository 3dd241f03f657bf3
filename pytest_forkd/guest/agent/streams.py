"""Output to the host within a credit window, and the bounded buffers that hold it until then."""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import select
import threading
import time

from .common import AGENT_TAIL_LIMIT, CREDIT_STALL_TIMEOUT, RequestError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .. import wire
else:
    try:
        from .. import wire
    except ImportError:  # in the guest: a top-level package beside wire.py
        import wire

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any


class _StreamStopper:
    """Stands in for a command in a cancellable request that streams an archive: a cancel stalls the stream."""

    def __init__(self, stream: _OutputStream) -> None:
        self._stream = stream

    def kill(self) -> None:
        self._stream.stalled = True
        self._stream.add_credit(0)  # wakes a wait for credit


def _send_within_credit(stream: _OutputStream, chunk: bytes) -> None:
    view = memoryview(chunk)
    while view:
        if not stream.wait_for_room():
            raise RequestError(
                "Cancelled",
                f"the host stopped taking the archive (cancelled, or no credit for {CREDIT_STALL_TIMEOUT:g} s)",
            )
        piece = view[: min(stream.room, wire.OUTPUT_CHUNK_SIZE)]
        stream.send(wire.STDOUT, piece)
        view = view[len(piece) :]


class _OutputStream:
    """Sends one request's output to the host within a credit window.

    The agent may have at most ``window`` bytes sent and not yet credited by
    the host (``credit`` requests, handled by the reader thread). A thread
    that waits for credit polls :attr:`wake_fd`, which becomes readable when
    credit arrives. If the host gives none for ``CREDIT_STALL_TIMEOUT``
    seconds, the stream is *stalled*: the rest of the output is discarded
    (and counted), so a host that went away never pins the command.
    """

    def __init__(
        self, send_frame: Callable[[dict[str, Any], bytes | memoryview], None], request_id: int, window: int
    ) -> None:
        self._send_frame = send_frame
        self.request_id = request_id
        self._lock = threading.Lock()
        self._room = window
        self.stalled = False
        self.wake_fd, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    @property
    def room(self) -> int:
        return 0 if self.stalled else self._room

    def add_credit(self, nbytes: int) -> None:
        """The host consumed ``nbytes`` of this stream (reader thread)."""
        with self._lock:
            self._room += nbytes
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_write, b"c")

    def clear_wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.read(self.wake_fd, 4096)

    def send(self, fd_number: int, data: bytes | memoryview, **extra: Any) -> None:
        """Send one output chunk (at most the room there is, unless the caller bypasses credit)."""
        with self._lock:
            self._room -= len(data)
        self._send_frame({"id": self.request_id, "more": True, "fd": fd_number, **extra}, data)

    def wait_for_room(self, deadline: float | None = None) -> bool:
        """Block until there is credit; False (and the stream stalls) after CREDIT_STALL_TIMEOUT."""
        stall_at = time.monotonic() + CREDIT_STALL_TIMEOUT
        while self.room <= 0 and not self.stalled:
            limit = stall_at if deadline is None else min(stall_at, deadline)
            left = limit - time.monotonic()
            if left <= 0:
                if limit == stall_at:
                    self.stalled = True
                return False
            select.select([self.wake_fd], [], [], left)
            self.clear_wake()
        return not self.stalled

    def close(self) -> None:
        os.close(self.wake_fd)
        os.close(self._wake_write)


class _StreamCapture:
    """What happens to one output stream of an exec: head sent at once, tail in a ring, middle dropped.

    ``max_output`` None: everything is sent. Otherwise the first half of it is
    sent as it comes and the last half kept in a ring that is sent at the
    end; what falls out of the ring is counted in ``skipped``. A ring larger
    than ``AGENT_TAIL_LIMIT`` would cost the guest too much memory: then
    everything past the head is sent and the host keeps the tail itself.
    """

    __slots__ = ("discarding", "fd_number", "head_left", "ring", "skipped", "tail_limit", "total")

    def __init__(self, fd_number: int, max_output: int | None) -> None:
        self.fd_number = fd_number
        self.total = 0
        self.skipped = 0
        self.discarding = False
        if max_output is None:
            self.head_left = self.tail_limit = None
            self.ring = None
        else:
            self.tail_limit = max_output // 2
            self.head_left = max_output - self.tail_limit
            self.ring = _TailRing(self.tail_limit) if self.tail_limit <= AGENT_TAIL_LIMIT else None

    def needs_credit(self) -> bool:
        """Whether the next bytes read will be sent (else they go to the ring or are dropped)."""
        if self.discarding:
            return False
        return self.head_left is None or self.head_left > 0 or self.ring is None

    def take(self, data: bytes) -> bytes:
        """Account for ``data`` read from the pipe; return the part to send now."""
        self.total += len(data)
        if self.discarding:
            self.skipped += len(data)
            return b""
        if self.head_left is None:
            return data
        send = data[: self.head_left]
        self.head_left -= len(send)
        rest = data[len(send) :]
        if not rest:
            return send
        if self.ring is None:
            return send + rest
        self.skipped += self.ring.add(rest)
        return send


class _TailRing:
    """The last ``limit`` bytes of a stream, as a queue of chunks (no large copies per chunk)."""

    __slots__ = ("chunks", "limit", "size")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.chunks: collections.deque[bytes] = collections.deque()
        self.size = 0

    def add(self, data: bytes) -> int:
        """Append ``data``; return how many of the oldest bytes fell out."""
        self.chunks.append(data)
        self.size += len(data)
        dropped = 0
        while self.size > self.limit:
            first = self.chunks[0]
            excess = self.size - self.limit
            if len(first) <= excess:
                self.chunks.popleft()
                cut = len(first)
            else:
                self.chunks[0] = first[excess:]
                cut = excess
            self.size -= cut
            dropped += cut
        return dropped

    def contents(self) -> bytes:
        return b"".join(self.chunks)


class _LiveBuffer:
    """Output of a spawned process that no host took yet: at most ``limit`` bytes, head and tail.

    The first half of the limit keeps the oldest unread bytes, a ring the
    newest; what falls out of the ring between them is dropped and counted
    (``dropped``), and reported with the first bytes read after the gap.
    """

    __slots__ = ("dropped", "gap", "head", "head_limit", "head_size", "tail", "total")

    def __init__(self, limit: int) -> None:
        self.head_limit = limit - limit // 2
        self.head: collections.deque[bytes] = collections.deque()
        self.head_size = 0
        self.tail = _TailRing(limit // 2)
        self.gap = 0
        self.dropped = 0
        self.total = 0

    @property
    def size(self) -> int:
        return self.head_size + self.tail.size

    def add(self, data: bytes) -> None:
        self.total += len(data)
        if not self.tail.size and not self.gap:
            room = self.head_limit - self.head_size
            if room > 0:
                part = data[:room]
                self.head.append(part)
                self.head_size += len(part)
                data = data[room:]
        if data:
            dropped = self.tail.add(data)
            self.gap += dropped
            self.dropped += dropped

    def take(self, limit: int) -> tuple[bytes, int]:
        """Up to ``limit`` of the oldest bytes kept, and how many were dropped just before them."""
        if self.head_size:
            return _pop_front(self.head, limit, self), 0
        skipped, self.gap = self.gap, 0
        chunk = _pop_front(self.tail.chunks, limit, None)
        self.tail.size -= len(chunk)
        return chunk, skipped


def _pop_front(chunks: collections.deque[bytes], limit: int, head_of: _LiveBuffer | None) -> bytes:
    parts = []
    got = 0
    while chunks and got < limit:
        first = chunks[0]
        if len(first) <= limit - got:
            chunks.popleft()
            parts.append(first)
            got += len(first)
        else:
            parts.append(first[: limit - got])
            chunks[0] = first[limit - got :]
            got = limit
    if head_of is not None:
        head_of.head_size -= got
    return b"".join(parts)


def _read_or_eio(fd: int, size: int) -> bytes | None:
    """Read from a pipe or terminal: b"" at its end (EIO: a terminal nobody holds), None if nothing is there."""
    try:
        return os.read(fd, size)
    except BlockingIOError:
        return None
    except OSError as exc:
        if exc.errno == errno.EIO:
            return b""
        raise
