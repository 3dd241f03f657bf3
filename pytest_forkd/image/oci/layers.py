"""A container image's layers applied in order into one merged tree, in memory, refusing hostile entries.

An image is a stack of tar streams (uncompressed, gzip or zstd; the magic
bytes decide, whatever the media type says). Each layer adds, replaces and,
through whiteouts, deletes entries of the layers below it, as the OCI image
spec says (``image-spec/layer.md``), which is also what umoci and Docker do:

- ``DIR/.wh.NAME`` deletes ``DIR/NAME`` of the layers below; ``DIR/.wh..wh..opq``
  hides everything the layers below had in ``DIR``. Whiteouts only touch lower
  layers, so each layer's whiteouts are applied before its other entries.
- A directory over a directory keeps the lower one's contents and takes the
  new metadata; anything else replaces what was there, a whole directory
  included. Missing parent directories are made (0755, root-owned).
- Hard links name an entry of the same or an earlier layer; symlinks are kept
  verbatim and never followed.
- Modes (setuid, setgid, sticky included), numeric owners (names are ignored),
  mtimes (to the second), extended attributes (PAX ``SCHILY.xattr.*``,
  ``security.capability`` included), device nodes and fifos are kept.

Nothing is extracted on the host: the merge happens on a model (path ->
:class:`Node`), and only file contents are written, each to a numbered file
in the build's own directory, never under a name taken from the layer. So a
hostile layer cannot write anywhere, and is refused with
:class:`HostileLayer`, which names the layer and the entry: a ``..``
component, a write through a symlink, a hard link out of the root or to
nothing, a NUL in a name, and sizes or counts beyond the limits below. A
leading ``/`` or ``./`` is dropped, as the spec allows. Names with a line
break are refused too: the disk writer (debugfs) reads its commands by line,
and no image needs them.
"""

from __future__ import annotations

import bz2
import contextlib
import errno
import gzip
import importlib
import lzma
import os
import shutil
import subprocess
import tarfile
import tempfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import IO, Final, Literal, Protocol

from ...errors import HostileLayer, ImageError, ImageStoreFull, ImageToolMissing, LayerError

__all__ = [
    "MAX_ENTRIES",
    "MAX_NAME_BYTES",
    "MAX_PATH_BYTES",
    "MAX_TOTAL_BYTES",
    "HostileLayer",
    "LayerBlob",
    "LayerError",
    "MergedTree",
    "Node",
    "flatten",
    "short_digest",
]

#: Tar entries an image may have, all layers together (a Debian root with Python has ~30,000).
MAX_ENTRIES: Final = 1_000_000
#: Bytes of a path inside the image; the host path of its copy must stay under Linux's PATH_MAX (4096).
MAX_PATH_BYTES: Final = 3840
#: Bytes of one path component: ext4's limit.
MAX_NAME_BYTES: Final = 255
#: Bytes of file content an image may hold, all layers together (each file's full size, replaced ones included).
MAX_TOTAL_BYTES: Final = 64 << 30
#: Bytes of a symlink's target: what one ext4 block holds.
MAX_TARGET_BYTES: Final = 4095
#: Bytes of one PAX or GNU long-name header: tarfile reads it into memory, so a huge one is refused first.
MAX_HEADER_BYTES: Final = 1 << 20
#: Room for one entry's extended attributes: one 4 KiB ext4 block, less its header and end marker.
MAX_XATTR_BYTES: Final = 4096 - 32 - 4
#: Largest uid/gid (2**32 - 1 means "none" to the kernel).
MAX_ID: Final = 2**32 - 2

#: The extended attributes ext4 and Linux can hold; others (another OS's) are dropped.
XATTR_NAMESPACES: Final = ("user.", "trusted.", "security.")
XATTR_NAMES: Final = ("system.posix_acl_access", "system.posix_acl_default")
#: Dropped although storable: the guest mounts the image under an overlay, which would read them as its own.
XATTR_DROPPED: Final = ("trusted.overlay.",)
PAX_XATTR: Final = "SCHILY.xattr."

WHITEOUT: Final = ".wh."
OPAQUE: Final = ".wh..wh..opq"

