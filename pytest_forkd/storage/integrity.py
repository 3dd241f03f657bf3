"""Checked snapshots: the size and checksum of every stored file, and checking them.

A snapshot is only as good as its files: a memory file truncated by a full
disk, an interrupted copy or a stray ``truncate`` makes QEMU refuse the
restore with a cryptic size error, or worse, restore a guest whose memory is
silently wrong. So every file a snapshot stores is recorded in the snapshot's
metadata (``Snapshot.files``) when it is written::

    {"memory.ram": {"size": 268435456, "checksum": "crc32-1MiB:5f0c...", "mtime_ns": 1764745...}}

and checked before it is used:

- **sizes on every restore**: one ``stat`` per file, microseconds;
- **the full checksum** by ``forkd snapshots verify`` (:func:`verify_snapshot`),
  and on restore whenever a file's modification time differs from the one
  recorded (something wrote to it, or it was copied); a file verified once
  is not read again by the same process while it stays unchanged.

The checksum (``crc32-1MiB``) is zlib's CRC-32 of every 1 MiB block of the
file's content, combined with BLAKE2b over the size and the block CRCs. It
depends on content only, not on how a filesystem allocated it, so a snapshot
copied to another filesystem or host keeps its checksum. Blocks inside a hole
of a sparse file are known to be zeros and are not read, so a mostly empty
256 MiB guest costs little. CRC-32 runs at several GB/s here (BLAKE2b at ~1),
and a checksum guards against damage, not against an attacker who can write
the store (and thus the metadata) anyway.
"""

from __future__ import annotations

import hashlib
import os
import threading
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_forkd.errors import DamagedSnapshot

if TYPE_CHECKING:
    from pytest_forkd.storage.snapshot import Snapshot

ALGORITHM = "crc32-1MiB"
BLOCK = 1 << 20
_ZERO_BLOCK_CRC = zlib.crc32(bytes(BLOCK))

# Files verified in full by this process, by (path, device, inode, size, mtime_ns).
_verified: set[tuple[str, int, int, int, int]] = set()
_verified_lock = threading.Lock()


@dataclass(frozen=True)
class FileRecord:
    """What is recorded of one stored file."""

    size: int
    checksum: str
    mtime_ns: int | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"size": self.size, "checksum": self.checksum}
        if self.mtime_ns is not None:
            data["mtime_ns"] = self.mtime_ns
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FileRecord:
        return cls(size=int(data["size"]), checksum=str(data["checksum"]), mtime_ns=data.get("mtime_ns"))


def checksum(path: Path | str) -> str:
    """The content checksum of file ``path`` (``crc32-1MiB:<hex>``, see the module docstring)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _checksum_fd(fd)
    finally:
        os.close(fd)


def _checksum_fd(fd: int) -> str:
    size = os.fstat(fd).st_size
    extents = _data_extents(fd, size)
    digest = hashlib.blake2b(size.to_bytes(8, "little"), digest_size=16)
    buffer = bytearray(BLOCK)
    view = memoryview(buffer)
    extent = 0
    for start in range(0, size, BLOCK):
        length = min(BLOCK, size - start)
        while extent < len(extents) and extents[extent][0] + extents[extent][1] <= start:
            extent += 1
        has_data = extent < len(extents) and extents[extent][0] < start + length
        if not has_data:
            crc = _ZERO_BLOCK_CRC if length == BLOCK else zlib.crc32(bytes(length))
        else:
            got = os.preadv(fd, [view[:length]], start)
            if got < length:  # shrank while we read it: checksum what is there, it will not match
                view[got:length] = bytes(length - got)
            crc = zlib.crc32(view[:length])
        digest.update(crc.to_bytes(4, "little"))
    return f"{ALGORITHM}:{digest.hexdigest()}"


def _data_extents(fd: int, size: int) -> list[tuple[int, int]]:
    """(offset, length) of a file's data; one extent covering everything where holes are unknown."""
    extents = []
    position = 0
    try:
        while position < size:
            try:
                data = os.lseek(fd, position, os.SEEK_DATA)
            except OSError:  # ENXIO: only a hole is left
                break
            hole = os.lseek(fd, data, os.SEEK_HOLE)
            extents.append((data, hole - data))
            position = hole
    except OSError:  # a filesystem without SEEK_DATA: read it all
        return [(0, size)]
    return extents


