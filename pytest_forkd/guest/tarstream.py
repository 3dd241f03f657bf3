"""File trees as tar streams, both ways: packed with exclusions, unpacked without trusting the archive.

This module runs on both sides, like ``wire.py``: in the guest next to the
agent (as ``/opt/forkd/tarstream.py``), which packs a tree for ``copy_out``
and unpacks one for ``copy_in``, and on the host, which does the opposite.
It must stay stdlib-only; ``tarfile`` is imported on first use, since every
import costs under emulation.

Streams, never whole trees
--------------------------
:func:`pack` writes a tar stream (``tarfile`` mode ``w|``) to any object with
a ``write`` method, one member at a time; :func:`unpack` reads one (mode
``r|``) from any object with a ``read`` method. :class:`ChunkPipe` connects a
thread that receives chunks to a thread that unpacks them, holding at most a
bounded number of bytes. Neither side ever holds more than a few chunks of a
tree in memory, whatever its size.

Archive layout
--------------
The first member is named ``.``: the copied path itself (a directory, a
regular file or a symbolic link). Members below it are named by their path
relative to it (``src/pkg/__init__.py``). Modes, symbolic links (their target
text, verbatim) and modification times to the nanosecond (a pax ``mtime``
record) travel with each member; owners do not. Hard links are copied as
separate files; sockets, FIFOs and device files are skipped and counted.

Exclusions
----------
``exclude`` takes glob patterns (``fnmatch``: ``*``, ``?``, ``[...]``). A
pattern without a ``/`` is matched against the name of every file and
directory at any depth (``__pycache__``, ``*.pyc``); a pattern with a ``/``
against the path relative to the copied directory (``build/*``,
``docs/_build``). An excluded directory is skipped with everything below it.

Unpacking an archive one did not make
-------------------------------------
:func:`unpack` treats the archive as hostile (the host unpacks what a guest
sent): it refuses, with :class:`ArchiveRefused` naming the member, absolute
names, names with ``..``, hard links, device files, FIFOs and any other
member type but files, directories and symbolic links; it never follows a
symbolic link, neither one in the archive nor one already at the
destination (a member whose path leads through a link is refused, and a link
or file in the way of a file is replaced, never written through); it refuses
an archive once it exceeds ``max_bytes`` of file data or ``max_members``
members, and pax or GNU long-name headers larger than ``MAX_HEADER_BYTES``.
With ``strip_setid`` set-user-ID and set-group-ID bits are dropped. Symbolic
links themselves are recreated as they were, absolute or dangling ones
included: a link is only a danger when something writes through it.
"""

from __future__ import annotations

import fnmatch
import os
import stat
import threading
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from typing import Any

#: The name of the copied path itself in an archive.
ROOT = "."
#: The largest pax or GNU long-name header accepted (a header is read into memory whole).
MAX_HEADER_BYTES = 1 << 20
_COPY_BLOCK = 1 << 20
_ONLY_USER_ACCESS = 0o700


class ArchiveRefused(Exception):
    """An archive member that must not be unpacked; ``member`` names it as the archive does."""

    def __init__(self, message: str, member: str = "") -> None:
        super().__init__(message)
        self.member = member


class Stats:
    """What a pack or unpack moved: ``files`` (of any kind), ``bytes`` of file data, ``skipped`` special files."""

    __slots__ = ("bytes", "files", "skipped")

    def __init__(self) -> None:
        self.files = 0
        self.bytes = 0
        self.skipped = 0

    def to_json(self) -> dict[str, int]:
        return {"files": self.files, "bytes": self.bytes, "skipped": self.skipped}


# -- exclusions -----------------------------------------------------------------------------


class Excludes:
    """Glob patterns that leave paths out of a copy (see the module docstring)."""

    def __init__(self, patterns: Iterable[str] = ()) -> None:
        self.patterns = tuple(patterns)
        self._names = [p for p in self.patterns if "/" not in p.rstrip("/")]
        self._paths = [p.strip("/") for p in self.patterns if "/" in p.rstrip("/")]

    def __bool__(self) -> bool:
        return bool(self.patterns)

    def excluded(self, relative: str) -> bool:
        """Whether ``relative`` (``a/b/c``, relative to the copied directory) is left out."""
        name = relative.rsplit("/", 1)[-1]
        if any(fnmatch.fnmatchcase(name, pattern.rstrip("/")) for pattern in self._names):
            return True
        return any(fnmatch.fnmatchcase(relative, pattern) for pattern in self._paths)


