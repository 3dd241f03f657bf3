"""What a snapshot store's writers leave while they work: temporary and trash directories, and their cleanup.

A snapshot is written into ``.tmp-<tag>-<pid>-<host><random>`` and renamed
into place; one being replaced or removed is first renamed to
``.trash-<tag>-<pid>-<host><random>`` and deleted from there (processes that
still map its files keep them alive). A writer that is killed leaves these
behind. The names carry the writer's pid and a token of its host, so
:func:`remove_stale` can tell a leftover of a dead local process from the
live work of a process on another host sharing the store (NFS, a CI cache).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import socket
import time
from pathlib import Path
from typing import Final

from pytest_forkd.processes import is_alive

__all__ = [
    "DEFAULT_STALE_AGE_S",
    "TEMP_PREFIX",
    "TRASH_PREFIX",
    "made_on_this_host",
    "remove_stale",
    "temp_name",
    "trash_name",
    "writer_pid",
]

TEMP_PREFIX: Final = ".tmp-"
TRASH_PREFIX: Final = ".trash-"

# A temporary directory older than this is removed even if a process with its
# writer's pid exists: no write takes that long, so the pid has been reused (or
# the writer ran on another host sharing the store).
DEFAULT_STALE_AGE_S: Final = 6 * 3600.0

# Temporary and trash names end in this host's token: a store shared between hosts (NFS,
# a CI cache) must not take another host's live writer for a dead local pid.
HOST_TOKEN: Final = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _name(prefix: str, tag: str) -> str:
    return f"{prefix}{tag}-{os.getpid()}-{HOST_TOKEN}{secrets.token_hex(4)}"


def temp_name(tag: str) -> str:
    """A fresh name for a directory this process writes snapshot ``tag`` into."""
    return _name(TEMP_PREFIX, tag)


def trash_name(tag: str) -> str:
    """A fresh name for snapshot ``tag``'s directory while this process deletes it."""
    return _name(TRASH_PREFIX, tag)


def writer_pid(directory_name: str) -> int | None:
    """The pid in a ``.tmp-<tag>-<pid>-<random>`` or ``.trash-...`` name, if it parses."""
    parts = directory_name.rsplit("-", 2)
    if len(parts) == 3 and parts[1].isdigit():
        return int(parts[1])
    return None


def made_on_this_host(directory_name: str) -> bool:
    """Whether a temporary or trash directory was made on this host (names without a host token count as local)."""
    suffix = directory_name.rsplit("-", 1)[-1]
    return len(suffix) != len(HOST_TOKEN) + 8 or suffix.startswith(HOST_TOKEN)


def remove_stale(root: Path, max_age_s: float = DEFAULT_STALE_AGE_S) -> list[Path]:
    """Remove the temporary and trash directories in ``root`` left by dead processes; return them.

    A directory goes when the process that created it (its pid is in the
    name) is gone, or when it is older than ``max_age_s`` whatever the pid
    (and only then if its name carries no pid, or another host's token).
    """
    if not root.is_dir():
        return []
    removed = []
    now = time.time()
    for entry in os.scandir(root):
        if not entry.name.startswith((TEMP_PREFIX, TRASH_PREFIX)) or not entry.is_dir(follow_symlinks=False):
            continue
        pid = writer_pid(entry.name)
        try:
            age = now - entry.stat(follow_symlinks=False).st_mtime
        except FileNotFoundError:  # its writer just published or removed it
            continue
        writer_may_be_alive = pid is None or not made_on_this_host(entry.name) or is_alive(pid)
        if writer_may_be_alive and age <= max_age_s:
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(Path(entry.path))
    return removed
