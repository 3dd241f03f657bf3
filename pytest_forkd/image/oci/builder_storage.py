"""What forkd's Dockerfile builds leave in the builders' own storage, recorded per store, and removing it.

A build leaves its image in the builder's storage, tagged
``localhost/forkd-build/<key>``, and the base images the builder pulled for
it: both stay, so that the builder's layer cache serves the next build of a
changed context. Each build records them in the image store
(:data:`RECORD`: per builder, each tag with its build key, and each base it
saw the builder pull), and ``forkd image prune`` removes exactly those
(:func:`remove_leftovers`): never an image that was there before a build,
nor one another store's builds made (the tests' stores, another user's).
A tag whose build is running (its lock is held) is left for the next prune,
and an image the builder refuses to remove (a container or another image
uses it) stays; what is gone is forgotten.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from filelock import FileLock, Timeout

from ... import private
from .builder_config import builder_environment
from .store import store_dir

__all__ = ["RECORD", "Leftover", "build_lock", "leftovers", "record_pulls", "record_tag", "remove_leftovers"]

#: The record of what this store's builds left in the builders' storage.
RECORD: Final = "builder-images.json"
COMMAND_TIMEOUT: Final = 120


@dataclass(frozen=True)
class Leftover:
    """An image a build of this store left in a builder's storage."""

    builder: str
    image: str
    """``repository:tag`` as the builder lists it."""
    key: str | None = None
    """The build key of a build's own tag; None for a base image it pulled."""


def build_lock(key: str) -> FileLock:
    """The lock a build of ``key`` holds, in every process that builds into this store."""
    folder = private.make_dir(store_dir() / "builds")
    return FileLock(str(folder / f"{key[:32]}.lock"), mode=private.FILE_MODE)


def _record_lock() -> FileLock:
    return FileLock(str(private.make_dir(store_dir()) / f".{RECORD}.lock"), mode=private.FILE_MODE)


def _read() -> dict[str, dict[str, Any]]:
    try:
        document = json.loads((store_dir() / RECORD).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(document, dict):
        return {}
    record: dict[str, dict[str, Any]] = {}
    for builder, entry in document.items():
        if not isinstance(entry, dict):
            continue
        tags = entry.get("tags")
        bases = entry.get("bases")
        tags = tags if isinstance(tags, dict) else {}
        bases = bases if isinstance(bases, list) else []
        record[str(builder)] = {
            "tags": {str(tag): str(key) for tag, key in tags.items()},
            "bases": sorted({str(base) for base in bases if isinstance(base, str)}),
        }
    return record


def _write(record: Mapping[str, Mapping[str, Any]]) -> None:
    folder = private.make_dir(store_dir())
    kept = {builder: entry for builder, entry in record.items() if entry.get("tags") or entry.get("bases")}
    fd, temporary = tempfile.mkstemp(prefix=".builder-images-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(kept, handle, indent=1, sort_keys=True)
        os.replace(temporary, folder / RECORD)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


@contextmanager
def _updating() -> Iterator[dict[str, dict[str, Any]]]:
    with _record_lock():
        record = _read()
        yield record
        _write(record)


def record_tag(builder: str, tag: str, key: str) -> None:
    """Note that a build of ``key`` tags its image ``tag`` in ``builder``'s storage (before it runs)."""
    with _updating() as record:
        entry = record.setdefault(builder, {"tags": {}, "bases": []})
        entry["tags"][tag] = key


def record_pulls(builder: str, images: list[str]) -> None:
    """Note the base images a build made ``builder`` pull."""
    if not images:
        return
    with _updating() as record:
        entry = record.setdefault(builder, {"tags": {}, "bases": []})
        entry["bases"] = sorted({*entry["bases"], *images})


def _image_names(builder: str) -> set[str] | None:
    """The ``repository:tag`` of every image in ``builder``'s storage; None when it cannot say."""
    program = shutil.which(builder)
    if program is None:
        return None
    template = "{{.Name}}:{{.Tag}}" if builder == "buildah" else "{{.Repository}}:{{.Tag}}"
    try:
        listing = subprocess.run(
            [program, "images", "--format", template],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT,
            env=builder_environment(builder),
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if listing.returncode != 0:
        return None
    return {line.strip() for line in listing.stdout.splitlines() if line.strip()}


def _same_image(listed: str, recorded: str) -> bool:
    """Whether a listed ``repository:tag`` is a recorded one (Docker Hub's prefixes spelt or not)."""
    if listed == recorded:
        return True
    short = listed.removeprefix("docker.io/").removeprefix("library/")
    return short == recorded.removeprefix("docker.io/").removeprefix("library/")


def leftovers() -> list[Leftover]:
    """What this store's builds left that is still in the builders' storage (each image once)."""
    found: list[Leftover] = []
    seen: set[str] = set()  # podman and buildah share one storage
    for builder, entry in sorted(_read().items()):
        names = _image_names(builder)
        if names is None:
            continue
        for name in sorted(names):
            key = next((key for tag, key in entry["tags"].items() if _same_image(name, tag)), None)
            if key is None and not any(_same_image(name, base) for base in entry["bases"]):
                continue
            if name not in seen:
                seen.add(name)
                found.append(Leftover(builder, name, key))
    return found


def remove_leftovers(*, dry_run: bool = False) -> list[Leftover]:
    """Remove (or with ``dry_run`` only list) :func:`leftovers`; what could not be removed stays recorded."""
    removed = []
    for leftover in leftovers():
        if dry_run:
            removed.append(leftover)
        elif _remove(leftover):
            removed.append(leftover)
    if not dry_run:
        remaining = [leftover.image for leftover in leftovers()]
        with _updating() as record:
            for entry in record.values():
                entry["tags"] = {
                    tag: key for tag, key in entry["tags"].items() if any(_same_image(n, tag) for n in remaining)
                }
                entry["bases"] = [base for base in entry["bases"] if any(_same_image(n, base) for n in remaining)]
    return removed


def _remove(leftover: Leftover) -> bool:
    lock = build_lock(leftover.key) if leftover.key is not None else None
    if lock is not None:
        try:
            lock.acquire(timeout=0)
        except Timeout:
            return False  # its build is running: the next prune removes it
    try:
        result = subprocess.run(
            [shutil.which(leftover.builder) or leftover.builder, "rmi", leftover.image],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=COMMAND_TIMEOUT,
            env=builder_environment(leftover.builder),
        )
        return result.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
    finally:
        if lock is not None:
            lock.release()