# -- packing ---------------------------------------------------------------------------------


def pack(source: str, out: Any, exclude: Iterable[str] = ()) -> Stats:
    """Write ``source`` (a file, link or directory tree) to ``out`` as a tar stream; return what it held.

    Raises OSError (``filename`` set) when ``source`` does not exist or a
    file cannot be read.
    """
    import tarfile

    excludes = Excludes(exclude)
    stats = Stats()
    root = os.lstat(source)
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as archive:
        _add(archive, ROOT, source, root, stats)
        if stat.S_ISDIR(root.st_mode):
            _add_tree(archive, source, "", excludes, stats)
    return stats


def _add_tree(archive: Any, directory: str, prefix: str, excludes: Excludes, stats: Stats) -> None:
    try:
        entries = sorted(os.scandir(directory), key=lambda entry: entry.name)
    except OSError as exc:
        raise _named(exc, directory) from None
    for entry in entries:
        relative = prefix + entry.name
        if excludes and excludes.excluded(relative):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue  # removed while we walked
        if _add(archive, relative, entry.path, info, stats) and stat.S_ISDIR(info.st_mode):
            _add_tree(archive, entry.path, relative + "/", excludes, stats)


def _add(archive: Any, name: str, path: str, info: os.stat_result, stats: Stats) -> bool:
    """Add one member; False when it was skipped (a socket, FIFO or device file)."""
    import tarfile

    member = tarfile.TarInfo(name)
    member.mode = stat.S_IMODE(info.st_mode)
    member.mtime = info.st_mtime_ns // 1_000_000_000
    member.pax_headers = {"mtime": _ns_text(info.st_mtime_ns)}
    if stat.S_ISREG(info.st_mode):
        member.type = tarfile.REGTYPE
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise _named(exc, path) from None
        with os.fdopen(fd, "rb") as source:
            member.size = os.fstat(fd).st_size
            try:
                archive.addfile(member, source)
            except OSError as exc:  # also "unexpected end of data": it shrank while we read it
                raise _named(exc, path) from None
        stats.bytes += member.size
    elif stat.S_ISDIR(info.st_mode):
        member.type = tarfile.DIRTYPE
        archive.addfile(member)
    elif stat.S_ISLNK(info.st_mode):
        member.type = tarfile.SYMTYPE
        member.linkname = os.readlink(path)
        archive.addfile(member)
    else:
        stats.skipped += 1
        return False
    archive.members.clear()  # a stream never needs them again; a large tree would pile them up
    stats.files += 1
    return True


def _ns_text(ns: int) -> str:
    sign = "-" if ns < 0 else ""
    seconds, fraction = divmod(abs(ns), 1_000_000_000)
    return f"{sign}{seconds}.{fraction:09d}"


def _ns_of(member: Any) -> int:
    """The member's mtime in ns, from its pax record when it has one (floats lose nanoseconds)."""
    text = member.pax_headers.get("mtime") if member.pax_headers else None
    if isinstance(text, str):
        sign = -1 if text.startswith("-") else 1
        whole, _, fraction = text.lstrip("-").partition(".")
        try:
            return sign * (int(whole or "0") * 1_000_000_000 + int((fraction + "000000000")[:9]))
        except ValueError:
            pass
    return int(member.mtime) * 1_000_000_000


# -- unpacking -------------------------------------------------------------------------------


