"""Reading .deb files without dpkg: the ar container, its data.tar, and unpacking it safely.

A .deb is an ``ar`` archive holding ``debian-binary``, ``control.tar.*`` and
``data.tar.*``; the last one is the package's file tree, compressed with xz
or gzip (read here with the standard library) or zstd (read through the
``zstd`` program, which Debian itself does not use for its archive but
derivatives do). Reading them here, rather than with ``dpkg-deb``, lets a
host without dpkg build a guest image.

Unpacking never writes outside the target root: a package's symlinks are
resolved as if the root were ``/`` (an absolute link such as
``/lib -> usr/lib`` stays inside the tree), and member names with ``..``
are refused.
"""

from __future__ import annotations

import io
import os
import shutil
import stat
import subprocess
import tarfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator, Literal

from ..errors import ImageError

AR_MAGIC = b"!<arch>\n"
AR_HEADER_SIZE = 60
DATA_MEMBER = "data.tar"
# tarfile stream modes by the data member's suffix; zstd is handled with the zstd program.
TAR_MODES: dict[str, Literal["r|", "r|gz", "r|xz", "r|bz2"]] = {"": "r|", ".gz": "r|gz", ".xz": "r|xz", ".bz2": "r|bz2"}
MAX_SYMLINK_HOPS = 40


class _Slice(io.RawIOBase):
    """A read-only window onto ``length`` bytes of an open file, from its current position."""

    def __init__(self, handle: BinaryIO, length: int) -> None:
        self._handle = handle
        self._left = length

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        if self._left <= 0:
            return 0
        view = memoryview(buffer)[: min(len(buffer), self._left)]
        count = self._handle.readinto(view)  # type: ignore[attr-defined]
        self._left -= count or 0
        return count or 0


def ar_members(handle: BinaryIO, where: str) -> Iterator[tuple[str, int]]:
    """Yield (name, size) of each ar member, leaving ``handle`` at the start of its data."""
    if handle.read(len(AR_MAGIC)) != AR_MAGIC:
        raise ImageError(f"{where} is not a Debian package (no ar header); delete it so it is downloaded again")
    position = len(AR_MAGIC)
    while True:
        handle.seek(position)
        header = handle.read(AR_HEADER_SIZE)
        if not header:
            return
        if len(header) != AR_HEADER_SIZE or header[58:60] != b"`\n":
            raise ImageError(f"{where} is truncated or corrupt (bad ar member header); delete it and rebuild")
        name = header[:16].decode("ascii", "replace").strip().rstrip("/")
        try:
            size = int(header[48:58].decode("ascii").strip())
        except ValueError:
            raise ImageError(f"{where} is corrupt (bad ar member size); delete it and rebuild") from None
        yield name, size
        position += AR_HEADER_SIZE + size + (size & 1)


@contextmanager
def data_tar(deb: Path) -> Iterator[tarfile.TarFile]:
    """Stream a package's file archive (its data.tar.*) as a tarfile in stream mode."""
    with deb.open("rb") as handle:
        for name, size in ar_members(handle, deb.name):
            if not name.startswith(DATA_MEMBER):
                continue
            suffix = name[len(DATA_MEMBER) :]
            if suffix == ".zst":
                with _zstd_stream(handle, size, deb) as archive:
                    yield archive
                return
            if suffix not in TAR_MODES:
                raise ImageError(f"{deb.name}: its {name} is in a compression this builder cannot read")
            with tarfile.open(fileobj=io.BufferedReader(_Slice(handle, size)), mode=TAR_MODES[suffix]) as archive:
                yield archive
            return
    raise ImageError(f"{deb.name} has no data.tar member; it is not a Debian binary package")


@contextmanager
def _zstd_stream(handle: BinaryIO, size: int, deb: Path) -> Iterator[tarfile.TarFile]:
    zstd = shutil.which("zstd")
    if zstd is None:
        raise ImageError(
            f"{deb.name} is compressed with zstd and the zstd program is not installed; "
            "install it (apt-get install zstd) and rebuild"
        )
    process = subprocess.Popen([zstd, "-dcq"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert process.stdin is not None and process.stdout is not None
    payload = handle.read(size)

    def feed() -> None:
        try:
            process.stdin.write(payload)  # type: ignore[union-attr]
        except BrokenPipeError:
            pass
        finally:
            process.stdin.close()  # type: ignore[union-attr]

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        with tarfile.open(fileobj=process.stdout, mode="r|") as archive:
            yield archive
    finally:
        process.stdout.close()
        process.kill()
        process.wait()
        feeder.join()


def _member_path(name: str, deb: Path) -> str | None:
    """The member's path relative to the root, or None for the root itself; refuses escapes."""
    cleaned = name.removeprefix("./").lstrip("/")
    parts = [part for part in cleaned.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise ImageError(f"{deb.name} contains the path {name!r}, which points outside the root; refusing it")
    return "/".join(parts) or None


def resolve_in_root(root: Path, relative: str) -> Path:
    """The host path of guest path ``relative``, following symlinks as if ``root`` were ``/``.

    The last component is not followed (it is what gets created or replaced).
    """
    parts = relative.split("/")
    current = root
    hops = 0
    pending = parts[:-1]
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            current = current.parent if current != root else root
            continue
        candidate = current / part
        if candidate.is_symlink():
            hops += 1
            if hops > MAX_SYMLINK_HOPS:
                raise ImageError(f"too many levels of symbolic links under {root} resolving {relative}")
            target = os.readlink(candidate)
            if target.startswith("/"):
                current = root
            pending = [piece for piece in target.split("/") if piece] + pending
            continue
        current = candidate
    return current / parts[-1]


def unpack(deb: Path, root: Path) -> None:
    """Unpack a package's files into ``root`` (no maintainer scripts run, ownership not kept)."""
    hard_links: list[tuple[Path, str]] = []
    with data_tar(deb) as archive:
        for member in archive:
            relative = _member_path(member.name, deb)
            if relative is None:
                continue
            target = resolve_in_root(root, relative)
            mode = stat.S_IMODE(member.mode)
            if member.isdir():
                if target.is_symlink() or target.is_dir():
                    continue  # a merged-/usr link, or a directory another package made
                target.mkdir(parents=True, exist_ok=True)
                target.chmod(mode | 0o700)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.is_symlink() or target.is_file():
                target.unlink()  # a later package's file wins, as with dpkg -x
            elif target.is_dir():
                continue  # a real directory stays (a package's /lib64 link onto the merged-/usr one)
            if member.issym():
                os.symlink(member.linkname, target)
            elif member.islnk():
                hard_links.append((target, member.linkname))
            elif member.isfile():
                source = archive.extractfile(member)
                assert source is not None
                with target.open("wb") as handle:
                    shutil.copyfileobj(source, handle, 1 << 20)
                target.chmod(mode)
            # device nodes and fifos are not part of Debian packages' file trees; skip them
    for target, link_name in hard_links:
        relative = _member_path(link_name, deb)
        source_path = resolve_in_root(root, relative) if relative else None
        if source_path is None or not source_path.is_file():
            raise ImageError(f"{deb.name}: hard link {target.name} points at {link_name}, which it does not contain")
        shutil.copy2(source_path, target)
