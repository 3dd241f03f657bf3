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
A streamed reply (``exec``) is the exception to the message rule: its frames
carry output as the command produces it, each with ``"fd"``, and its last
frame carries the result.

The host does not trust the guest: it reads frames with the same limits,
counts what is malformed, and bounds each reply (see the host's client).

Requests (fields besides ``id``; ``payload`` is the message payload)
--------------------------------------------------------------------
Any request may carry ``epoch`` (opaque string), ``time`` (host wall clock,
seconds since the Unix epoch) and ``seed`` (hex string). When ``epoch``
differs from the last one the agent saw, it first sets the guest wall clock to
``time`` and mixes ``seed`` into the kernel's random pool, then handles the
request: that is how a VM restored from a snapshot gets the right time and
fresh randomness on its first request. Any request may also carry ``client``
(an opaque string, fixed per host client): a request from a new client (the
host of a VM restored from a snapshot) ends the process streams (``attach``)
of the previous one silently, since nobody reads them any more.

``ping``
    reply ``{pid, monotonic, wall_time, protocol}``; the readiness probe.
``exec``
    ``argv`` (list of str) or ``shell`` (str, run by ``/bin/sh -c``), optional
    ``env`` (dict merged over the agent's environment), ``cwd``, ``timeout``
    (seconds or null), ``max_output`` (bytes kept per stream, or null for
    all), ``window`` (bytes of output the agent may send ahead of the host's
    credit, default ``OUTPUT_WINDOW``); payload = stdin. The reply *streams*:
    output frames ``{"id", "more": true, "fd": 1|2}`` carry chunks of stdout
    (1) or stderr (2) as the command writes them, then one final frame
    ``{id, exit_code, signal, oom_killed, timed_out, duration_ms, truncated,
    stdout_total, stderr_total}`` ends the reply. Past ``max_output`` the
    agent sends the first half of the limit as it comes, keeps only the last
    half in a bounded ring, and sends that ring before the final frame; its
    first frame says ``"skipped": N``, the bytes dropped in between.
    ``exit_code`` is the command's status, or ``-N`` when signal ``N`` killed
    it (then ``signal`` is ``N``, else null), 127 when the program does not
    exist and 126 when it cannot be executed. ``oom_killed``: the out-of-memory
    killer ended it (its cgroup's ``memory.events``); ``timed_out``: the agent
    killed it at ``timeout``. ``pty``: true (24x80) or ``[rows, columns]``
    runs the command on a new pseudo-terminal, its controlling terminal; all
    it writes comes as stdout and the payload is typed in.

    Flow control: the agent never has more than ``window`` bytes of output
    sent and not yet credited; when the host is behind it stops reading the
    command's pipes (the command then blocks in write), and the channel stays
    free for other requests. The host returns credit with ``credit``.
``credit``
    ``ref`` (the id of a streaming request), ``bytes`` (int), optional ``fd``
    (1 or 2; process streams are credited per stream): the host has consumed
    that much of the request's output. No reply; unknown ``ref`` values are
    ignored.
``spawn``
    Fields as ``exec`` (``argv`` or ``shell``, ``env``, ``cwd``, ``pty``;
    ``max_output`` is required, ``window`` is per stream), no ``timeout``;
    ``stdin``: false gives the process no stdin (it reads end-of-file at once).
    Starts a process that outlives the request, in its own session and
    cgroup, after checking that its program exists (else a
    ``CommandNotFound`` error naming it). The agent reads its output at once
    and keeps, per stream, at most ``max_output`` bytes nobody took: the
    oldest half and the newest half, dropping (and counting) the middle. The
    reply streams as long as the process is followed: ``{"id", "more": true,
    "pid"}`` first; output frames ``{"fd", "skipped"?}`` within the stream's
    credit (``skipped``: bytes dropped just before this chunk);
    ``{"fd", "eof": true}`` when a stream ended; ``{"exited": true,
    "exit_code", "signal"}`` as soon as the process ended, whatever output is
    pending; and a final frame ``{exited, exit_code, signal, truncated,
    stdout_total, stderr_total}`` once all output was delivered, after which
    the agent forgets the process. The final frame implies the ends of both
    streams and the exit: end-of-stream and exit frames that would come just
    before it, in the same write, are left out.
``attach``
    ``pid``, optional ``window``: the reply of ``spawn`` again, for a process
    spawned earlier (typically before the snapshot this VM was restored
    from), from what the guest still holds. The stream has moved by the time
    the ``pid`` frame goes: whatever the process writes after the host reads
    that frame comes on this request. The process's previous stream ends
    with a ``Detached`` error (or silently, if it belonged to another host
    client). ``NoSuchProcess`` if the agent does not know the pid.
``stdin``
    ``pid``, optional ``close`` (bool); payload = bytes for the process's
    stdin (on a terminal: typed; ``close`` types Ctrl-D). Replies ``{size}``
    once written; ``BrokenPipe`` if the process stopped reading.
``signal``
    ``pid``, ``signal`` (int): sent to the process's group. Reply
    ``{delivered}``, false if it had already ended.
``resize``
    ``pid``, ``size`` ([rows, columns]): the window size of its terminal.
``processes``
    Reply ``{processes: [{pid, command, exit_code}]}``, every process the
    agent follows (``exit_code`` null while it runs).
``read_file``
    ``path``. Reply payload = the file's contents.
``write_file``
    ``path``, optional ``mode`` (int); payload = the new contents, written to
    a temporary file in the same directory and renamed over ``path`` at the
    end. Reply ``{size}``. With ``user`` (as ``exec`` takes it) other than
    root, the agent opens ``path`` itself as that user at the first frame (its
    permissions apply; a new file is its own; only a regular file) and writes
    every chunk into it in place as it arrives, as ``cat > path`` run as the
    user would.
``copy_in``
    ``path`` (the destination in the guest); payload = a tar stream (see
    ``tarstream.py``), unpacked as its frames arrive, so the agent never
    holds the whole tree. Reply ``{files, bytes, skipped}``; an archive the
    agent refuses gets a ``BadArchive`` error.
``copy_out``
    ``path``, optional ``exclude`` (list of glob patterns) and ``window``. The
    reply streams like an exec's: output frames ``{"id", "more": true,
    "fd": 1}`` carry the tar stream of ``path`` within the host's credit,
    then the final frame ``{id, files, bytes, skipped}``. A cancel stops it.
``cancel``
    ``target`` (the id of an earlier request). Stops it: a request whose
    payload is still arriving is dropped (its remaining frames are discarded
    and it gets a ``Cancelled`` error reply instead of running); an exec has
    its command's whole process group killed (its reply then comes as usual,
    with the signal as exit code). Reply ``{found, finished}`` once the target
    has finished (its reply sent, its command reaped), or after a few seconds
    with ``finished`` false; ``found`` is false when no such request was in
    progress (it had already finished).

Errors
------
A failed request gets a reply with ``"error": {"type", "message", "errno",
"path"}``. ``type`` is the name of the OSError subclass for OS failures (with
``errno`` and ``path`` set), or one of ``BadRequest``, ``UnknownOperation``,
``InternalError``, ``Cancelled``, and for processes ``CommandNotFound``,
``NoSuchProcess``, ``Detached``, ``StdinClosed``, ``BrokenPipe``, ``NoTerminal``.
"""

from __future__ import annotations

import json
import struct

# typing is not imported at run time: every import costs in an emulated guest.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from typing import Any

PROTOCOL_VERSION = 3
MAGIC = b"FKD1"
HEADER = struct.Struct(">4sII")
CHUNK_SIZE = 1 << 20
MAX_JSON_SIZE = 1 << 20
MAX_PAYLOAD_SIZE = 4 * CHUNK_SIZE
# Output of a command travels in chunks of at most this size, at most
# OUTPUT_WINDOW bytes ahead of the host's credit.
OUTPUT_CHUNK_SIZE = 256 * 1024
OUTPUT_WINDOW = 4 << 20
#: Bytes of each output stream (stdout, stderr) an exec keeps by default.
DEFAULT_MAX_OUTPUT = 4 << 20
STDOUT, STDERR = 1, 2

_READ_SIZE = 256 * 1024
_REPORT_SKIPPED_EVERY = _READ_SIZE


class MalformedFrame(Exception):
    """Bytes on the stream were not a valid frame; the reader skipped them and can go on.

    ``kind`` says what was wrong, for counting: ``garbage`` (bytes that were
    not a frame header), ``json`` (unreadable JSON part: bad UTF-8, bad
    syntax, nested too deeply), ``id`` (no integer id), ``truncated`` (the
    stream ended inside a frame).
    """

    def __init__(self, message: str, kind: str = "garbage") -> None:
        super().__init__(message)
        self.kind = kind


class Frame:
    """One decoded frame: its JSON fields and its binary payload."""

    __slots__ = ("fields", "payload")

    def __init__(self, fields: dict[str, Any], payload: bytes = b"") -> None:
        self.fields = fields
        self.payload = payload

    def __repr__(self) -> str:
        return f"Frame({self.fields!r}, <{len(self.payload)} bytes>)"


def encode_header(fields: dict[str, Any], payload_length: int = 0) -> bytes:
    """Return the header and JSON part of a frame; the caller sends the payload after it.

    Keeping the payload out of this function spares a copy of every chunk.
    """
    if payload_length > MAX_PAYLOAD_SIZE:
        raise ValueError(f"a frame payload is limited to {MAX_PAYLOAD_SIZE} bytes, got {payload_length}")
    body = json.dumps(fields, separators=(",", ":")).encode()
    if len(body) > MAX_JSON_SIZE:
        raise ValueError(f"the JSON part of a frame is limited to {MAX_JSON_SIZE} bytes, got {len(body)}")
    return HEADER.pack(MAGIC, len(body), payload_length) + body


def message_frames(
    fields: dict[str, Any], payload: bytes | bytearray | memoryview = b""
) -> Iterator[tuple[dict[str, Any], memoryview]]:
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

    def __init__(
        self, read: Callable[[int], bytes], *, max_json: int = MAX_JSON_SIZE, max_payload: int = MAX_PAYLOAD_SIZE
    ) -> None:
        self._read = read
        self._buffer = bytearray()
        self._max_json = min(max_json, MAX_JSON_SIZE)
        self._max_payload = min(max_payload, MAX_PAYLOAD_SIZE)

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
            if magic == MAGIC and 0 < json_length <= self._max_json and payload_length <= self._max_payload:
                break
            next_magic = self._buffer.find(MAGIC, 1)
            # Without a magic in sight keep the last bytes: they may start one.
            drop = next_magic if next_magic > 0 else len(self._buffer) - (len(MAGIC) - 1)
            del self._buffer[:drop]
            skipped += drop
            if skipped >= _REPORT_SKIPPED_EVERY:
                # Endless garbage must be seen (and counted) while it lasts, not after.
                raise MalformedFrame(f"skipped {skipped} bytes that were not a frame")
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
        except (ValueError, RecursionError) as exc:
            # ValueError covers bad UTF-8 and oversized integers; RecursionError deep nesting.
            raise MalformedFrame(f"dropped a frame whose JSON part is unreadable: {str(exc)[:200]}", "json") from None
        if not isinstance(fields, dict) or type(fields.get("id")) is not int:
            raise MalformedFrame(f"dropped a frame without an integer id: {body[:200]!r}", "id")
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
            raise MalformedFrame(f"the stream ended inside a frame; dropped {leftover} bytes", "truncated")