def unpack(
    source: Any,
    destination: str,
    *,
    strip_setid: bool = False,
    max_bytes: int | None = None,
    max_members: int | None = None,
) -> Stats:
    """Unpack the tar stream read from ``source`` so that its root becomes ``destination``.

    ``destination`` names the copy itself: a root file lands at that path
    (replacing a file or link there), a root directory's contents in that
    directory (created with its parents, or merged into an existing one).
    A file where a directory is expected, or a directory where a file is,
    raises NotADirectoryError or IsADirectoryError naming the path. See the
    module docstring for what is refused (:class:`ArchiveRefused`).
    """
    import tarfile

    class BoundedInfo(tarfile.TarInfo):
        """A TarInfo that refuses to read an oversized pax or long-name header into memory."""

        def _proc_member(self, archive: Any) -> Any:
            if self.type in _HEADER_TYPES and self.size > MAX_HEADER_BYTES:
                raise ArchiveRefused(f"a {self.size}-byte extended header, larger than {MAX_HEADER_BYTES}", self.name)
            return super()._proc_member(archive)  # type: ignore[misc]

    _HEADER_TYPES = (
        tarfile.XHDTYPE,
        tarfile.XGLTYPE,
        tarfile.SOLARIS_XHDTYPE,
        tarfile.GNUTYPE_LONGNAME,
        tarfile.GNUTYPE_LONGLINK,
    )
    unpacker = _Unpacker(destination, strip_setid)
    stats = Stats()
    try:
        archive = tarfile.open(fileobj=source, mode="r|", tarinfo=BoundedInfo)
    except tarfile.ReadError as exc:
        raise ArchiveRefused(f"not a tar stream ({exc})") from None
    with archive:
        try:
            first = _unpack_members(archive, unpacker, stats, max_bytes, max_members)
        except tarfile.TarError as exc:  # damaged, or cut short (the sender failed half-way)
            raise ArchiveRefused(f"a damaged or truncated tar stream ({exc})") from None
        if first:
            raise ArchiveRefused("an empty archive: it does not even hold the copied path itself")
        unpacker.finish()
    return stats


def _unpack_members(
    archive: Any, unpacker: _Unpacker, stats: Stats, max_bytes: int | None, max_members: int | None
) -> bool:
    """Unpack every member; True if there was none."""
    first = True
    while True:
        member = archive.next()
        if member is None:
            return first
        archive.members.clear()
        if max_members is not None and stats.files >= max_members:
            raise ArchiveRefused(f"more than {max_members} members; pass a larger max_files", member.name)
        if member.isreg() and max_bytes is not None and stats.bytes + member.size > max_bytes:
            raise ArchiveRefused(f"more than {max_bytes} bytes of file data; pass a larger max_size", member.name)
        unpacker.add(archive, member, first)
        first = False
        stats.files += 1
        if member.isreg():
            stats.bytes += member.size


