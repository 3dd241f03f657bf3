"""Snapshot lifecycle: per-project names, expiry of kept failures, a size cap for the store.

Names are per project. Two projects that both declare a snapshot ``web``
(or redeclare ``base``) must not overwrite each other's, so a project's
snapshots live in a namespace of the store, a store of its own under
``<store>/.projects/<project id>/``; the id comes from the real path of the
directory holding forkd.yaml (:func:`project_id`). The built-in ``base``
(the same everywhere) and snapshots marked ``shared: true`` live in the store
root, shared by every project, as do snapshots of runs without forkd.yaml.

Kept failures (``failed-<test>``, from ``--forkd-keep-failed``) are a few
hundred MiB each and accumulate; :func:`expire_failed` removes those beyond a
count and older than an age (``keep_failed_count``, ``keep_failed_age``).

With ``store_max_size`` set, :func:`evict` removes the least recently used
*recipe* snapshots (built from forkd.yaml or the built-in ``base``, so the
next run that needs one rebuilds it) until the store fits, and never a
snapshot someone took and tagged (a checkpoint published into the store, a
kept failure) nor one another snapshot depends on. "Used" is when a run last
restored from it: :func:`mark_used` sets the snapshot directory's mtime.

``forkd snapshots gc`` runs both over every namespace of a store.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Final

from pytest_forkd.errors import ConfigError, SnapshotError

# Re-exported: callers name a project's namespace through the lifecycle as before.
from pytest_forkd.storage.namespaces import PROJECTS_DIR as PROJECTS_DIR
from pytest_forkd.storage.namespaces import current_project as current_project
from pytest_forkd.storage.namespaces import namespaces as namespaces
from pytest_forkd.storage.namespaces import project_id as project_id
from pytest_forkd.storage.namespaces import project_store as project_store
from pytest_forkd.storage.snapshot import Snapshot
from pytest_forkd.storage.store import SnapshotStore

#: Prefix of the snapshots ``--forkd-keep-failed`` saves.
FAILED_PREFIX: Final = "failed-"
DEFAULT_KEEP_FAILED_COUNT: Final = 5
DEFAULT_KEEP_FAILED_AGE_S: Final = 7 * 86400.0

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_DURATION_UNITS: Final = {"": 86400.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_SIZE_UNITS: Final = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


# -- parsing the config keys --------------------------------------------------------------------
def parse_age(value: object, where: str) -> float:
    """Seconds from ``7d``, ``12h``, ``30m``, ``90s``, ``2w`` or a bare number of days."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{where}: expected an age such as 7d, 12h or 30m, got {value!r}")
    match = _DURATION.match(str(value))
    if match is None:
        raise ConfigError(f"{where}: expected an age such as 7d, 12h or 30m (a bare number means days), got {value!r}")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2)]


def parse_count(value: object, where: str) -> int:
    """A whole number >= 0 (0 keeps none)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{where}: expected a whole number >= 0, got {value!r}")
    return value


def parse_size(value: object, where: str) -> int | None:
    """Bytes from ``20GiB``, ``500M``, ``1T`` or a bare number of bytes; ``none``/``0`` turns the cap off."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "off")):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{where}: expected a size such as 20GiB or 500MiB, got {value!r}")
    match = _SIZE.match(str(value))
    if match is None:
        raise ConfigError(f"{where}: expected a size such as 20GiB or 500MiB (or none), got {value!r}")
    size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2)[:1].lower()])
    return size or None


# -- namespaces (the store's layout, see pytest_forkd.storage.namespaces) -------------------------


def find_snapshot(root: SnapshotStore, tag: str, project_dir: Path | None = None) -> Snapshot:
    """Snapshot ``tag`` as a run of the project sees it: its own first, then the shared one.

    The project is ``project_dir``, else the one around the working directory;
    UnknownSnapshot (from the store root) when neither has it.
    """
    folder = project_dir or current_project()
    if folder is not None:
        store = project_store(root, folder)
        if store.exists(tag):
            return store.get(tag)
    return root.get(tag)


# -- use and age ------------------------------------------------------------------------------
def mark_used(snapshot: Snapshot) -> None:
    """Record that a run restores from ``snapshot`` now (the directory's mtime; a read-only store stays as is)."""
    try:
        os.utime(snapshot.path)
    except OSError:
        pass


def created_at(snapshot: Snapshot) -> float:
    """When the snapshot was taken, in seconds since the epoch (its directory's mtime if unparsable)."""
    try:
        return datetime.fromisoformat(snapshot.created).timestamp()
    except ValueError:
        return last_used(snapshot)


def last_used(snapshot: Snapshot) -> float:
    """When a run last restored from ``snapshot`` (or it was written), in seconds since the epoch."""
    try:
        return os.stat(snapshot.path).st_mtime
    except OSError:
        return 0.0


def is_recipe_snapshot(snapshot: Snapshot) -> bool:
    """Built from a recipe (forkd.yaml or the built-in ``base``), so it can be rebuilt after eviction."""
    return isinstance(snapshot.extra.get("recipe_hash"), str)


def is_failed_snapshot(snapshot: Snapshot) -> bool:
    """Saved by ``--forkd-keep-failed``."""
    return snapshot.tag.startswith(FAILED_PREFIX) and "failed_test" in snapshot.extra


