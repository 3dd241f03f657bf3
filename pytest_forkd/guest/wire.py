"""The framing of the byte stream between the host and the guest agent.

This module runs on both sides: on the host inside pytest-forkd and in the
guest next to the agent (as ``/opt/forkd/wire.py``), where only the Python
standard library exists. It must stay stdlib-only and cheap to import.

Frames
------
The channel is a plain byte stream (a virtio-serial port in the guest, a Unix
socket on the host). It carries *frames*::

    header   12 bytes   struct ">4sII": MAGIC, json_length, payload_length
    json     json_length bytes, a UTF-8 JSON object with an integer "id"
    payload  payload_length bytes, raw binary (file contents, command output)

Binary data travels in the payload, so it is neither escaped nor base64
inflated. A JSON part may be at most ``MAX_JSON_SIZE`` bytes and a payload at
most ``MAX_PAYLOAD_SIZE``; anything else is not a frame.

The magic makes the stream self-synchronising: a reader that meets bytes that
are not a frame header (the tail of a frame that a snapshot cut in half, line
noise after a reconnect) skips forward to the next ``MAGIC`` and reports the
skipped bytes as a :class:`MalformedFrame`; a frame whose JSON is unreadable is
consumed and reported the same way. Either way the reader stays usable.

Messages
--------
A *message* (a request or a reply) is one frame, or several frames with the
same ``id`` when its payload is larger than ``CHUNK_SIZE``: the first frame
carries the message's fields and the first chunk of the payload; while a frame
says ``"more": true``, continuation frames ``{"id": ID, "more": BOOL}`` follow
with the next chunks. Frames of different messages may interleave, so a large
file transfer never blocks a ping. Neither side needs a whole 100 MB file in
one frame, and the agent writes uploads to disk chunk by chunk.

Requests carry ``"op"``; a continuation frame never does, which is how the
agent tells the two apart. A reply frame, first or continuation, may carry
``"error"``: it ends the reply, and the payload received so far is void.

Every request carries a fresh integer ``id`` and every reply frame echoes it.
The host ignores frames whose id it is not waiting for: a snapshot taken while
a reply was in flight makes every VM restored from it emit that stale reply.

Requests (fields besides ``id``; ``payload`` is the message payload)
--------------------------------------------------------------------
Any request may carry ``epoch`` (opaque string), ``time`` (host wall clock,
seconds since the Unix epoch) and ``seed`` (hex string). When ``epoch``
differs from the last one the agent saw, it first sets the guest wall clock to
``time`` and mixes ``seed`` into the kernel's random pool, then handles the
request: that is how a VM restored from a snapshot gets the right time and
fresh randomness on its first request.

``ping``
    reply ``{pid, monotonic, wall_time, protocol}``; the readiness probe.
``exec``
    ``argv`` (list of str) or ``shell`` (str, run by ``/bin/sh -c``), optional
    ``env`` (dict merged over the agent's environment), ``cwd``, ``timeout``
    (seconds or null); payload = stdin. Reply ``{exit_code, stdout_len,
    duration_ms, timed_out}``; payload = stdout followed by stderr.
    ``exit_code`` is negative for a signal (like :mod:`subprocess`), 127 when
    the program does not exist and 126 when it cannot be executed.
``read_file``
    ``path``. Reply payload = the file's contents.
``write_file``
    ``path``, optional ``mode`` (int); payload = the new contents, written to
    a temporary file in the same directory and renamed over ``path`` at the
    end. Reply ``{size}``.

Errors
------
A failed request gets a reply with ``"error": {"type", "message", "errno",
"path"}``. ``type`` is the name of the OSError subclass for OS failures (with
``errno`` and ``path`` set), or one of ``BadRequest``, ``UnknownOperation``,
``InternalError``.
"""

from __future__ import annotations

import json
import struct

# typing is not imported at run time: every import costs in an emulated guest.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

PROTOCOL_VERSION = 1
MAGIC = b"FKD1"
HEADER = struct.Struct(">4sII")
CHUNK_SIZE = 1 << 20
MAX_JSON_SIZE = 1 << 20
MAX_PAYLOAD_SIZE = 4 * CHUNK_SIZE

_READ_SIZE = 256 * 1024


class MalformedFrame(Exception):
    """Bytes on the stream were not a valid frame; the reader skipped them and can go on."""