class _Unpacker:
    """Creates the members of one archive under ``destination``, never through a link."""

    def __init__(self, destination: str, strip_setid: bool) -> None:
        self.destination = destination
        self.strip_setid = strip_setid
        self.root_is_dir = True
        # Directories known to be real ones (not links) below the destination, and their final state.
        self.checked: set[str] = set()
        self.directories: list[tuple[str, int, int]] = []

    def add(self, archive: Any, member: Any, first: bool) -> None:
        parts = self._parts(member)
        mode = stat.S_IMODE(member.mode)
        if self.strip_setid:
            mode &= ~(stat.S_ISUID | stat.S_ISGID)
        if not parts:
            if not first:
                raise ArchiveRefused("the copied path itself appears twice", member.name)
            self._add_root(archive, member, mode)
            return
        if first:
            self._make_root_directory()  # an archive without "." first: its members go into the destination
        if not self.root_is_dir:
            raise ArchiveRefused("members below a copied path that is not a directory", member.name)
        path = self._parent_checked(parts)
        self._create(archive, member, path, mode)

    def finish(self) -> None:
        """Give directories their modes and times, deepest first (their contents changed both)."""
        for path, mode, mtime_ns in sorted(self.directories, key=lambda item: item[0].count("/"), reverse=True):
            os.chmod(path, mode)
            os.utime(path, ns=(mtime_ns, mtime_ns))

    # -- the copied path itself --
    def _add_root(self, archive: Any, member: Any, mode: int) -> None:
        destination = self.destination
        if member.isdir():
            self._make_root_directory()
            self.directories.append((destination, mode, _ns_of(member)))
            return
        self.root_is_dir = False
        parent = os.path.dirname(destination.rstrip("/")) or "/"
        _make_parents(parent)
        self._create(archive, member, destination.rstrip("/"), mode)

    def _make_root_directory(self) -> None:
        destination = self.destination
        _make_parents(destination)
        if not os.path.isdir(destination):  # the user chose this path: a link to a directory is fine
            raise NotADirectoryError(
                20, "exists and is not a directory, so a directory cannot be copied there", destination
            )
        self.checked.add(os.path.normpath(destination))

    # -- members below it --
    @staticmethod
    def _parts(member: Any) -> list[str]:
        name = member.name
        if "\x00" in name or (member.issym() and "\x00" in member.linkname):
            raise ArchiveRefused("a name with a NUL byte", name)
        if name.startswith("/"):
            raise ArchiveRefused("an absolute member name", name)
        parts = [part for part in name.split("/") if part not in ("", ".")]
        if ".." in parts:
            raise ArchiveRefused("a member name with '..'", name)
        return parts

    def _parent_checked(self, parts: list[str]) -> str:
        """The member's path, once every directory above it is known to be a real directory (made if missing)."""
        path = os.path.normpath(self.destination)
        for part in parts[:-1]:
            path = os.path.join(path, part)
            if path in self.checked:
                continue
            try:
                info = os.lstat(path)
            except FileNotFoundError:
                os.mkdir(path, 0o755)
                info = os.lstat(path)
            if stat.S_ISLNK(info.st_mode):
                raise ArchiveRefused(
                    f"a member below {path}, which is a symbolic link (links are never followed)", "/".join(parts)
                )
            if not stat.S_ISDIR(info.st_mode):
                raise NotADirectoryError(20, "is a file where a directory is expected", path)
            self.checked.add(path)
        return os.path.join(path, parts[-1])

    def _create(self, archive: Any, member: Any, path: str, mode: int) -> None:
        if member.isdir():
            self._directory(path, mode, _ns_of(member))
        elif member.isreg():
            self._file(archive, member, path, mode)
        elif member.issym():
            self._clear(path)
            os.symlink(member.linkname, path)
            os.utime(path, ns=(_ns_of(member), _ns_of(member)), follow_symlinks=False)
        elif member.islnk():
            raise ArchiveRefused("a hard link (links to other files are not unpacked)", member.name)
        elif member.ischr() or member.isblk():
            raise ArchiveRefused("a device file", member.name)
        elif member.isfifo():
            raise ArchiveRefused("a FIFO", member.name)
        else:
            raise ArchiveRefused(f"a member of unsupported type {member.type!r}", member.name)

    def _directory(self, path: str, mode: int, mtime_ns: int) -> None:
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            os.mkdir(path, _ONLY_USER_ACCESS)  # opened up at finish(), once its contents are in
        else:
            if not stat.S_ISDIR(info.st_mode):  # a link included: never followed
                raise NotADirectoryError(20, "is a file where a directory is expected", path)
        self.checked.add(path)
        self.directories.append((path, mode, mtime_ns))

    def _file(self, archive: Any, member: Any, path: str, mode: int) -> None:
        self._clear(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            data = archive.extractfile(member)
            left = member.size
            while left:
                block = data.read(min(left, _COPY_BLOCK))
                if not block:
                    raise ArchiveRefused("a file cut short", member.name)
                _write_all(fd, block)
                left -= len(block)
            os.fchmod(fd, mode)
        except OSError as exc:
            raise _named(exc, path) from None
        finally:
            os.close(fd)
        mtime_ns = _ns_of(member)
        os.utime(path, ns=(mtime_ns, mtime_ns))

    @staticmethod
    def _clear(path: str) -> None:
        """Remove a file or link in the way of a new member; a directory in the way is an error."""
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(info.st_mode):
            raise IsADirectoryError(21, "is a directory where a file is expected", path)
        os.unlink(path)


def _make_parents(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:
        pass  # a file there: the caller reports it
    except NotADirectoryError as exc:  # a file above it
        raise NotADirectoryError(20, "a path above it is a file where a directory is expected", path) from exc


def _named(exc: OSError, path: str) -> OSError:
    if exc.filename is not None:
        return exc
    return type(exc)(exc.errno, exc.strerror or str(exc), path)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# -- moving chunks between threads ------------------------------------------------------------


class PipeClosed(Exception):
    """The reading side of a :class:`ChunkPipe` gave up (or the writer aborted): no more data."""


class PipeStalled(Exception):
    """Nothing arrived in a :class:`ChunkPipe` for ``stall_timeout`` seconds."""


class ChunkPipe:
    """Chunks of a byte stream handed from one thread to another, as a file object to read from.

    ``put`` blocks while ``limit`` bytes or more wait (None: never blocks;
    with ``overflow``, holding more than that raises OverflowError instead).
    Once the reader called :meth:`close_reader`, ``put`` drops what it gets.
    ``read`` blocks until data arrives or the writer :meth:`close`s (end of
    stream); after ``stall_timeout`` seconds without data it raises
    PipeStalled. ``ended``: an extra test, polled while waiting, that ends
    the stream (the host's streamed call finished). ``consumed(n)`` runs
    after each read, outside the lock (the host returns credit there).
    """

    def __init__(
        self,
        *,
        limit: int | None = None,
        overflow: int | None = None,
        stall_timeout: float | None = None,
        ended: Callable[[], bool] | None = None,
        consumed: Callable[[int], None] | None = None,
    ) -> None:
        self._chunks: list[bytes] = []
        self._offset = 0
        self._size = 0
        self._limit = limit
        self._overflow = overflow
        self._stall_timeout = stall_timeout
        self._ended = ended
        self._consumed = consumed
        self._closed = False
        self._reader_gone = False
        self._aborted: str | None = None
        self._cond = threading.Condition()

    def put(self, data: bytes) -> None:
        if not data:
            return
        with self._cond:
            if self._limit is not None:
                while self._size >= self._limit and not self._reader_gone:
                    self._cond.wait()
            if self._reader_gone or self._closed:
                return
            if self._overflow is not None and self._size + len(data) > self._overflow:
                raise OverflowError(f"more than {self._overflow} bytes sent ahead of the reader")
            self._chunks.append(bytes(data))
            self._size += len(data)
            self._cond.notify_all()

    def close(self) -> None:
        """End of stream: reads return what is left, then b""."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def abort(self, reason: str) -> None:
        """The writer gives up: the reader's next read raises PipeClosed."""
        with self._cond:
            self._aborted = reason
            self._closed = True
            self._cond.notify_all()

    def close_reader(self) -> None:
        """The reader is done: what is queued and whatever comes later is dropped, blocked writers go on."""
        with self._cond:
            self._reader_gone = True
            self._chunks.clear()
            self._size = 0
            self._cond.notify_all()

    def read(self, size: int = -1) -> bytes:
        with self._cond:
            last_data = time.monotonic()
            while not self._size:
                if self._aborted is not None:
                    raise PipeClosed(self._aborted)
                if self._closed or (self._ended is not None and self._ended()):
                    return b""
                waited = 0.05 if self._ended is not None else None
                if self._stall_timeout is not None:
                    left = last_data + self._stall_timeout - time.monotonic()
                    if left <= 0:
                        raise PipeStalled(f"nothing arrived for {self._stall_timeout:g} s")
                    waited = left if waited is None else min(waited, left)
                self._cond.wait(waited)
            if self._aborted is not None:
                raise PipeClosed(self._aborted)
            data = self._take(size)
            self._cond.notify_all()
        if self._consumed is not None:
            self._consumed(len(data))
        return data

    def _take(self, size: int) -> bytes:
        parts = []
        wanted = self._size if size is None or size < 0 else min(size, self._size)
        got = 0
        while got < wanted:
            chunk = self._chunks[0]
            piece = chunk[self._offset : self._offset + wanted - got]
            parts.append(piece)
            got += len(piece)
            self._offset += len(piece)
            if self._offset == len(chunk):
                self._chunks.pop(0)
                self._offset = 0
        self._size -= got
        return parts[0] if len(parts) == 1 else b"".join(parts)


class ChunkWriter:
    """A file object for :func:`pack` that hands the stream on in chunks of ``chunk_size`` bytes."""

    def __init__(self, send: Callable[[bytes], None], chunk_size: int) -> None:
        self._send = send
        self._chunk_size = chunk_size
        self._buffer = bytearray()
        self.total = 0

    def write(self, data: bytes) -> int:
        self._buffer += data
        self.total += len(data)
        while len(self._buffer) >= self._chunk_size:
            chunk = bytes(self._buffer[: self._chunk_size])
            del self._buffer[: self._chunk_size]
            self._send(chunk)
        return len(data)

    def flush(self) -> None:
        if self._buffer:
            chunk = bytes(self._buffer)
            self._buffer.clear()
            self._send(chunk)
