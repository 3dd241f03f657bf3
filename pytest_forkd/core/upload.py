"""Streamed writes into the guest: what :meth:`VM.write_stream <pytest_forkd.core.vm.VM.write_stream>` does.

A server that passes an upload through to a guest (an HTTP request body, a
multipart part) must not hold it whole in the host's memory. The agent's
``write_file`` already takes its payload in chunks, writing them to a
temporary file beside the destination and renaming it over the destination
when the last one arrives; this module feeds it from an iterable, one chunk
of at most ``wire.CHUNK_SIZE`` bytes at a time, with the channel's own
backpressure. When the iterable raises (the client went away, a limit was
hit), the upload is withdrawn in the guest, so nothing of it lands.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pytest_forkd.analysis.transcript import Transcript
from pytest_forkd.core import validate
from pytest_forkd.errors import ForkdError
from pytest_forkd.guest import wire
from pytest_forkd.guest.client import AgentClient

if TYPE_CHECKING:
    from pytest_forkd.core.handles import VMHandle

#: Seconds the guest may take to commit a streamed write once its last chunk was sent.
FINISH_TIMEOUT = 120.0
#: Seconds the guest may take to drop a streamed write the host gave up on.
CANCEL_TIMEOUT = 15.0


def write_stream(vm: VMHandle, path: str, chunks: Iterable[bytes], mode: int | None) -> int:
    """``vm.write_stream``: checked, recorded in the transcript (size and digest, not the data), sent."""
    validate.guest_path(path)
    check_mode(path, mode)
    entry = vm.transcript.record("write_file", path=path, mode=mode, streamed=True)
    started = time.perf_counter()
    try:
        entry["data"] = vm._call(f"writing {path}", stream_upload, vm.agent, path, chunks, mode)
    except BaseException as exc:
        Transcript.finish(entry, started, error=exc)
        raise
    Transcript.finish(entry, started)
    return int(entry["data"]["bytes"])


def check_mode(path: str, mode: int | None) -> None:
    """InvalidArgument unless ``mode`` is None or a permission number."""
    if mode is not None and (isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o7777):
        raise validate.InvalidArgument(f"mode for {path} must be a permission number such as 0o644, got {mode!r}")


def stream_upload(client: AgentClient, path: str, chunks: Iterable[bytes], mode: int | None) -> dict[str, Any]:
    """Send ``chunks`` as the payload of one ``write_file`` request; ``{bytes, sha256}`` of what was written."""
    request: dict[str, Any] = {"op": "write_file", "path": path}
    if mode is not None:
        request["mode"] = mode
    call = client.start_upload(request)
    digest, size = hashlib.sha256(), 0
    try:
        for chunk in chunks:
            if not isinstance(chunk, (bytes, bytearray, memoryview)):
                raise validate.InvalidArgument(f"chunks written to {path} must be bytes, got {type(chunk).__name__}")
            view = memoryview(chunk).cast("B")
            for offset in range(0, len(view), wire.CHUNK_SIZE):
                piece = bytes(view[offset : offset + wire.CHUNK_SIZE])
                call.send(piece)
                digest.update(piece)
                size += len(piece)
    except BaseException:
        try:
            client.cancel(call.request_id, timeout=CANCEL_TIMEOUT)
            call.finish(CANCEL_TIMEOUT)
        except ForkdError:
            pass  # the guest answers that it was cancelled, or is gone: either way nothing lands
        raise
    call.finish(FINISH_TIMEOUT)
    return {"bytes": size, "sha256": digest.hexdigest()}
