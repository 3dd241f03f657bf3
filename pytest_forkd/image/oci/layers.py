"""A container image's layers applied in order into one merged tree, refusing hostile entries, with bounded work.

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
- A parent that is a symlink inside the root is followed, as containerd and
  umoci do (``lib -> usr/lib``, then ``lib/hello.txt`` lands in
  ``usr/lib``); whiteouts and hard link targets are resolved the same way.
  Absolute targets are read from the image root. See :mod:`.tree`.
- Hard links name an entry of the same or an earlier layer; symlinks are kept
  verbatim.
- Modes (setuid, setgid, sticky included), numeric owners (names are ignored),
  mtimes (to the second), extended attributes (PAX ``SCHILY.xattr.*``,
  ``security.capability`` included), device nodes and fifos are kept.

Nothing is extracted on the host: the merge happens on a model (path ->
:class:`Node`), and only file contents are written, each to a numbered file
in the build's own directory, never under a name taken from the layer. So a
hostile layer cannot write anywhere, and is refused with
:class:`HostileLayer`, which names the layer and the entry: a ``..``
component, a symlinked parent whose target climbs out of the root or loops, a
hard link out of the root or to nothing, a NUL or a line break in a name
(the disk writer, debugfs, reads its commands by line), a GNU sparse entry
(no image builder writes one), and sizes or counts beyond the limits below. A
leading ``/`` or ``./`` is dropped, as the spec allows.

Bounded work, whatever the input: every decompressed byte is counted. File
contents count against :data:`MAX_TOTAL_BYTES`; everything else (headers,
extended headers, padding, data of other entries, bytes after the tar's end)
against :data:`MAX_METADATA_BYTES`. Extended headers are refused before they
are read when they are bigger than :data:`MAX_HEADER_BYTES` or take the image
past :data:`MAX_PAX_BYTES`, and a sparse entry before its map is read
(:mod:`.tarfile_door`). A layer is read as a stream, once: its entries and
whiteouts wait for their turn in two files of the build directory, not in
memory, so memory grows with the merged tree only (about 400 bytes an entry).
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import lzma
import os
import pickle
import tarfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, BinaryIO, Final, Literal, NamedTuple, Protocol, cast

from ... import zstdio
from ...errors import HostileLayer, ImageError, ImageToolMissing, LayerError
from . import store
from .tarfile_door import HeaderLimits, Refused, entries, open_stream
from .tree import KIND_NAMES, Kind, MergedTree, Node, Resolver, Unresolvable

__all__ = [
    "MAX_ENTRIES",
    "MAX_HEADER_BYTES",
    "MAX_METADATA_BYTES",
    "MAX_NAME_BYTES",
    "MAX_PATH_BYTES",
    "MAX_PAX_BYTES",
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
#: Decompressed bytes besides file contents an image's layers may hold, all together: headers (512 bytes an
#: entry), extended headers, padding, data attached to other entries, and bytes after a tar's end.
MAX_METADATA_BYTES: Final = 2 << 30
#: Bytes of a symlink's target: what one ext4 block holds.
MAX_TARGET_BYTES: Final = 4095
#: Bytes of one PAX or GNU long-name header (tarfile reads it into memory whole): several times what the longest
#: path, link target and largest extended attributes forkd accepts take.
MAX_HEADER_BYTES: Final = 64 << 10
#: Bytes of PAX headers an image may have, all layers together: tarfile parses them record by record, at a few
#: MB/s for the shortest records, while an image's long names (its usual PAX records) take ~150 bytes an entry.
MAX_PAX_BYTES: Final = 64 << 20
#: Bytes of one layer's global PAX headers (tarfile copies them into every entry after them).
MAX_GLOBAL_HEADER_BYTES: Final = 1024
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

READ_CHUNK: Final = 1 << 20
#: tarfile's read buffer in stream mode: it copies what is left of it on every read, so it stays small.
TAR_BUFFER: Final = 16 << 10
#: The files a layer's entries and whiteouts wait in (not numbers: content files are numbered).
_SPILLS: Final = ("layer-entries", "layer-whiteouts")

Progress = Callable[[str], None]

_KINDS: Final[dict[bytes, Kind]] = {
    tarfile.REGTYPE: "file",
    tarfile.AREGTYPE: "file",
    tarfile.CONTTYPE: "file",
    tarfile.DIRTYPE: "dir",
    tarfile.SYMTYPE: "symlink",
    tarfile.CHRTYPE: "char",
    tarfile.BLKTYPE: "block",
    tarfile.FIFOTYPE: "fifo",
}


class LayerBlob(Protocol):
    """What flattening needs of a pulled layer (``store.Layer`` has it)."""

    @property
    def digest(self) -> str: ...

    @property
    def media_type(self) -> str: ...

    @property
    def size(self) -> int: ...

    @property
    def path(self) -> Path: ...


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


# ---------------------------------------------------------------------------------------------- records


class _Entry(NamedTuple):
    """One tar entry, read and checked, waiting (in a file) to be applied."""

    name: str  # as the tar has it, for messages
    parts: tuple[str, ...]
    kind: Kind | Literal["link"]
    mode: int
    uid: int
    gid: int
    mtime: int
    xattrs: tuple[tuple[str, bytes], ...] = ()
    size: int = 0
    blob: str | None = None
    target: str = ""  # a symlink's target; a hard link's as written, for messages
    link: tuple[str, ...] = ()  # a hard link's target
    device: tuple[int, int] = (0, 0)


class _Whiteout(NamedTuple):
    """``.wh.NAME`` (``hidden`` is NAME) or ``.wh..wh..opq`` (``hidden`` is None) in directory ``directory``."""

    name: str
    directory: tuple[str, ...]
    hidden: str | None


class _Spill:
    """Records written one after another to a file, read back in order: a layer's entries wait here, not in RAM."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.out: BinaryIO = open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), "wb")

    def add(self, record: tuple[Any, ...]) -> None:
        self.out.write(pickle.dumps(tuple(record), protocol=pickle.HIGHEST_PROTOCOL))

    def replay(self) -> Iterator[tuple[Any, ...]]:
        self.out.close()
        with open(self.path, "rb", buffering=READ_CHUNK) as reader:
            while True:
                try:
                    record: tuple[Any, ...] = pickle.load(reader)  # noqa: S301 - our own file, written just now
                except EOFError:
                    return
                yield record

    def remove(self) -> None:
        self.out.close()
        self.path.unlink(missing_ok=True)


