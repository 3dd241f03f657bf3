"""Where pytest-forkd keeps things on disk.

Persistent artefacts (images, downloaded packages, snapshots, host verdicts)
live under the user cache directory; everything that belongs to one run (RAM
files, sockets, console logs) lives in one run directory on /dev/shm so that a
single ``rm -r`` removes it and a stale one is easy to recognise.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

#: The project file a test suite declares its snapshots, settings and budgets in.
PROJECT_FILE = "forkd.yaml"
#: The built-in snapshot every run starts from unless told otherwise: the default image, booted.
BASE_SNAPSHOT = "base"

TAG_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # use with fullmatch: "$" also matches before a final newline


def validate_tag(tag: object, what: str = "snapshot name") -> str:
    """Return ``tag`` if it is a valid snapshot/image name, else raise InvalidTagError."""
    from .errors import InvalidTagError

    if not isinstance(tag, str) or not TAG_PATTERN.fullmatch(tag):
        if not isinstance(tag, str):
            problem = f"it is a {type(tag).__name__}, not a str"
        elif not tag:
            problem = "it is empty"
        elif len(tag) > 64:
            problem = f"it is {len(tag)} characters long"
        else:
            problem = "it contains " + ", ".join(sorted({repr(c) for c in tag if not re.match(r"[A-Za-z0-9_-]", c)}))
        raise InvalidTagError(f"invalid {what} {tag!r} ({problem}): use 1-64 characters from A-Z a-z 0-9 _ -")
    return tag


def sanitize_tag(text: str) -> str:
    """Turn any text (a test node id, say) into a valid tag."""
    cleaned = re.sub(r"[^A-Za-z0-9_-]+", "_", text).strip("_") or "x"
    return cleaned[:64]


def cache_dir() -> Path:
    """Root of persistent state: ``$FORKD_CACHE_DIR`` or ``$XDG_CACHE_HOME/pytest-forkd``."""
    explicit = os.environ.get("FORKD_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "pytest-forkd"


def images_dir() -> Path:
    return cache_dir() / "images"


def debs_dir() -> Path:
    return cache_dir() / "debs"


def snapshots_dir() -> Path:
    """Default store for persistent snapshots."""
    return Path(os.environ.get("FORKD_STORE") or cache_dir() / "snapshots")


def shm_root() -> Path:
    """Parent of this user's run directories: ``$FORKD_SHM_DIR`` or ``/dev/shm/pytest-forkd-<uid>``.

    One root per user (mode 0700): users on one host never share a directory,
    so a root that another user created first cannot get in anyone's way.
    """
    return Path(os.environ.get("FORKD_SHM_DIR") or f"/dev/shm/pytest-forkd-{os.getuid()}")
