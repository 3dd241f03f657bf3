"""Copying files and directory trees into and out of a guest: tar streamed over the agent channel.

``VM.copy_in`` and ``VM.copy_out`` are thin wrappers around :func:`copy_in`
and :func:`copy_out`. The tree travels as a tar stream (see
:mod:`pytest_forkd.guest.tarstream`) in the frames of one agent request:
packed on one side as the frames go, unpacked on the other as they arrive,
so neither the host nor the guest ever holds the whole tree; credit (out)
and the channel's own backpressure (in) keep each side a few chunks ahead
of the other at most.

The destination rule
--------------------
The destination path names the copy itself, never a folder to put it in:
copying a file makes (or replaces) exactly that file; copying a directory
makes that directory (with missing parents) and copies its contents into it,
merging into a directory already there. Copying a directory onto an
existing file, a file onto an existing directory, or anything below a path
that is a file, is a :class:`~pytest_forkd.errors.CopyError` naming the path.
So ``vm.copy_in("src", "/srv/app")`` gives ``/srv/app/setup.py``, whether or
not ``/srv/app`` existed, like ``cp -rT`` or ``rsync src/ /srv/app/``.

Modes, symbolic links (verbatim, absolute and dangling ones too) and
modification times (to the nanosecond) are kept; owners are not: files made
on the host belong to the user running the tests, files made in the guest to
root. Hard links become separate files; sockets, FIFOs and device files are
skipped (and counted in :attr:`CopyResult.skipped`).

The guest is not trusted: what ``copy_out`` unpacks on the host is checked
member by member (see ``tarstream``), set-user-ID and set-group-ID bits are
dropped, and the copy stops with :class:`~pytest_forkd.errors.UnsafeArchive`
at the first member that would land outside the destination, go through a
link, or exceed ``max_size``/``max_files``. If the guest stops sending for
``STALL_TIMEOUT`` seconds the copy fails instead of hanging. A failed copy
may leave part of the tree at the destination.
"""

from __future__ import annotations

import errno as errno_codes
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pytest_forkd.core import validate
from pytest_forkd.errors import AgentError, CopyError, ForkdError, GuestProtocolError, UnsafeArchive
from pytest_forkd.guest import tarstream, wire
from pytest_forkd.guest.client import GuestOSError

if TYPE_CHECKING:
    from pytest_forkd.guest.client import AgentClient, StreamCall

#: Seconds the host waits for the next chunk of a ``copy_out`` before giving up.
STALL_TIMEOUT = 60.0
#: Seconds the host waits for the guest to confirm that it stopped a copy that failed on the host.
CANCEL_TIMEOUT = 15.0
#: Seconds the host waits for the guest to confirm a ``copy_in`` once it sent the last chunk.
FINISH_TIMEOUT = 120.0
#: Default bounds of what ``copy_out`` accepts from a guest.
DEFAULT_MAX_SIZE = 8 << 30
DEFAULT_MAX_FILES = 1_000_000
# Credit window of a copy_out: how far the guest may run ahead of the host's unpacking.
_WINDOW = wire.OUTPUT_WINDOW

_HINTS = {
    errno_codes.ENOSPC: "no space left in the guest (its filesystem lives in its memory): copy less "
    "(exclude= patterns), free space, or give the VM more memory_mib",
    errno_codes.ENOTDIR: "a path there is a file where a directory is expected; pick another destination "
    "or remove that file first",
    errno_codes.EISDIR: "a directory is in the way of a file; the destination names the copy itself, so "
    "give the file's full path (e.g. /dir/name), not the directory to put it in",
    errno_codes.ENOENT: "no such file or directory; check the path (guest paths are absolute)",
    errno_codes.EACCES: "permission denied",
    errno_codes.EROFS: "the filesystem is read-only",
}


@dataclass(frozen=True)
class CopyResult:
    """What one copy moved: members (files, directories and links), bytes of file data, skipped special files."""

    files: int
    bytes: int
    skipped: int
    seconds: float

    @property
    def mib_per_s(self) -> float:
        """Throughput in MiB of file data per second (0 when nothing was timed)."""
        return self.bytes / (1 << 20) / self.seconds if self.seconds > 0 else 0.0