ZSTD_MAGIC: Final = b"\x28\xb5\x2f\xfd"
READ_CHUNK: Final = 1 << 20

Kind = Literal["file", "dir", "symlink", "char", "block", "fifo"]
Progress = Callable[[str], None]

_KINDS: Final[dict[bytes, Kind]] = {
    tarfile.REGTYPE: "file",
    tarfile.AREGTYPE: "file",
    tarfile.CONTTYPE: "file",
    tarfile.GNUTYPE_SPARSE: "file",
    tarfile.DIRTYPE: "dir",
    tarfile.SYMTYPE: "symlink",
    tarfile.CHRTYPE: "char",
    tarfile.BLKTYPE: "block",
    tarfile.FIFOTYPE: "fifo",
}
_KIND_NAMES: Final[dict[str, str]] = {
    "file": "a regular file",
    "dir": "a directory",
    "symlink": "a symlink",
    "char": "a character device",
    "block": "a block device",
    "fifo": "a fifo",
}


class LayerBlob(Protocol):
    """What flattening needs of a pulled layer (``pull.Layer`` has it)."""

    @property
    def digest(self) -> str: ...

    @property
    def media_type(self) -> str: ...

    @property
    def size(self) -> int: ...

    @property
    def path(self) -> Path: ...


@dataclass(eq=False)
class Node:
    """One inode of the merged tree; hard links are one Node under several names.

    ``blob`` holds a regular file's content (a file in the build directory,
    None when empty); ``children`` is a directory's.
    """

    kind: Kind
    mode: int  # permission bits, 0o7777
    uid: int
    gid: int
    mtime: int
    xattrs: dict[str, bytes] = field(default_factory=dict)
    size: int = 0
    blob: Path | None = None
    target: str = ""  # a symlink's, verbatim
    device: tuple[int, int] = (0, 0)  # major, minor
    children: dict[str, Node] = field(default_factory=dict)
    names: int = 0  # how many paths name this node


@dataclass
class MergedTree:
    """An image's root after all its layers: the root directory and, below it, every entry."""

    root: Node

    def walk(self) -> Iterator[tuple[str, Node]]:
        """Every ``(path, node)``, parents before children, names sorted; the root's path is ``""``.

        Iterative: a hostile image may nest directories deeper than Python's recursion limit.
        """
        stack: list[tuple[str, Node]] = [("", self.root)]
        while stack:
            path, node = stack.pop()
            yield path, node
            if node.kind == "dir":
                prefix = f"{path}/" if path else ""
                stack.extend((prefix + name, child) for name, child in sorted(node.children.items(), reverse=True))


def short_digest(digest: str) -> str:
    """``sha256:ab12cd34ef56…``: enough of a digest to tell layers apart in a message."""
    algorithm, _, value = digest.partition(":")
    return f"{algorithm}:{value[:12]}…" if len(value) > 12 else digest


def flatten(
    layers: Sequence[LayerBlob], workdir: Path, progress: Progress | None = None, *, folder: Path | None = None
) -> MergedTree:
    """Apply ``layers`` (lowest first) and return the merged tree; file contents go under ``workdir``.

    ``workdir`` must be an empty private directory of the caller's; it holds
    the content of every file still in the tree when this returns (and, on an
    error, whatever the caller removes with it). ``folder`` is the one a
    full-disk error names (default: ``workdir``), for a caller whose workdir
    is a temporary name the user never sees.
    """
    merger = _Merger(workdir, folder or workdir)
    for number, layer in enumerate(layers, 1):
        if progress is not None:
            progress(
                f"unpacking layer {number}/{len(layers)} {short_digest(layer.digest)} ({layer.size / 2**20:.1f} MiB)"
            )
        merger.apply_layer(layer)
    return MergedTree(merger.root)


# ---------------------------------------------------------------------------------------------- reading


@dataclass
class _Entry:
    """One tar entry, read and checked, waiting to be applied."""

    name: str  # as the tar has it, for messages
    parts: tuple[str, ...]
    kind: Kind | Literal["link"]
    mode: int = 0
    uid: int = 0
    gid: int = 0
    mtime: int = 0
    xattrs: dict[str, bytes] = field(default_factory=dict)
    size: int = 0
    blob: Path | None = None
    target: str = ""
    link: tuple[str, ...] = ()  # a hard link's target
    device: tuple[int, int] = (0, 0)


