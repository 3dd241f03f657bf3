"""A writer for the "newc" cpio format, the format Linux unpacks as initramfs.

Written here rather than shelling out to ``cpio`` so the image never depends
on the host's cpio flags, every entry is owned by root whoever builds it, and
device nodes such as /dev/console can be added without creating them on the
host. The archive is left uncompressed: under TCG emulation decompressing it
in the guest costs more than reading the extra bytes.

Format (see the kernel's Documentation/driver-api/early-userspace/buffer-format.rst):
each entry is a 110-byte ASCII header ("070701" and 13 eight-digit hex
fields), the NUL-terminated name padded to a multiple of 4, then the data
padded to a multiple of 4; the archive ends with an entry named TRAILER!!!.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

MAGIC = b"070701"
TRAILER = "TRAILER!!!"
HEADER_SIZE = 110


def _padding(length: int) -> bytes:
    return b"\0" * (-length % 4)


class CpioWriter:
    """Append entries to a newc archive; call :meth:`close` (or use ``with``) to write the trailer.

    Names are relative paths without a leading slash ("usr/bin/python3").
    Hard links are stored as independent copies, which the kernel unpacks
    the same way and which keeps the writer simple.
    """

    def __init__(self, stream: BinaryIO) -> None:
        self._stream = stream
        self._next_inode = 1
        self.bytes_written = 0
        self.entries = 0

    def __enter__(self) -> CpioWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if exc_info[0] is None:
            self.close()

    def _write(self, data: bytes) -> None:
        self._stream.write(data)
        self.bytes_written += len(data)

    def _header(
        self,
        name: str,
        mode: int,
        size: int,
        mtime: int = 0,
        nlink: int = 1,
        rdev: tuple[int, int] = (0, 0),
    ) -> None:
        encoded = name.encode() + b"\0"
        fields = (
            self._next_inode,
            mode,
            0,  # uid: root
            0,  # gid: root
            nlink,
            max(0, mtime),
            size,
            0,  # devmajor
            0,  # devminor
            rdev[0],
            rdev[1],
            len(encoded),
            0,  # check: unused in newc
        )
        self._next_inode += 1
        header = MAGIC + b"".join(b"%08X" % value for value in fields)
        self._write(header + encoded + _padding(HEADER_SIZE + len(encoded)))
        self.entries += 1

    def add_directory(self, name: str, mode: int = 0o755, mtime: int = 0) -> None:
        self._header(name, stat.S_IFDIR | (mode & 0o7777), 0, mtime, nlink=2)

    def add_symlink(self, name: str, target: str, mtime: int = 0) -> None:
        data = target.encode()
        self._header(name, stat.S_IFLNK | 0o777, len(data), mtime)
        self._write(data + _padding(len(data)))

    def add_device(self, name: str, kind: int, major: int, minor: int, mode: int = 0o600) -> None:
        """Add a device node; ``kind`` is ``stat.S_IFCHR`` or ``stat.S_IFBLK``."""
        self._header(name, kind | (mode & 0o7777), 0, rdev=(major, minor))

    def add_bytes(self, name: str, data: bytes, mode: int = 0o644, mtime: int = 0) -> None:
        self._header(name, stat.S_IFREG | (mode & 0o7777), len(data), mtime)
        self._write(data + _padding(len(data)))

    def add_file(self, name: str, source: Path) -> None:
        """Add a regular file, streaming its content from the host."""
        info = source.stat()
        self._header(name, stat.S_IFREG | stat.S_IMODE(info.st_mode), info.st_size, int(info.st_mtime))
        with source.open("rb") as handle:
            copied = 0
            while chunk := handle.read(1 << 20):
                self._stream.write(chunk)
                copied += len(chunk)
        if copied != info.st_size:
            raise OSError(f"{source} changed size while being archived")
        self.bytes_written += copied
        self._write(_padding(copied))

    def add_tree(self, root: Path) -> None:
        """Add everything under ``root`` (not root itself), parents before children, in sorted order."""
        for directory, subdirs, files in os.walk(root):
            subdirs.sort()
            base = Path(directory)
            for entry_name in sorted(subdirs + files):
                path = base / entry_name
                name = path.relative_to(root).as_posix()
                info = path.lstat()
                if stat.S_ISLNK(info.st_mode):
                    self.add_symlink(name, os.readlink(path), int(info.st_mtime))
                elif stat.S_ISDIR(info.st_mode):
                    self.add_directory(name, stat.S_IMODE(info.st_mode), int(info.st_mtime))
                elif stat.S_ISREG(info.st_mode):
                    self.add_file(name, path)
                else:
                    raise ValueError(f"{path}: only files, directories and symlinks can be archived")
            # os.walk does not descend into symlinked directories: good, they are stored as links.

    def close(self) -> None:
        self._header(TRAILER, 0, 0, nlink=1)


def write_empty_archive(path: Path, size: int = 4096) -> None:
    """A valid archive with no entries, zero-padded to ``size`` bytes (the kernel skips the zeros).

    Restored children never boot, but QEMU still needs an initrd to start;
    a tiny one keeps each child's memory footprint small.
    """
    with path.open("wb") as stream:
        writer = CpioWriter(stream)
        writer.close()
        if writer.bytes_written > size:
            raise ValueError(f"an empty archive needs {writer.bytes_written} bytes, more than {size}")
        stream.write(b"\0" * (size - writer.bytes_written))


def read_member(path: Path, name: str) -> bytes:
    """The contents of regular file ``name`` in the newc archive at ``path`` (one this module wrote).

    For tools that reuse a file of a built image (``forkd bench`` takes the
    guest's static busybox from it); raises KeyError when it is not there.
    """
    with path.open("rb") as stream:
        while True:
            header = stream.read(110)
            if len(header) < 110 or header[:6] not in (b"070701", b"070702"):
                raise KeyError(f"{name} is not in {path}")
            fields = [int(header[6 + 8 * index : 14 + 8 * index], 16) for index in range(13)]
            size, name_size = fields[6], fields[11]
            entry = stream.read(name_size)[:-1].decode(errors="replace")
            stream.read(len(_padding(110 + name_size)))
            if entry == "TRAILER!!!":
                raise KeyError(f"{name} is not in {path}")
            data = stream.read(size)
            stream.read(len(_padding(size)))
            if entry == name:
                return data