@dataclass(frozen=True)
class Removal:
    """A snapshot removed (or, in a dry run, that would be) and why."""

    project: str | None
    tag: str
    reason: str
    bytes: int


# -- expiry -----------------------------------------------------------------------------------
def expire_failed(
    store: SnapshotStore,
    *,
    keep: int = DEFAULT_KEEP_FAILED_COUNT,
    max_age_s: float = DEFAULT_KEEP_FAILED_AGE_S,
    now: float | None = None,
    dry_run: bool = False,
    project: str | None = None,
) -> list[Removal]:
    """Remove kept failures of ``store`` beyond the newest ``keep`` and those older than ``max_age_s``."""
    now = time.time() if now is None else now
    failed = sorted(
        (snapshot for snapshot in store.list() if is_failed_snapshot(snapshot)), key=created_at, reverse=True
    )
    removals = []
    for index, snapshot in enumerate(failed):
        age = now - created_at(snapshot)
        if index >= keep:
            reason = f"kept failure beyond the newest {keep} (keep_failed_count)"
        elif age > max_age_s:
            reason = f"kept failure {_age(age)} old, older than {_age(max_age_s)} (keep_failed_age)"
        else:
            continue
        removals += _remove(store, snapshot, reason, project, dry_run)
    return removals


def evict(root: SnapshotStore, max_bytes: int, *, keep: Iterable[Path] = (), dry_run: bool = False) -> list[Removal]:
    """Remove least recently used recipe snapshots of every namespace of ``root`` until it holds ``max_bytes``.

    Snapshots whose directory is in ``keep`` (the ones the calling run
    uses), snapshots whose files a running VM maps (another run's, another
    xdist worker's), snapshots that are not recipe snapshots and snapshots
    others depend on stay.
    """
    kept = {Path(path).resolve() for path in keep}
    mapped = mapped_files()
    entries = []
    total = 0
    for project, store in namespaces(root):
        for snapshot in store.list():
            size = _allocated(store, snapshot.tag)
            total += size
            if (
                is_recipe_snapshot(snapshot)
                and snapshot.path.resolve() not in kept
                and not any(str(snapshot.path.resolve() / name) in mapped for name in _data_files(snapshot))
            ):
                entries.append((last_used(snapshot), project, store, snapshot, size))
    removals: list[Removal] = []
    for _used, project, store, snapshot, size in sorted(entries, key=lambda entry: entry[0]):
        if total <= max_bytes:
            break
        if store.dependents(snapshot.tag):
            continue
        reason = (
            f"least recently used recipe snapshot (last used {_age(time.time() - last_used(snapshot))} ago); "
            f"the store holds more than store_max_size {_human(max_bytes)}; rebuilt when needed"
        )
        removed = _remove(store, snapshot, reason, project, dry_run)
        if removed:
            total -= size
            removals += removed
    return removals


def mapped_files() -> set[str]:
    """Paths of the files that processes of this user map (QEMU maps a snapshot's memory file)."""
    found: set[str] = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/maps", encoding="utf-8", errors="replace") as maps:
                for line in maps:
                    parts = line.split(maxsplit=5)
                    if len(parts) == 6 and parts[5].startswith("/"):
                        found.add(parts[5].rstrip("\n").removesuffix(" (deleted)"))
        except OSError:  # exited meanwhile, or another user's
            continue
    return found


def _data_files(snapshot: Snapshot) -> list[str]:
    return [name for name in (snapshot.memory_file, snapshot.diff_file, snapshot.state_file) if name]


def total_bytes(root: SnapshotStore) -> int:
    """Bytes allocated by every snapshot of every namespace of the store at ``root``."""
    return sum(_allocated(store, snapshot.tag) for _project, store in namespaces(root) for snapshot in store.list())


def gc(
    root: SnapshotStore,
    *,
    keep_failed: int = DEFAULT_KEEP_FAILED_COUNT,
    keep_failed_age_s: float = DEFAULT_KEEP_FAILED_AGE_S,
    max_bytes: int | None = None,
    dry_run: bool = False,
) -> list[Removal]:
    """``forkd snapshots gc``: expire kept failures in every namespace, then apply the size cap."""
    removals = []
    for project, store in namespaces(root):
        removals += expire_failed(
            store, keep=keep_failed, max_age_s=keep_failed_age_s, dry_run=dry_run, project=project
        )
    if max_bytes is not None:
        removals += evict(root, max_bytes, dry_run=dry_run)
    return removals


def _remove(store: SnapshotStore, snapshot: Snapshot, reason: str, project: str | None, dry_run: bool) -> list[Removal]:
    size = _allocated(store, snapshot.tag)
    if dry_run:
        return [Removal(project, snapshot.tag, reason, size)]
    try:
        store.remove(snapshot.tag)
    except SnapshotError:  # others depend on it, removed meanwhile, or a read-only store: leave it
        return []
    return [Removal(project, snapshot.tag, reason, size)]


def _allocated(store: SnapshotStore, tag: str) -> int:
    try:
        return store.disk_usage(tag).allocated_bytes
    except SnapshotError:
        return 0


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, length in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= length:
            return f"{seconds / length:.1f}{unit}"
    return f"{math.floor(seconds)}s"


def _human(count: int) -> str:
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def describe_age(seconds: float) -> str:
    """``3.2d``, ``5.0h``, ``12m`` or ``40s``: for ``forkd snapshots ls``."""
    return _age(seconds)