class _Counted:
    """The decompressed layer, every byte counted against the image's limits as tarfile reads it."""

    def __init__(self, raw: IO[bytes], merger: _Merger) -> None:
        self.raw = raw
        self.merger = merger

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size if size >= 0 else READ_CHUNK)
        self.merger.count(len(data))
        return data


# ---------------------------------------------------------------------------------------------- merging


class _Merger:
    """The merged tree being built, layer by layer, and the counters the limits apply to."""

    def __init__(self, workdir: Path, folder: Path) -> None:
        self.root = Node.directory()
        self.root.names = 1
        self.resolver = Resolver(self.root, max_path_bytes=MAX_PATH_BYTES)
        self.blobs = workdir
        self.folder = folder
        self.entries = 0
        self.content = 0  # bytes of file content, all layers
        self.streamed = 0  # decompressed bytes, all layers
        self.limits = HeaderLimits(
            header_bytes=MAX_HEADER_BYTES, global_bytes=MAX_GLOBAL_HEADER_BYTES, pax_bytes_left=MAX_PAX_BYTES
        )
        self.label = ""

    def count(self, size: int) -> None:
        """``size`` more decompressed bytes; past the metadata limit (a read's worth of slack) the image is refused."""
        self.streamed += size
        if self.streamed - self.content > MAX_METADATA_BYTES + READ_CHUNK:
            raise HostileLayer(
                f"layer {self.label} takes the image past the {MAX_METADATA_BYTES >> 20:,} MiB of decompressed "
                "tar data besides file contents (headers, extended headers, padding, data of other entries, bytes "
                "after the end) an image may have; the image is refused"
            )

    # -- one layer

    def apply_layer(self, layer: LayerBlob) -> None:
        self.label = short_digest(layer.digest)
        if "tar" not in layer.media_type:
            raise LayerError(
                f"layer {self.label} has media type {layer.media_type!r}, not a tar layer; forkd reads "
                "uncompressed, gzip and zstd tar layers (encrypted or foreign layers are not supported)"
            )
        spills: list[_Spill] = []
        try:
            try:
                spills = [_Spill(self.blobs / name) for name in _SPILLS]
            except OSError as exc:
                raise self._write_failure(exc) from None
            waiting, whiteouts = spills
            replaced = self._read_layer(layer, waiting, whiteouts)
            for record in whiteouts.replay():
                self._whiteout(_Whiteout._make(record), replaced)
            for record in waiting.replay():
                self._apply(_Entry._make(record))
        finally:
            for spill in spills:
                spill.remove()

    def _read_layer(self, layer: LayerBlob, waiting: _Spill, whiteouts: _Spill) -> frozenset[tuple[str, ...]]:
        """Read and check every entry of ``layer`` into the spills; the symlinks it replaces with directories."""
        replaced: set[tuple[str, ...]] = set()
        try:
            with _decompressed(layer.path, self.label) as raw:
                counted = _Counted(raw, self)
                with open_stream(cast(IO[bytes], counted), limits=self.limits, bufsize=TAR_BUFFER) as tar:
                    for member in entries(tar):
                        read = self._read(member, tar)
                        try:
                            if isinstance(read, _Whiteout):
                                whiteouts.add(read)
                            elif read is not None:
                                waiting.add(read)
                        except OSError as exc:
                            raise self._write_failure(exc) from None
                        if isinstance(read, _Entry) and read.kind == "dir" and self._is_symlink(read.parts):
                            replaced.add(read.parts)
                while counted.read(READ_CHUNK):
                    pass  # the rest (after the tar's end) must still decompress, and counts
        except Refused as refused:
            raise self._refuse(refused.name, refused.problem) from None
        # gzip.BadGzipFile and bz2's errors are OSErrors; a failed content write is an ImageError instead.
        except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, OSError, _Damaged) as exc:
            raise LayerError(
                f"layer {self.label} is not a readable tar stream ({_reason(exc)}); "
                f"delete {layer.path} and pull the image again"
            ) from None
        return frozenset(replaced)

    def _is_symlink(self, parts: tuple[str, ...]) -> bool:
        """Whether the tree below this layer has a symlink at ``parts`` itself (through real directories only)."""
        node = self.root
        for part in parts:
            child = node.children.get(part) if node.children is not None else None
            if child is None:
                return False
            node = child
        return node.kind == "symlink"

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
        mode, uid, gid, mtime, xattrs = self._metadata(member)
        if member.islnk():
            link = member.linkname
            if "\x00" in link:
                raise self._refuse(name, f"is a hard link whose target {link!r} contains a NUL byte")
            linked = self._parts(name, link, what=f"is a hard link to {link!r}, which")
            if not linked:
                raise self._refuse(name, "is a hard link to the image root")
            return _Entry(name, parts, "link", mode, uid, gid, mtime, xattrs, target=link, link=linked)
        kind = _KINDS.get(member.type)
        if kind is None:
            raise self._refuse(name, f"has the tar type {member.type!r}, which no image needs")
        if kind == "file":
            blob = self._store(name, member, tar) if member.size else None
            return _Entry(name, parts, kind, mode, uid, gid, mtime, xattrs, size=member.size, blob=blob)
        if kind == "symlink":
            target = member.linkname
            if not target:
                raise self._refuse(name, "is a symlink with an empty target")
            if "\x00" in target:
                raise self._refuse(name, "is a symlink whose target contains a NUL byte")
            if len(os.fsencode(target)) > MAX_TARGET_BYTES:
                raise self._refuse(name, f"is a symlink whose target is longer than {MAX_TARGET_BYTES} bytes")
            return _Entry(name, parts, kind, mode, uid, gid, mtime, xattrs, target=target)
        if kind in ("char", "block"):
            major, minor = member.devmajor, member.devminor
            if not (0 <= major < 1 << 12 and 0 <= minor < 1 << 20):
                raise self._refuse(name, f"is a device {major}:{minor}, beyond Linux's device numbers")
            return _Entry(name, parts, kind, mode, uid, gid, mtime, xattrs, device=(major, minor))
        return _Entry(name, parts, kind, mode, uid, gid, mtime, xattrs)

    def _parts(self, name: str, path: str, what: str = "") -> tuple[str, ...]:
        """``path`` as components, a leading ``/`` or ``./`` dropped; escaping or absurd paths refused."""
        if "\x00" in path:
            raise self._refuse(name, "contains a NUL byte")
        if "\n" in path or "\r" in path:
            raise self._refuse(name, "has a line break in its name, which the disk writer (debugfs) cannot express")
        if len(os.fsencode(path)) > MAX_PATH_BYTES:
            raise self._refuse(name, f"has a path longer than {MAX_PATH_BYTES} bytes")
        parts = tuple(part for part in path.split("/") if part not in ("", "."))
        if ".." in parts:
            raise self._refuse(name, f"{what} escapes the image root" if what else "escapes the image root")
        if any(len(os.fsencode(part)) > MAX_NAME_BYTES for part in parts):
            raise self._refuse(name, f"has a name longer than {MAX_NAME_BYTES} bytes")
        return parts

    def _metadata(self, member: tarfile.TarInfo) -> tuple[int, int, int, int, tuple[tuple[str, bytes], ...]]:
        """Mode, owner, mtime and the kept extended attributes of ``member``."""
        if not (0 <= member.uid <= MAX_ID and 0 <= member.gid <= MAX_ID):
            raise self._refuse(member.name, f"has the owner {member.uid}:{member.gid}, beyond Linux's ids")
        xattrs: list[tuple[str, bytes]] = []
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
            xattrs.append((attribute, value.encode("utf-8", "surrogateescape")))
        room = sum(16 + _round4(len(os.fsencode(key))) + _round4(len(value)) for key, value in xattrs)
        if room > MAX_XATTR_BYTES:
            raise self._refuse(member.name, "has extended attributes that do not fit one 4 KiB ext4 block")
        mtime = min(max(int(member.mtime), 0), 2**32 - 1)
        return member.mode & 0o7777, member.uid, member.gid, mtime, tuple(sorted(xattrs))

    def _store(self, name: str, member: tarfile.TarInfo, tar: tarfile.TarFile) -> str:
        """Copy a regular file's content to a numbered file of the build directory."""
        self.content += member.size
        if self.content > MAX_TOTAL_BYTES:
            raise self._refuse(name, f"takes the image past the {MAX_TOTAL_BYTES >> 30} GiB of files it may hold")
        source = tar.extractfile(member)
        assert source is not None  # a regular file
        blob = os.path.join(self.blobs, str(self.entries))
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
        doing = f"unpacking layer {self.label}"
        return store.unwritable_error(exc, self.folder, doing) or ImageError(
            f"{doing} into {self.folder} failed: {exc.strerror or exc}"
        )

    # -- applying

    def _resolve(
        self,
        name: str,
        directory: tuple[str, ...],
        *,
        create: bool,
        mtime: int = 0,
        replaced: frozenset[tuple[str, ...]] = frozenset(),
    ) -> tuple[Node, tuple[str, ...]] | None:
        try:
            return self.resolver.directory(directory, create=create, mtime=mtime, replaced=replaced)
        except Unresolvable as exc:
            raise self._refuse(name, exc.problem) from None

    def _whiteout(self, whiteout: _Whiteout, replaced: frozenset[tuple[str, ...]]) -> None:
        found = self._resolve(whiteout.name, whiteout.directory, create=False, replaced=replaced)
        if found is None or found[0].children is None:
            return  # nothing below to hide
        children = found[0].children
        if whiteout.hidden is None:
            for child in children.values():
                self._unbind(child)
            children.clear()
        else:
            hidden = children.pop(whiteout.hidden, None)
            if hidden is None:
                return
            self._unbind(hidden)
        self.resolver.changed()

    def _apply(self, entry: _Entry) -> None:
        if not entry.parts:
            if entry.kind != "dir":
                raise self._refuse(entry.name, f"replaces the image root with {KIND_NAMES.get(entry.kind, 'a link')}")
            self._set_metadata(self.root, entry)
            return
        found = self._resolve(entry.name, entry.parts[:-1], create=True, mtime=entry.mtime)
        assert found is not None  # made when missing
        children, where = found[0].children, found[1]
        assert children is not None  # the resolver returns directories only
        name = entry.parts[-1]
        if where != entry.parts[:-1] and len(os.fsencode("/".join((*where, name)))) > MAX_PATH_BYTES:
            raise self._refuse(entry.name, f"resolves to a path longer than {MAX_PATH_BYTES} bytes")
        existing = children.get(name)
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
                children={} if entry.kind == "dir" else None,
            )
        if existing is not None:
            self._unbind(existing)
            self.resolver.changed()
        children[name] = node
        node.names += 1

    def _link_target(self, entry: _Entry) -> Node:
        shown = entry.target
        found = self._resolve(entry.name, entry.link[:-1], create=False)
        target = found[0].entries.get(entry.link[-1]) if found is not None else None
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
            if current.children is not None:
                stack.extend(current.children.values())
                current.children = {}
            elif current.names == 0 and current.blob is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(current.blob)
                current.blob = None