class Frame:
    """One decoded frame: its JSON fields and its binary payload."""

    __slots__ = ("fields", "payload")

    def __init__(self, fields: dict, payload: bytes = b"") -> None:
        self.fields = fields
        self.payload = payload

    def __repr__(self) -> str:
        return f"Frame({self.fields!r}, <{len(self.payload)} bytes>)"


def encode_header(fields: dict, payload_length: int = 0) -> bytes:
    """Return the header and JSON part of a frame; the caller sends the payload after it.

    Keeping the payload out of this function spares a copy of every chunk.
    """
    if payload_length > MAX_PAYLOAD_SIZE:
        raise ValueError(f"a frame payload is limited to {MAX_PAYLOAD_SIZE} bytes, got {payload_length}")
    body = json.dumps(fields, separators=(",", ":")).encode()
    if len(body) > MAX_JSON_SIZE:
        raise ValueError(f"the JSON part of a frame is limited to {MAX_JSON_SIZE} bytes, got {len(body)}")
    return HEADER.pack(MAGIC, len(body), payload_length) + body


def message_frames(fields: dict, payload: bytes | bytearray | memoryview = b"") -> Iterator[tuple[dict, memoryview]]:
    """Split one message into ``(fields, chunk)`` frames of at most ``CHUNK_SIZE`` payload bytes.

    The first frame carries ``fields``; continuation frames carry only the id
    and ``more``. Chunks are views into ``payload``, not copies.
    """
    view = memoryview(payload)
    message_id = fields["id"]
    first = view[:CHUNK_SIZE]
    offset = len(first)
    yield (dict(fields, more=True) if offset < len(view) else fields), first
    while offset < len(view):
        chunk = view[offset : offset + CHUNK_SIZE]
        offset += len(chunk)
        yield {"id": message_id, "more": offset < len(view)}, chunk


class FrameReader:
    """Reads frames from a byte stream, resynchronising on garbage.

    ``read(n)`` must return between 1 and ``n`` bytes, or ``b""`` at the end of
    the stream; it is called again after an end of stream (a virtio port
    reports end of stream while the host end is disconnected, then carries on).
    """

    def __init__(self, read: Callable[[int], bytes]) -> None:
        self._read = read
        self._buffer = bytearray()

    def read_frame(self) -> Frame | None:
        """Return the next frame, or None at the end of the stream.

        Raises MalformedFrame after skipping bytes that were not a frame, or
        when the stream ended inside a frame; the next call continues after
        them.
        """
        skipped = 0
        while True:
            if not self._fill(HEADER.size):
                self._drop_partial_frame(skipped)
                return None
            magic, json_length, payload_length = HEADER.unpack_from(self._buffer)
            if magic == MAGIC and 0 < json_length <= MAX_JSON_SIZE and payload_length <= MAX_PAYLOAD_SIZE:
                break
            next_magic = self._buffer.find(MAGIC, 1)
            # Without a magic in sight keep the last bytes: they may start one.
            drop = next_magic if next_magic > 0 else len(self._buffer) - (len(MAGIC) - 1)
            del self._buffer[:drop]
            skipped += drop
        if skipped:
            raise MalformedFrame(f"skipped {skipped} bytes that were not a frame")
        frame_length = HEADER.size + json_length + payload_length
        if not self._fill(frame_length):
            self._drop_partial_frame(0)
            return None
        body = bytes(self._buffer[HEADER.size : HEADER.size + json_length])
        payload = bytes(self._buffer[HEADER.size + json_length : frame_length])
        del self._buffer[:frame_length]
        try:
            fields = json.loads(body)
        except ValueError as exc:
            raise MalformedFrame(f"dropped a frame whose JSON part is unreadable: {exc}") from None
        if not isinstance(fields, dict) or type(fields.get("id")) is not int:
            raise MalformedFrame(f"dropped a frame without an integer id: {body[:200]!r}")
        return Frame(fields, payload)

    def _fill(self, size: int) -> bool:
        while len(self._buffer) < size:
            data = self._read(max(size - len(self._buffer), _READ_SIZE))
            if not data:
                return False
            self._buffer += data
        return True

    def _drop_partial_frame(self, skipped: int) -> None:
        """At the end of the stream, forget what cannot become a frame any more, and say so."""
        leftover = len(self._buffer) + skipped
        self._buffer.clear()
        if leftover:
            raise MalformedFrame(f"the stream ended inside a frame; dropped {leftover} bytes")