def patterns(exclude: Iterable[str] | str | None) -> list[str]:
    """``exclude`` checked: glob patterns (one str is one pattern)."""
    if exclude is None:
        return []
    if isinstance(exclude, str):
        exclude = [exclude]
    try:
        values = list(exclude)
    except TypeError:
        raise validate.InvalidArgument(f"exclude must be a list of glob patterns, got {exclude!r}") from None
    for value in values:
        if not isinstance(value, str) or not value or "\0" in value:
            raise validate.InvalidArgument(
                f"exclude must hold glob patterns (non-empty str), got {value!r}; e.g. exclude=['*.pyc', '.git']"
            )
    return values


def local_path(value: object, what: str = "local_path") -> str:
    """A host path argument (str or os.PathLike) as an absolute str."""
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise validate.InvalidArgument(f"{what} must be a path on the host (str or Path), got {value!r}")
    text = os.fspath(value)
    if not isinstance(text, str) or "\0" in text:
        raise validate.InvalidArgument(f"{what} must be a str path without NUL bytes, got {value!r}")
    return os.path.abspath(text)


def copy_in(client: AgentClient, source: str, destination: str, *, exclude: Iterable[str] = ()) -> CopyResult:
    """Copy host path ``source`` (file, link or tree) to ``destination`` in the guest; see the module docstring."""
    started = time.perf_counter()
    try:
        os.lstat(source)
    except OSError as exc:
        raise _local_error(exc, source, "copy", "into the guest") from None
    call = client.start_upload({"op": "copy_in", "path": destination})
    writer = tarstream.ChunkWriter(call.send, wire.CHUNK_SIZE)
    try:
        stats = tarstream.pack(source, writer, exclude)
        writer.flush()
    except OSError as exc:
        _withdraw_upload(client, call)
        raise _local_error(exc, source, "read", "to copy it into the guest") from None
    except BaseException:
        _withdraw_upload(client, call)
        raise
    try:
        reply = call.finish(FINISH_TIMEOUT)
    except GuestOSError as exc:
        raise _guest_error(exc, destination, f"cannot copy {source} into the guest at {destination}") from None
    except AgentError as exc:
        if isinstance(exc, GuestProtocolError):
            raise
        raise CopyError(f"cannot copy {source} into the guest at {destination}: {exc}", path=destination) from None
    return CopyResult(_count(reply, "files", stats.files), stats.bytes, stats.skipped, time.perf_counter() - started)


def copy_out(
    client: AgentClient,
    source: str,
    destination: str,
    *,
    exclude: Iterable[str] = (),
    max_size: int = DEFAULT_MAX_SIZE,
    max_files: int = DEFAULT_MAX_FILES,
) -> CopyResult:
    """Copy guest path ``source`` (file, link or tree) to host path ``destination``; see the module docstring."""
    started = time.perf_counter()
    pipe: tarstream.ChunkPipe
    call: StreamCall | None = None

    def on_output(fd: int, data: bytes, skipped: int) -> None:
        if fd != wire.STDOUT or skipped:
            raise GuestProtocolError(f"the guest sent copy_out data on stream {fd} (skipped={skipped})")
        pipe.put(data)  # OverflowError past the credit it was given: the call fails

    def ended() -> bool:
        return call is not None and call.done.is_set()

    def consumed(nbytes: int) -> None:
        if call is not None:
            call.credit(nbytes)

    pipe = tarstream.ChunkPipe(
        overflow=_WINDOW + 2 * wire.OUTPUT_CHUNK_SIZE, stall_timeout=STALL_TIMEOUT, ended=ended, consumed=consumed
    )
    request = {"op": "copy_out", "path": source, "exclude": list(exclude)}
    call = client.start_stream(request, on_output, window=_WINDOW, auto_credit=False)
    try:
        stats = tarstream.unpack(pipe, destination, strip_setid=True, max_bytes=max_size, max_members=max_files)
        trailing = 0
        while True:  # the padding after the end of the archive (a record: 10 KiB), bounded
            data = pipe.read(1 << 20)
            if not data:
                break
            trailing += len(data)
            if trailing > _WINDOW:
                raise tarstream.ArchiveRefused(f"more than {_WINDOW} bytes after the end of the archive")
    except tarstream.ArchiveRefused as exc:
        failure = _stop(client, call, pipe)
        if failure is not None:  # the archive ended early because the guest failed: that is the story
            raise _from_guest(failure, source) from None
        raise UnsafeArchive(
            f"refused what the guest sent for {source}: {exc} (member {exc.member!r}); nothing "
            "more was unpacked into " + destination,
            path=exc.member or source,
        ) from None
    except tarstream.PipeStalled:
        _stop(client, call, pipe)
        raise CopyError(
            f"the guest stopped sending {source} for {STALL_TIMEOUT:g} s, so the copy was abandoned "
            f"(part of it may be in {destination}); the VM may be overloaded",
            path=source,
        ) from None
    except OSError as exc:
        _stop(client, call, pipe)
        raise _local_error(exc, destination, "write", f"while copying {source} out of the guest") from None
    except BaseException:
        _stop(client, call, pipe)
        raise
    try:
        reply = call.wait(STALL_TIMEOUT)
    except (GuestOSError, AgentError) as exc:
        if isinstance(exc, GuestProtocolError):
            raise
        raise _from_guest(exc, source) from None
    except OverflowError as exc:
        raise GuestProtocolError(f"the guest broke the credit window while sending {source}: {exc}") from None
    return CopyResult(stats.files, stats.bytes, _count(reply, "skipped", 0), time.perf_counter() - started)