def record_file(path: Path | str) -> FileRecord:
    """Size, checksum and modification time of ``path``, as stored in ``Snapshot.files``."""
    path = Path(path)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        status = os.fstat(fd)
        record = FileRecord(size=status.st_size, checksum=_checksum_fd(fd), mtime_ns=status.st_mtime_ns)
    finally:
        os.close(fd)
    _remember_verified(path, status)
    return record


def record_files(directory: Path | str, names: Iterable[str | None]) -> dict[str, dict[str, Any]]:
    """``Snapshot.files`` entries for the files ``names`` (None and missing files are skipped)."""
    directory = Path(directory)
    records: dict[str, dict[str, Any]] = {}
    for name in names:
        if name and name not in records and (directory / name).is_file():
            records[name] = record_file(directory / name).to_json()
    return records


def data_files(snapshot: Snapshot) -> list[str]:
    """The data files a snapshot's record names (device state, memory, diff)."""
    return [name for name in (snapshot.state_file, snapshot.memory_file, snapshot.diff_file) if name]


def problems(snapshot: Snapshot, *, full: bool = False, sizes_only: bool = False) -> list[str]:
    """What is wrong with ``snapshot``'s files, one sentence each; empty when it is intact.

    Always checks that each file exists and has its recorded size (a record
    from before checksums were kept has no sizes: its memory file must then
    at least hold the snapshot's whole guest memory). With ``full`` every checksum is
    recomputed; without, only those of files modified since they were
    recorded and not yet verified by this process; with ``sizes_only`` none
    (what ``forkd snapshots ls`` shows, for the price of a ``stat``).
    """
    if snapshot.status != "ready":
        return []  # a writing snapshot's files are still arriving; a failed one is refused elsewhere
    found: list[str] = []
    memory_bytes = snapshot.memory_mib << 20
    for name in data_files(snapshot):
        path = (snapshot.path / name).absolute()
        try:
            status = os.stat(path)
        except FileNotFoundError:
            found.append(f"{path} is missing")
            continue
        except OSError as exc:
            found.append(f"{path} cannot be read ({exc.strerror})")
            continue
        entry = snapshot.files.get(name)
        if entry is not None and status.st_size != entry["size"]:
            found.append(
                f"{path} is {status.st_size} bytes, its record says {entry['size']}"
                + (" (truncated)" if status.st_size < entry["size"] else "")
            )
            continue
        if entry is None and name in (snapshot.memory_file, snapshot.diff_file) and status.st_size < memory_bytes:
            found.append(
                f"{path} is {status.st_size} bytes, less than the {snapshot.memory_mib} MiB of guest memory (truncated)"
            )
            continue
        if entry is None or sizes_only:
            continue
        changed = entry.get("mtime_ns") != status.st_mtime_ns
        if full or (changed and not _was_verified(path, status)):
            try:
                actual = checksum(path)
            except OSError as exc:
                found.append(f"{path} cannot be read ({exc.strerror})")
                continue
            if actual != entry["checksum"]:
                found.append(
                    f"{path} has checksum {actual}, its record says {entry['checksum']} (its content "
                    "changed after it was stored)"
                )
            else:
                _remember_verified(path, status)
    return found


def verify_snapshot(snapshot: Snapshot, *, full: bool = True, remedy: str | None = None) -> Snapshot:
    """Raise :class:`DamagedSnapshot` unless every file of ``snapshot`` matches its record.

    ``full`` recomputes every checksum (what ``forkd snapshots verify`` does);
    ``full=False`` is the cheap check run on every restore. ``remedy`` is the
    advice the error ends with (the store supplies its ``forkd snapshots rm``
    command). Returns ``snapshot`` so it can be used inline.
    """
    found = problems(snapshot, full=full)
    if found:
        advice = remedy or (
            f"remove it (`forkd snapshots rm {snapshot.tag}`) and take it again; "
            "a snapshot declared in forkd.yaml is rebuilt by the next run"
        )
        raise DamagedSnapshot(
            f"snapshot {snapshot.tag!r} is damaged: {'; '.join(found)}. Fix: {advice}",
            tag=snapshot.tag,
            problems=found,
        )
    return snapshot


def _key(path: Path, status: os.stat_result) -> tuple[str, int, int, int, int]:
    return (str(path.absolute()), status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)


def _was_verified(path: Path, status: os.stat_result) -> bool:
    with _verified_lock:
        return _key(path, status) in _verified


def _remember_verified(path: Path, status: os.stat_result) -> None:
    with _verified_lock:
        _verified.add(_key(path, status))