def _round4(size: int) -> int:
    return (size + 3) & ~3


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:200]


# ---------------------------------------------------------------------------------------------- decompression


class _Damaged(Exception):
    """A compressed layer that does not decompress to its end (the zstd tool or module says why)."""


@contextlib.contextmanager
def _decompressed(path: Path, label: str) -> Iterator[IO[bytes]]:
    """The tar stream of the layer blob at ``path``: its magic bytes say how it is compressed."""
    with open(path, "rb") as raw:
        magic = raw.read(6)
        raw.seek(0)
        if magic.startswith(b"\x1f\x8b"):
            with gzip.GzipFile(fileobj=raw, mode="rb") as unzipped:
                yield cast(IO[bytes], unzipped)
        elif zstdio.is_zstd(magic):
            with zstdio.decompressing(path, error=_Damaged, missing=_tool_missing(label)) as unzstd:
                yield unzstd
        elif magic.startswith(b"BZh"):
            with bz2.BZ2File(raw) as unbzipped:
                yield cast(IO[bytes], unbzipped)
        elif magic.startswith(b"\xfd7zXZ\x00"):
            with lzma.LZMAFile(raw) as unxzed:
                yield cast(IO[bytes], unxzed)
        else:
            yield raw


def _tool_missing(label: str) -> Callable[[str], BaseException]:
    def missing(message: str) -> BaseException:
        return ImageToolMissing(f"layer {label}: {message}")

    return missing
