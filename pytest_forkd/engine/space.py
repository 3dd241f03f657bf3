"""Room on the filesystems that hold guest memory and snapshots, and what to say when it runs out.

A guest's RAM is a file that QEMU maps shared: the filesystem holding it
(tmpfs under /dev/shm by default) must have room for every page the guest
touches. When it has none, the kernel does not fail a write; it kills QEMU
with SIGBUS (exit status -7), and the guest's last words say nothing about
why. Containers make this common: Docker, GitLab's Docker executor and
GitHub's ``container:`` jobs give /dev/shm 64 MiB. So the room is checked
before a VM starts, a SIGBUS death is reported as what it is, and a write
that fails with ENOSPC or EDQUOT becomes an error naming the filesystem,
its free space and the fix. The filesystem facts and the classifier of such
writes are the foundation's (:mod:`pytest_forkd.filesystems`, shared with the
image store and the tools it runs); this module adds what guest memory and
the snapshot store need on top: the room check before a start, QEMU's SIGBUS
death, and the snapshot store's fix.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from ..errors import HostNotReady
from ..filesystems import (
    MIB,
    NO_SPACE_ERRNOS,
    Filesystem,
    existing_ancestor,
    filesystem_of,
    is_no_space,
)
from ..filesystems import no_space_text as _no_space_text

__all__ = [
    "MIB",
    "NO_SPACE_ERRNOS",
    "RUNTIME_FIX",
    "STORE_HINT",
    "Filesystem",
    "check_room",
    "exit_text",
    "existing_ancestor",
    "filesystem_of",
    "is_no_space",
    "killed_by_sigbus",
    "no_space_text",
    "room_problem",
]

#: How a container gets a bigger /dev/shm, and the other ways out, as one sentence.
RUNTIME_FIX = (
    "give the container a bigger /dev/shm (docker run --shm-size=2g; GitLab: shm_size in the runner's "
    "[runners.docker]; Kubernetes: an emptyDir with medium Memory), set FORKD_SHM_DIR to a directory "
    "with more room, or give the VM less memory (memory_mib)"
)


def room_problem(directory: str | os.PathLike[str], need: int, what: str) -> str | None:
    """One line saying that ``directory``'s filesystem has less than ``need`` bytes free for ``what``, or None."""
    try:
        filesystem = filesystem_of(directory)
    except OSError:
        return None  # unreadable: the start itself reports what is wrong
    if filesystem.free >= need:
        return None
    return f"{what} needs up to {need // MIB} MiB in {directory}, on {filesystem.describe()}: {RUNTIME_FIX}"


def check_room(directory: str | os.PathLike[str], need: int, what: str) -> None:
    """Refuse (HostNotReady, one line) to start ``what`` when ``directory`` has less than ``need`` bytes free."""
    problem = room_problem(directory, need, what)
    if problem:
        raise HostNotReady(problem)


def killed_by_sigbus(returncode: int | None) -> bool:
    """Whether a process ended by SIGBUS (``Popen.returncode`` -7), as QEMU does when its RAM file has no room."""
    return returncode == -signal.SIGBUS


def exit_text(returncode: int | None, ram_path: str | os.PathLike[str] | None) -> str:
    """How QEMU ended, in words: ``status 1``, or the SIGBUS death with the filesystem that ran out and the fix."""
    if not killed_by_sigbus(returncode) or ram_path is None:
        return f"status {returncode}"
    try:
        where = filesystem_of(Path(ram_path).parent).describe()
    except OSError:
        where = f"the filesystem of {Path(ram_path).parent}"
    return (
        f"status {returncode}: QEMU was killed by SIGBUS because the filesystem holding guest RAM "
        f"({ram_path}), {where}, ran out of space; {RUNTIME_FIX}"
    )


#: The fix for a full snapshot store.
STORE_HINT = "free space there (`forkd snapshots rm` removes old snapshots) and try again"


def no_space_text(exc: OSError, where: str | os.PathLike[str], what: str, hint: str = STORE_HINT) -> str:
    """``what`` failed for lack of room in ``where`` (:func:`pytest_forkd.filesystems.no_space_text`), by default
    with the snapshot store's fix."""
    return _no_space_text(exc, where, what, hint)
