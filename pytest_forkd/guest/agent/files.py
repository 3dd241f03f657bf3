"""Request payloads: in memory, written beside or into their destination, or unpacked as a tar stream."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading

from .common import RequestError, _tarstream, _with_path, _write_all

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
    from contextlib import AbstractContextManager
    from typing import Any


class _WithdrawnPayload:
    """Stands in for the payload of a request cancelled while it arrived: drops the rest."""

    def write(self, chunk: bytes) -> None:
        pass

    def discard(self) -> None:
        pass


class _RefusedPayload:
    """The payload of a request refused at its first frame (an unknown ``user``): dropped, the error replied."""

    def __init__(self, error: RequestError) -> None:
        self._error = error

    def write(self, chunk: bytes) -> None:
        pass

    def commit(self, mode: int | None) -> int:
        raise self._error

    def discard(self) -> None:
        pass


class _MemorySink:
    """Collects a request payload (an exec's stdin) in memory."""

    def __init__(self) -> None:
        self._chunks: list[bytes] = []

    def write(self, chunk: bytes) -> None:
        if chunk:
            self._chunks.append(chunk)

    def contents(self) -> bytes:
        return b"".join(self._chunks)

    def discard(self) -> None:
        self._chunks.clear()


class _UploadSink:
    """Writes an upload to a temporary file beside its destination, chunk by chunk.

    The destination only changes at :meth:`commit`, by rename, so a reader in
    the guest never sees half a file. The first OS error is kept and reported
    at commit; later chunks are dropped.
    """

    def __init__(self, path: str, request_id: int) -> None:
        self._path = path
        directory, name = os.path.split(path)
        self._temporary = os.path.join(directory, f".{name}.{os.getpid()}-{request_id}.forkd-upload")
        self._size = 0
        self._error: OSError | None = None
        self._fd: int | None = None
        self._temporary_exists = False
        try:
            self._fd = os.open(self._temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
            self._temporary_exists = True
        except OSError as exc:
            self._error = exc

    def write(self, chunk: bytes) -> None:
        if self._fd is None or not chunk:
            return
        try:
            _write_all(self._fd, chunk)
            self._size += len(chunk)
        except OSError as exc:
            self._error = exc
            self.discard()

    def commit(self, mode: int | None) -> int:
        """Give the file its mode and move it into place; return its size."""
        if self._error is not None:
            raise _with_path(self._error, self._path)
        if mode is None:
            # Replacing a file keeps its mode; a new one gets 0o666 less the umask, as open() gives.
            with contextlib.suppress(OSError):
                mode = os.stat(self._path).st_mode & 0o7777
        assert self._fd is not None  # open unless an error was kept
        try:
            if mode is not None:
                os.fchmod(self._fd, mode)
            # Closed before it appears at its path: a file still open for writing cannot be
            # executed (ETXTBSY), and the next request may run it at once.
            os.close(self._fd)
            self._fd = None
            os.rename(self._temporary, self._path)
        except OSError as exc:
            raise _with_path(exc, self._path) from None
        self._temporary_exists = False
        return self._size

    def discard(self) -> None:
        """Close the file and remove it unless it was committed; safe to call twice."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._temporary_exists:
            self._temporary_exists = False
            with contextlib.suppress(OSError):
                os.unlink(self._temporary)


class _InPlaceUpload:
    """Writes an upload into its destination as a user other than root, chunk by chunk (``write_file`` with ``user``).

    The destination is opened at the first frame under the user's identity
    (``acting_as()``: the kernel checks the user's permissions, and a new file
    is the user's), truncated, and every chunk goes straight into it: the guest
    holds one copy of the file, wherever it lives, and the agent a chunk. That
    is how ``cat > PATH`` run as the user writes, and what Docker's sandboxes do:
    a reader may see the file grow, and a failed upload leaves it cut short.
    Only regular files are written (a FIFO or a device is refused: opening one
    could block the agent). The first OS error is kept and reported at commit.
    """

    def __init__(self, path: str, acting_as: Callable[[], AbstractContextManager[None]]) -> None:
        self._path = path
        self._acting_as = acting_as
        self._size = 0
        self._error: BaseException | None = None
        self._fd: int | None = None
        try:
            with acting_as():
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, 0o666)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise OSError(errno.EINVAL, "Not a regular file: only regular files are written", path)
                os.ftruncate(fd, 0)
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd
        except OSError as exc:
            self._error = _with_path(exc, path)
        except RequestError as exc:  # the user cannot be acted as here
            self._error = exc

    def write(self, chunk: bytes) -> None:
        if self._fd is None or not chunk:
            return
        try:
            _write_all(self._fd, chunk)
            self._size += len(chunk)
        except OSError as exc:
            self._error = _with_path(exc, self._path)
            self.discard()

    def commit(self, mode: int | None) -> int:
        """Set ``mode`` (as the user: only its owner may) and close the file; return its size."""
        if self._error is not None:
            raise self._error
        assert self._fd is not None  # open unless an error was kept
        fd, self._fd = self._fd, None
        try:
            if mode is not None:
                with self._acting_as():
                    os.fchmod(fd, mode)
        except OSError as exc:
            raise _with_path(exc, self._path) from None
        finally:
            # Closed before the reply: a file still open for writing cannot be executed (ETXTBSY).
            os.close(fd)
        return self._size

    def discard(self) -> None:
        """Close the file (what was written stays: it was written in place); safe to call twice."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class _ArchiveSink(_MemorySink):
    """Unpacks a ``copy_in`` upload (a tar stream) as it arrives, in a thread of its own.

    The reader thread hands chunks over through a bounded pipe, so neither
    the agent nor the host ever holds more than a few chunks of the tree; a
    slow disk slows the reader thread down, and with it the host's sending.
    Once unpacking failed (no space left, a file in the way) the rest of the
    upload is read and dropped, and the error is the request's reply.
    """

    def __init__(self, path: str) -> None:
        super().__init__()
        tarstream = _tarstream()
        self._path = path
        self._pipe = tarstream.ChunkPipe(limit=4 * wire.CHUNK_SIZE)
        self._stats = None
        self._error: BaseException | None = None
        self._finished = False
        self._thread = threading.Thread(target=self._unpack, name="copy-in", daemon=True)
        self._thread.start()

    def _unpack(self) -> None:
        tarstream = _tarstream()
        try:
            self._stats = tarstream.unpack(self._pipe, self._path)
        except tarstream.PipeClosed:
            self._error = RequestError("Cancelled", "the copy was cancelled by the host")
        except tarstream.ArchiveRefused as exc:
            self._error = RequestError("BadArchive", f"{exc} (member {exc.member!r})")
        except BaseException as exc:
            self._error = exc
        finally:
            self._pipe.close_reader()

    def write(self, chunk: bytes) -> None:
        self._pipe.put(chunk)

    def finish(self) -> Any:
        """Wait until the whole upload is unpacked; its stats, or the error unpacking it raised."""
        self._finished = True
        self._pipe.close()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._stats

    def contents(self) -> bytes:
        return b""

    def discard(self) -> None:
        if not self._finished:
            self._finished = True
            self._pipe.abort("the upload was dropped")