@dataclass
class _Whiteout:
    """``.wh.NAME`` (``hidden`` is NAME) or ``.wh..wh..opq`` (``hidden`` is None) in directory ``directory``."""

    name: str
    directory: tuple[str, ...]
    hidden: str | None


class _OversizedHeader(tarfile.HeaderError):
    pass


class _BoundedTarInfo(tarfile.TarInfo):
    """A TarInfo that refuses a long-name or PAX header bigger than :data:`MAX_HEADER_BYTES` before reading it."""

    def _proc_member(self, archive: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in _HEADER_TYPES and self.size > MAX_HEADER_BYTES:
            raise _OversizedHeader(f"a {self.size}-byte extended header (at most {MAX_HEADER_BYTES} are read)")
        result: tarfile.TarInfo = super()._proc_member(archive)  # type: ignore[misc]
        return result


_HEADER_TYPES: Final = (
    tarfile.XHDTYPE,
    tarfile.XGLTYPE,
    tarfile.SOLARIS_XHDTYPE,
    tarfile.GNUTYPE_LONGNAME,
    tarfile.GNUTYPE_LONGLINK,
)


class _Merger:
    """The merged tree being built, layer by layer, and the counters the limits apply to."""

    def __init__(self, workdir: Path, folder: Path) -> None:
        self.root = Node("dir", 0o755, 0, 0, 0, names=1)
        self.blobs = workdir
        self.folder = folder
        self.entries = 0
        self.content = 0
        self.label = ""

    # -- one layer

    def apply_layer(self, layer: LayerBlob) -> None:
        self.label = short_digest(layer.digest)
        if "tar" not in layer.media_type:
            raise LayerError(
                f"layer {self.label} has media type {layer.media_type!r}, not a tar layer; forkd reads "
                "uncompressed, gzip and zstd tar layers (encrypted or foreign layers are not supported)"
            )
        entries: list[_Entry] = []
        whiteouts: list[_Whiteout] = []
        try:
            with (
                _decompressed(layer.path) as stream,
                tarfile.open(fileobj=stream, mode="r|", tarinfo=_BoundedTarInfo, bufsize=READ_CHUNK) as tar,
            ):
                for member in tar:
                    read = self._read(member, tar)
                    if isinstance(read, _Whiteout):
                        whiteouts.append(read)
                    elif read is not None:
                        entries.append(read)
        # gzip.BadGzipFile and bz2's errors are OSErrors; a failed content write is an ImageError instead.
        except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, OSError) as exc:
            raise LayerError(
                f"layer {self.label} is not a readable tar stream ({_reason(exc)}); "
                f"delete {layer.path} and pull the image again"
            ) from None
        # A directory replacing a symlink often comes with an opaque marker (overlayfs makes it opaque).
        replaced = frozenset(entry.parts for entry in entries if entry.kind == "dir")
        for whiteout in whiteouts:
            self._whiteout(whiteout, replaced)
        for entry in entries:
            self._apply(entry)

    def _refuse(self, name: str, problem: str) -> HostileLayer:
        return HostileLayer(f"layer {self.label}: entry {name!r} {problem}; the image is refused")

    def _read(self, member: tarfile.TarInfo, tar: tarfile.TarFile) -> _Entry | _Whiteout | None:
        name = member.name
        self.entries += 1
        if self.entries > MAX_ENTRIES:
            raise self._refuse(name, f"is one more than the {MAX_ENTRIES:,} entries an image may have")
        parts = self._parts(name, name)
        base = parts[-1] if parts else ""
        if base.startswith(WHITEOUT):
            if base == OPAQUE:
                return _Whiteout(name, parts[:-1], None)
            if base.startswith(WHITEOUT + WHITEOUT):
                return None  # aufs bookkeeping (.wh..wh.plnk, ...): not part of the image
            hidden = base[len(WHITEOUT) :]
            if hidden in (".", ".."):
                raise self._refuse(name, "escapes the image root")
            if not hidden:
                raise self._refuse(name, "is a whiteout that names nothing")
            return _Whiteout(name, parts[:-1], hidden)
        entry = _Entry(name, parts, "file")
        self._metadata(member, entry)
        if member.islnk():
            entry.kind = "link"
            link = member.linkname
            if "\x00" in link:
                raise self._refuse(name, f"is a hard link whose target {link!r} contains a NUL byte")
            entry.link = self._parts(name, link, what=f"is a hard link to {link!r}, which")
            entry.target = link  # as written, for messages
            if not entry.link:
                raise self._refuse(name, "is a hard link to the image root")
            return entry
        kind = _KINDS.get(member.type)
        if kind is None:
            raise self._refuse(name, f"has the tar type {member.type!r}, which no image needs")
        entry.kind = kind
        if kind == "file":
            entry.size = member.size
            if member.size:
                entry.blob = self._store(name, member, tar)
        elif kind == "symlink":
            target = member.linkname
            if not target:
                raise self._refuse(name, "is a symlink with an empty target")
            if "\x00" in target:
                raise self._refuse(name, "is a symlink whose target contains a NUL byte")
            if len(os.fsencode(target)) > MAX_TARGET_BYTES:
                raise self._refuse(name, f"is a symlink whose target is longer than {MAX_TARGET_BYTES} bytes")
            entry.target = target
        elif kind in ("char", "block"):
            major, minor = member.devmajor, member.devminor
            if not (0 <= major < 1 << 12 and 0 <= minor < 1 << 20):
                raise self._refuse(name, f"is a device {major}:{minor}, beyond Linux's device numbers")
            entry.device = (major, minor)
        return entry

    def _parts(self, name: str, path: str, what: str = "") -> tuple[str, ...]:
        """``path`` as components, a leading ``/`` or ``./`` dropped; escaping or absurd paths refused."""
        if "\x00" in path:
            raise self._refuse(name, "contains a NUL byte")
        if "\n" in path or "\r" in path:
            raise self._refuse(name, "has a line break in its name, which the disk writer (debugfs) cannot express")
        parts = tuple(part for part in path.split("/") if part not in ("", "."))
        if ".." in parts:
            raise self._refuse(name, f"{what} escapes the image root" if what else "escapes the image root")
        if len(os.fsencode("/".join(parts))) > MAX_PATH_BYTES:
            raise self._refuse(name, f"has a path longer than {MAX_PATH_BYTES} bytes")
        if any(len(os.fsencode(part)) > MAX_NAME_BYTES for part in parts):
            raise self._refuse(name, f"has a name longer than {MAX_NAME_BYTES} bytes")
        return parts

    def _metadata(self, member: tarfile.TarInfo, entry: _Entry) -> None:
        if not (0 <= member.uid <= MAX_ID and 0 <= member.gid <= MAX_ID):
            raise self._refuse(member.name, f"has the owner {member.uid}:{member.gid}, beyond Linux's ids")
        xattrs: dict[str, bytes] = {}
        for key, value in member.pax_headers.items():
            if not key.startswith(PAX_XATTR):
                continue
            attribute = key[len(PAX_XATTR) :]
            if attribute.startswith(XATTR_DROPPED) or not (
                attribute.startswith(XATTR_NAMESPACES) or attribute in XATTR_NAMES
            ):
                continue
            if len(os.fsencode(attribute)) > 255 or any(ord(c) < 0x20 or ord(c) == 0x7F for c in attribute):
                raise self._refuse(member.name, f"has the extended attribute name {attribute!r}, which Linux refuses")
            # tarfile decodes PAX values as UTF-8 with surrogate escapes: encoding them back gives the bytes.
            xattrs[attribute] = value.encode("utf-8", "surrogateescape")
        room = sum(16 + _round4(len(os.fsencode(key))) + _round4(len(value)) for key, value in xattrs.items())
        if room > MAX_XATTR_BYTES:
            raise self._refuse(member.name, "has extended attributes that do not fit one 4 KiB ext4 block")
        entry.mode, entry.uid, entry.gid, entry.xattrs = member.mode & 0o7777, member.uid, member.gid, xattrs
        entry.mtime = min(max(int(member.mtime), 0), 2**32 - 1)

    def _store(self, name: str, member: tarfile.TarInfo, tar: tarfile.TarFile) -> Path:
        """Copy a regular file's content to a numbered file of the build directory."""
        self.content += member.size
        if self.content > MAX_TOTAL_BYTES:
            raise self._refuse(name, f"takes the image past the {MAX_TOTAL_BYTES >> 30} GiB of files it may hold")
        source = tar.extractfile(member)
        assert source is not None  # a regular file
        blob = self.blobs / str(self.entries)
        try:
            out = open(os.open(blob, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), "wb")
        except OSError as exc:
            raise self._write_failure(exc) from None
        with out:
            while chunk := source.read(READ_CHUNK):  # a read error is the layer's: it propagates as is
                try:
                    out.write(chunk)
                except OSError as exc:
                    raise self._write_failure(exc) from None
            try:
                out.flush()
            except OSError as exc:
                raise self._write_failure(exc) from None
        return blob

    def _write_failure(self, exc: OSError) -> ImageError:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return ImageStoreFull(no_space_text(self.folder, f"unpacking layer {self.label}"))
        return ImageError(f"unpacking layer {self.label} into {self.folder} failed: {exc.strerror or exc}")

    # -- applying

    def _walk(
        self,
        name: str,
        directory: tuple[str, ...],
        *,
        create: bool,
        mtime: int = 0,
        replaced: frozenset[tuple[str, ...]] = frozenset(),
    ) -> Node | None:
        """The directory ``directory`` names, made when missing if ``create``; None when it is not there.

        Refuses to go through a symlink: an entry under one would land wherever
        it points. A symlink the layer replaces with a directory (``replaced``)
        has nothing below it for a whiteout to hide: the walk ends there.
        """
        node = self.root
        for depth, part in enumerate(directory):
            child = node.children.get(part)
            if child is None:
                if not create:
                    return None
                child = Node("dir", 0o755, 0, 0, mtime, names=1)
                node.children[part] = child
            elif child.kind == "symlink":
                if directory[: depth + 1] in replaced:
                    return None
                through = "/".join(directory[: depth + 1])
                raise self._refuse(name, f"would be written through the symlink {through!r}")
            elif child.kind != "dir":
                if not create:
                    return None
                where = "/".join(directory[: depth + 1])
                raise self._refuse(
                    name, f"needs {where!r} to be a directory, but an earlier entry made it {_KIND_NAMES[child.kind]}"
                )
            node = child
        return node

    def _whiteout(self, whiteout: _Whiteout, replaced: frozenset[tuple[str, ...]]) -> None:
        directory = self._walk(whiteout.name, whiteout.directory, create=False, replaced=replaced)
        if directory is None:
            return  # nothing below to hide
        if whiteout.hidden is None:
            for child in directory.children.values():
                self._unbind(child)
            directory.children.clear()
            return
        hidden = directory.children.pop(whiteout.hidden, None)
        if hidden is not None:
            self._unbind(hidden)

    def _apply(self, entry: _Entry) -> None:
        if not entry.parts:
            if entry.kind != "dir":
                raise self._refuse(entry.name, f"replaces the image root with {_KIND_NAMES.get(entry.kind, 'a link')}")
            self._set_metadata(self.root, entry)
            return
        parent = self._walk(entry.name, entry.parts[:-1], create=True, mtime=entry.mtime)
        assert parent is not None  # made when missing
        name = entry.parts[-1]
        existing = parent.children.get(name)
        if entry.kind == "link":
            node = self._link_target(entry)
            if node is existing:
                return
        elif entry.kind == "dir" and existing is not None and existing.kind == "dir":
            self._set_metadata(existing, entry)  # a directory over a directory keeps its contents
            return
        else:
            node = Node(
                entry.kind,
                entry.mode,
                entry.uid,
                entry.gid,
                entry.mtime,
                entry.xattrs,
                size=entry.size,
                blob=entry.blob,
                target=entry.target,
                device=entry.device,
            )
        if existing is not None:
            self._unbind(existing)
        parent.children[name] = node
        node.names += 1

    def _link_target(self, entry: _Entry) -> Node:
        shown = entry.target
        directory = self._walk(entry.name, entry.link[:-1], create=False)
        target = directory.children.get(entry.link[-1]) if directory is not None else None
        if target is None:
            raise self._refuse(entry.name, f"is a hard link to {shown!r}, which no earlier entry created")
        if target.kind == "dir":
            raise self._refuse(entry.name, f"is a hard link to the directory {shown!r}")
        return target

    @staticmethod
    def _set_metadata(node: Node, entry: _Entry) -> None:
        node.mode, node.uid, node.gid, node.mtime, node.xattrs = (
            entry.mode,
            entry.uid,
            entry.gid,
            entry.mtime,
            entry.xattrs,
        )

    @staticmethod
    def _unbind(node: Node) -> None:
        """Take one name from ``node`` (a whole subtree for a directory); content nobody names any more is deleted."""
        stack = [node]
        while stack:
            current = stack.pop()
            current.names -= 1
            if current.kind == "dir":
                stack.extend(current.children.values())
                current.children = {}
            elif current.names == 0 and current.blob is not None:
                current.blob.unlink(missing_ok=True)
                current.blob = None


