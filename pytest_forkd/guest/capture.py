"""Bounded capture of one output stream of a guest command: head and tail kept, middle dropped.

The host keeps at most ``limit`` bytes of a stream, whatever the guest
sends: the first half of the limit as it arrives and the last half in a ring.
The agent applies the same rule before sending (see ``exec`` in
:mod:`pytest_forkd.guest.wire`), but the host never relies on it: a guest
whose agent was replaced can send anything.
"""

from __future__ import annotations

from collections import deque


class OutputCapture:
    """The head and tail of a byte stream, at most ``limit`` bytes in all."""

    __slots__ = ("_head", "_head_limit", "_tail", "_tail_limit", "_tail_size", "dropped", "received")

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"an output limit is a number of bytes >= 0, got {limit}")
        self._tail_limit = limit // 2
        self._head_limit = limit - self._tail_limit
        self._head = bytearray()
        self._tail: deque[bytes] = deque()
        self._tail_size = 0
        self.dropped = 0
        """Bytes dropped from the middle, here or (as the guest reported) before sending."""
        self.received = 0
        """Bytes that arrived from the guest."""

    @property
    def truncated(self) -> bool:
        return self.dropped > 0

    def add(self, data: bytes, skipped: int = 0) -> None:
        """Take the next ``data``; ``skipped``: the guest says it dropped that many bytes before it."""
        self.received += len(data)
        if skipped > 0:
            self.dropped += skipped
        room = self._head_limit - len(self._head)
        if room > 0 and not self._tail_size and not skipped:
            self._head += data[:room]
            data = data[room:]
        if data:
            self._add_tail(data)

    def _add_tail(self, data: bytes) -> None:
        if len(data) >= self._tail_limit:
            # One chunk covers the whole tail: everything kept before falls out.
            self.dropped += self._tail_size + len(data) - self._tail_limit
            self._tail.clear()
            self._tail_size = self._tail_limit
            if self._tail_limit:
                self._tail.append(bytes(data[len(data) - self._tail_limit :]))
            return
        self._tail.append(bytes(data))
        self._tail_size += len(data)
        while self._tail_size > self._tail_limit:
            first = self._tail[0]
            excess = self._tail_size - self._tail_limit
            if len(first) <= excess:
                self._tail.popleft()
                cut = len(first)
            else:
                self._tail[0] = first[excess:]
                cut = excess
            self._tail_size -= cut
            self.dropped += cut

    def value(self) -> bytes:
        """What was kept: the head, then the tail."""
        return bytes(self._head) + b"".join(self._tail)
