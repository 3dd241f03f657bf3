"""The filesystem under a folder, and the one classifier of writes that fail for want of room or of write access.

Every part of forkd that writes files (the snapshot store, the image store and
its disks, layers being unpacked, archives) and every tool it runs to write
them (mke2fs, debugfs, zstd, skopeo) meets the same three failures: the
filesystem is full (ENOSPC), the user's quota is (EDQUOT), or the filesystem
is read-only (EROFS). :func:`unwritable_reason` tells them apart, from an
``OSError`` or from the text a tool printed, and :func:`unwritable_text`
turns one into the single line every error of forkd gives: what failed, the
folder, its filesystem with its free space, and the caller's fix. Anything
else is not this module's to explain (None), and the caller says what it is.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

__all__ = [
    "NO_SPACE_ERRNOS",
    "READ_ONLY_ERRNOS",
    "Filesystem",
    "Remedy",
    "Unwritable",
    "existing_ancestor",
    "filesystem_of",
    "is_no_space",
    "is_read_only",
    "mount_of",
    "no_space_text",
    "unwritable_reason",
    "unwritable_text",
]

MIB: Final = 1 << 20
#: Errors of a write that found no room: the filesystem is full, or the user's quota is.
NO_SPACE_ERRNOS: Final = (errno.ENOSPC, errno.EDQUOT)
#: Errors of a write to a filesystem mounted read-only.
READ_ONLY_ERRNOS: Final = (errno.EROFS,)

Unwritable = Literal["no space", "quota", "read-only"]
_REASONS: Final[dict[int, Unwritable]] = {errno.ENOSPC: "no space", errno.EDQUOT: "quota", errno.EROFS: "read-only"}


@dataclass(frozen=True)
class Filesystem:
    """The filesystem holding a path: where it is mounted, its type, and its room (bytes)."""

    path: Path
    mount_point: str
    type: str
    free: int
    size: int

    def describe(self) -> str:
        """``tmpfs at /dev/shm (12 MiB free of 64 MiB)``."""
        return f"{self.type} at {self.mount_point} ({self.free // MIB} MiB free of {self.size // MIB} MiB)"


@dataclass(frozen=True)
class Remedy:
    """What the user can do about a failed write: make ``room`` (full or over quota), or write ``elsewhere``.

    Each is the end of a sentence: ``"free space there (forkd image prune ...) or set FORKD_CACHE_DIR to a
    folder with more room"``, ``"set FORKD_CACHE_DIR to a writable folder"``.
    """

    room: str
    elsewhere: str


def existing_ancestor(path: str | os.PathLike[str]) -> Path:
    """``path`` or its nearest existing ancestor (a directory not created yet is on its parent's filesystem)."""
    found = Path(os.path.abspath(path))
    while not found.exists() and found != found.parent:
        found = found.parent
    return found


def mount_of(path: str | os.PathLike[str]) -> tuple[str, str]:
    """The mount point holding ``path`` and its filesystem type, from /proc/self/mounts (``unknown`` if unreadable)."""
    target = os.path.realpath(path)
    best, best_type = "/", "unknown"
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount_point = fields[1].replace("\\040", " ")
                inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best):
                    best, best_type = mount_point, fields[2]
    except OSError:
        pass
    return best, best_type


def filesystem_of(path: str | os.PathLike[str]) -> Filesystem:
    """The filesystem that holds (or will hold) ``path``, with its free space for this user."""
    existing = existing_ancestor(path)
    info = os.statvfs(existing)
    mount_point, kind = mount_of(existing)
    return Filesystem(
        path=Path(path),
        mount_point=mount_point,
        type=kind,
        free=info.f_bavail * info.f_frsize,
        size=info.f_blocks * info.f_frsize,
    )


def unwritable_reason(failure: BaseException | int | str) -> Unwritable | None:
    """Why a write failed, when it is for want of room or of write access; None for any other failure.

    ``failure`` is an exception (an ``OSError`` with its errno), an errno, or
    the text a tool printed (``mke2fs``'s "No space left on device", Go's
    lower-case "read-only file system"), matched on the C library's wording.
    """
    if isinstance(failure, str):
        lowered = failure.lower()
        for number, reason in _REASONS.items():
            if os.strerror(number).lower() in lowered:
                return reason
        return None
    if isinstance(failure, int):
        return _REASONS.get(failure)
    if isinstance(failure, OSError) and isinstance(failure.errno, int):
        return _REASONS.get(failure.errno)
    return None


def is_no_space(failure: BaseException | int | str) -> bool:
    """Whether ``failure`` is a write that found no room (ENOSPC, EDQUOT)."""
    return unwritable_reason(failure) in ("no space", "quota")


def is_read_only(failure: BaseException | int | str) -> bool:
    """Whether ``failure`` is a write to a read-only filesystem (EROFS)."""
    return unwritable_reason(failure) == "read-only"


def _where(folder: str | os.PathLike[str]) -> str:
    try:
        return filesystem_of(folder).describe()
    except OSError:
        return "its filesystem"


def unwritable_text(
    failure: BaseException | int | str, folder: str | os.PathLike[str], doing: str, remedy: Remedy
) -> str | None:
    """One line for a write that failed for want of room or write access in ``folder``; None for other failures.

    ``doing`` says what failed (``"unpacking layer sha256:ab12…"``): the line
    is ``"{doing} failed: no space left in {folder}, on ext4 at / (3 MiB free of
    20480 MiB); {remedy.room}"``, or for a read-only filesystem ``"{doing}
    failed: {folder} is on a read-only filesystem (...); {remedy.elsewhere}"``.
    """
    reason = unwritable_reason(failure)
    if reason is None:
        return None
    if reason == "read-only":
        return f"{doing} failed: {folder} is on a read-only filesystem ({_where(folder)}); {remedy.elsewhere}"
    problem = "the disk quota is exhausted" if reason == "quota" else "no space left"
    return f"{doing} failed: {problem} in {folder}, on {_where(folder)}; {remedy.room}"


def no_space_text(exc: OSError, where: str | os.PathLike[str], what: str, hint: str) -> str:
    """``what`` failed for lack of room in ``where``: the filesystem, its free space, the fix (``hint``).

    For a caller that knows ``exc`` is ENOSPC or EDQUOT; a read-only
    filesystem is named as such, with the same ``hint``.
    """
    return unwritable_text(exc, where, what, Remedy(hint, hint)) or f"{what} failed in {where}: {exc}; {hint}"