def _round4(size: int) -> int:
    return (size + 3) & ~3


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:200]


def no_space_text(folder: Path, doing: str) -> str:
    """The one line for a full filesystem: which folder, and what to do."""
    return (
        f"no space left in {folder} while {doing}: free space there (forkd image prune removes unused "
        "layers and disks) or set FORKD_CACHE_DIR to a folder with more room, and try again"
    )


# ---------------------------------------------------------------------------------------------- decompression


@contextlib.contextmanager
def _decompressed(path: Path) -> Iterator[IO[bytes]]:
    """The tar stream of the layer blob at ``path``: its magic bytes say how it is compressed."""
    with open(path, "rb") as raw:
        magic = raw.read(6)
        raw.seek(0)
        if magic.startswith(b"\x1f\x8b"):
            with gzip.GzipFile(fileobj=raw, mode="rb") as unzipped:
                yield unzipped  # type: ignore[misc]  # a GzipFile is a binary stream
        elif magic.startswith(ZSTD_MAGIC):
            with _zstd_decompressed(path) as unzstd:
                yield unzstd
        elif magic.startswith(b"BZh"):
            with bz2.BZ2File(raw) as unbzipped:
                yield unbzipped
        elif magic.startswith(b"\xfd7zXZ\x00"):
            with lzma.LZMAFile(raw) as unxzed:
                yield unxzed
        else:
            yield raw


