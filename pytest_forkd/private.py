"""Private files: what pytest-forkd stores is readable by its owner only.

Snapshot memory files hold guest RAM, and with it whatever secrets a test put
into a VM; images and snapshot metadata tell what a suite runs. So every
directory of the snapshot store and the image store is created ``0700`` and
every file ``0600``, *at creation* (``mkdir``/``open`` modes, or a narrow
umask around code that creates files it does not open itself): a file is never
created readable by others and narrowed afterwards, which would leave a window
in which another user could open it and keep the descriptor.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600
PRIVATE_UMASK = 0o077

_umask_lock = threading.Lock()
_umask_depth = 0
_umask_saved = 0


def make_dir(path: Path | str, *, parents: bool = True) -> Path:
    """Create directory ``path`` with mode 0700 if missing (its missing parents too); return it.

    An existing directory is left as it is: a store the user shared on purpose
    stays shared. Missing parents are created 0700 as well (``mkdir -p``
    would create them with the umask's mode).
    """
    path = Path(path)
    if path.is_dir():
        return path
    if parents and not path.parent.is_dir():
        make_dir(path.parent, parents=True)
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        if not path.is_dir():
            raise
    return path


def create_file(path: Path | str, *, exclusive: bool = True) -> int:
    """Open a new file ``path`` for writing with mode 0600 and return the descriptor.

    ``exclusive`` refuses an existing file (``O_EXCL``), so a file somebody
    else created with other modes is never adopted.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_EXCL if exclusive else 0)
    return os.open(path, flags, FILE_MODE)


def touch(path: Path | str) -> Path:
    """Create an empty 0600 file for a program (QEMU) that will open and fill it.

    QEMU creates the files it writes with mode 0644 or 0660 minus the umask;
    an existing file keeps its mode when QEMU truncates and writes it.
    """
    os.close(create_file(path))
    return Path(path)


def write_bytes(path: Path | str, data: bytes) -> None:
    """Write ``data`` to a new 0600 file ``path`` (durably: fsync before returning)."""
    fd = create_file(path)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def private_umask() -> Iterator[None]:
    """Run a block with umask 077, for code that creates files through other libraries.

    The umask belongs to the whole process, so nested and concurrent users are
    counted and the previous umask comes back when the last one leaves. Other
    threads creating files meanwhile get narrower modes, never wider ones.
    """
    global _umask_depth, _umask_saved
    with _umask_lock:
        if _umask_depth == 0:
            _umask_saved = os.umask(PRIVATE_UMASK)
        _umask_depth += 1
    try:
        yield
    finally:
        with _umask_lock:
            _umask_depth -= 1
            if _umask_depth == 0:
                os.umask(_umask_saved)


def exposed(root: Path | str) -> list[tuple[Path, str]]:
    """Paths under ``root`` (``root`` included) that give group or others any permission.

    Returns ``(path, mode)`` pairs, e.g. ``(Path(".../memory.ram"), "0o644")``;
    symbolic links are not followed (their own mode means nothing).
    """
    root = Path(root)
    found: list[tuple[Path, str]] = []

    def check(path: Path) -> None:
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:  # removed while we walked
            return
        if not stat.S_ISLNK(mode) and mode & 0o077:
            found.append((path, oct(stat.S_IMODE(mode))))

    if not root.exists():
        return found
    check(root)
    for folder, folders, files in os.walk(root):
        for name in [*folders, *files]:
            check(Path(folder) / name)
    return found