def _count(reply: dict[str, object], name: str, default: int) -> int:
    value = reply.get(name, default)
    return value if type(value) is int and value >= 0 else default


def _withdraw_upload(client: AgentClient, call: object) -> None:
    """After a failure on the host: drop the upload in the guest (nothing more of it is unpacked)."""
    request_id = getattr(call, "request_id", 0)
    try:
        client.cancel(request_id, timeout=CANCEL_TIMEOUT)
        call.finish(CANCEL_TIMEOUT)  # type: ignore[attr-defined]
    except ForkdError:
        pass  # the guest answers "cancelled", or is gone: either way nothing more lands


def _stop(client: AgentClient, call: StreamCall, pipe: tarstream.ChunkPipe) -> BaseException | None:
    """Stop a copy_out stream in the guest; the guest's own failure, when that is why the stream ended."""
    pipe.close_reader()
    if call.done.is_set():
        try:
            call.wait(0)
        except BaseException as exc:  # noqa: BLE001 - the guest's error, reported by the caller
            return exc
        return None
    try:
        client.cancel(call.request_id, timeout=CANCEL_TIMEOUT)
        call.wait(CANCEL_TIMEOUT)
    except ForkdError:
        pass  # a guest that does not even answer that: the call is forgotten, its frames ignored
    return None


def _from_guest(exc: BaseException, source: str) -> BaseException:
    if isinstance(exc, GuestOSError):
        return _guest_error(exc, source, f"cannot copy {source} out of the guest")
    if isinstance(exc, OverflowError):
        return GuestProtocolError(f"the guest broke the credit window while sending {source}: {exc}")
    if isinstance(exc, AgentError) and not isinstance(exc, GuestProtocolError):
        return CopyError(f"cannot copy {source} out of the guest: {exc}", path=source)
    return exc


def _guest_error(exc: GuestOSError, fallback: str, failed: str) -> CopyError:
    """``failed`` says what failed, naming ``fallback``, the path at fault unless the guest names another."""
    path = exc.path or fallback
    hint = _HINTS.get(exc.errno, exc.strerror)
    where = "" if path == fallback else f" ({path} in the guest)"
    return CopyError(f"{failed}: {hint}{where}", path=path, errno=exc.errno)


def _local_error(exc: OSError, fallback: str, verb: str, purpose: str) -> CopyError:
    path = os.fsdecode(exc.filename) if exc.filename is not None else fallback
    if exc.errno == errno_codes.ENOENT:
        hint = "no such file or directory on the host"
    elif exc.errno == errno_codes.ENOSPC:
        hint = "no space left on the host's disk"
    else:
        hint = _HINTS.get(exc.errno or 0, exc.strerror or str(exc))
    return CopyError(f"cannot {verb} {path} {purpose}: {hint}", path=path, errno=exc.errno)


def describe(result: CopyResult) -> dict[str, object]:
    """The transcript fields of a finished copy."""
    return {"files": result.files, "bytes": result.bytes, "skipped": result.skipped}