@contextlib.contextmanager
def _zstd_decompressed(path: Path) -> Iterator[IO[bytes]]:
    """A zstd blob decompressed by the ``zstd`` tool, else the ``zstandard`` module (as snapshot archives are).

    The standard library has no zstd before Python 3.14.
    """
    if shutil.which("zstd"):
        with tempfile.TemporaryFile() as errors:
            process = subprocess.Popen(
                ["zstd", "-q", "-d", "-c", "--", str(path)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=errors,
            )
            assert process.stdout is not None
            try:
                yield process.stdout
                while process.stdout.read(READ_CHUNK):
                    pass  # the rest (after the tar's end) must still decompress
            except BaseException:
                process.kill()
                raise
            finally:
                process.stdout.close()
                status = process.wait()
            if status != 0:
                errors.seek(0)
                said = " ".join(errors.read().decode(errors="replace").split())[-200:]
                raise EOFError(f"zstd says {said or f'exit status {status}'}")
        return
    zstandard = _zstandard()
    if zstandard is None:
        raise ImageToolMissing(
            f"{path.name} is a zstd layer and neither the zstd tool nor the zstandard module is available; "
            "install one (`sudo apt-get install zstd`, or `pip install 'pytest-forkd[archive]'`)"
        )
    with open(path, "rb") as raw:
        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        try:
            yield reader
            while reader.read(READ_CHUNK):
                pass
        except zstandard.ZstdError as exc:
            raise EOFError(f"zstd: {exc}") from None


def _zstandard() -> ModuleType | None:
    try:
        return importlib.import_module("zstandard")
    except ImportError:
        return None
