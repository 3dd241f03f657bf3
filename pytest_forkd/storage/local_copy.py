"""Snapshots QEMU cannot map where they are: read-only shared stores.

A child maps its snapshot's memory file copy-on-write, but QEMU 7.2 opens
that file read-write even for a private mapping, so a store on a read-only
mount (a shared NFS export, a CI cache mounted read-only) cannot be mapped
directly. Such a snapshot is copied once per owner (a VM factory, see
:class:`LocalCopies`) into a run directory (tmpfs, holes kept; the default
256 MiB snapshot took 86-503 ms here, from a disk store) and its children map
the copy; nothing is ever written into the shared store.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from pytest_forkd.engine import memory
from pytest_forkd.engine.rundir import RunDir, open_run_dir
from pytest_forkd.errors import SnapshotError
from pytest_forkd.paths import sanitize_tag
from pytest_forkd.storage.backend import MEMORY_FILE, resolve_base
from pytest_forkd.storage.snapshot import Snapshot
from pytest_forkd.storage.store import SnapshotStore


def mapped_file(snapshot: Snapshot) -> Path | None:
    """The memory file QEMU maps for a child of ``snapshot``: its own, or its base's for a diff."""
    if snapshot.memory_path is not None:
        return snapshot.memory_path
    return resolve_base(snapshot, SnapshotStore(snapshot.path.parent, clean=False)).memory_path


def unmappable_reason(snapshot: Snapshot) -> str | None:
    """Why QEMU could not map ``snapshot``'s memory where it is (read-only filesystem, no write permission)."""
    path = mapped_file(snapshot)
    if path is None:
        return None
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return f"{path} is on a read-only filesystem"
    except OSError:
        return None  # a missing file is reported by the restore itself
    if not os.access(path, os.W_OK):
        return f"{path} is not writable by this user"
    return None


def write_flat_memory(snapshot: Snapshot, destination: Path) -> None:
    """Write ``snapshot``'s guest memory into the new file ``destination`` as one flat, sparse file.

    A flat snapshot's file is copied; a diff is applied onto a copy of its base.
    """
    if snapshot.memory_path is not None:
        memory.copy_sparse(snapshot.memory_path, destination)
        return
    base = resolve_base(snapshot, SnapshotStore(snapshot.path.parent, clean=False))
    if base.memory_path is None or snapshot.diff_path is None:
        raise SnapshotError(f"snapshot {snapshot.tag!r}: its base {base.tag!r} has no flat memory to copy")
    memory.copy_sparse(base.memory_path, destination)
    source, target = os.open(snapshot.diff_path, os.O_RDONLY), os.open(destination, os.O_WRONLY)
    try:
        memory.copy_extents(source, target, memory.data_extents(source))
    finally:
        os.close(source)
        os.close(target)


def local_copy(snapshot: Snapshot, store: SnapshotStore) -> Snapshot:
    """A flat copy of ``snapshot`` published in ``store`` (the run directory's), for children to map."""
    tag = sanitize_tag(f"{snapshot.tag}-local")
    with store.begin(tag, replace=True) as pending:
        write_flat_memory(snapshot, pending.dir / MEMORY_FILE)
        memory.copy_sparse(snapshot.state_path, pending.dir / snapshot.state_file)
        # Files copied as they are must match their source's record (publish checks); flattened memory is new.
        copied = {snapshot.state_file: snapshot.state_file}
        if snapshot.memory_file is not None:
            copied[MEMORY_FILE] = snapshot.memory_file
        files = {name: snapshot.files[source] for name, source in copied.items() if source in snapshot.files}
        record = snapshot.replace(
            tag=tag,
            path=pending.dir,
            memory_file=MEMORY_FILE,
            diff_file=None,
            base=None,
            owner=None,
            files=files,
            extra={
                **{key: value for key, value in snapshot.extra.items() if key != "base_dir"},
                "copied_from": str(snapshot.path),
            },
        )
        return pending.publish(record)


class LocalCopies:
    """The local copies of one owner (a VM factory): at most one per snapshot, made when first needed.

    Keyed by the snapshot's directory and creation time, so a snapshot
    rebuilt under the same tag is copied again. The copies live in a run
    directory of their own (created with the first copy), which :meth:`close`
    removes with them; the owner closes it after the VMs that map them.
    """

    def __init__(self) -> None:
        self._copies: dict[tuple[Path, str], Snapshot | None] = {}
        self._run_dir: RunDir | None = None
        self._store: SnapshotStore | None = None
        self._lock = threading.Lock()

    def mappable(self, snapshot: Snapshot) -> Snapshot:
        """``snapshot``, or its local copy (made now if this is the first child) when it cannot be mapped in place."""
        with self._lock:
            key = (snapshot.path, snapshot.created)
            if key not in self._copies:
                unmappable = unmappable_reason(snapshot) is not None
                self._copies[key] = local_copy(snapshot, self._copies_store()) if unmappable else None
            copied = self._copies[key]
        return snapshot if copied is None else copied

    def mapped(self, snapshot: Snapshot) -> Snapshot:
        """The record children of ``snapshot`` were restored from so far: its copy if one was made, else itself."""
        with self._lock:
            copied = self._copies.get((snapshot.path, snapshot.created))
        return snapshot if copied is None else copied

    def close(self) -> None:
        """Remove the copies with their run directory (a process still mapping one is killed with it)."""
        with self._lock:
            run_dir, self._run_dir, self._store = self._run_dir, None, None
            self._copies.clear()
        if run_dir is not None:
            run_dir.close()

    def _copies_store(self) -> SnapshotStore:
        if self._store is None:
            self._run_dir = open_run_dir("local copies of snapshots")
            self._store = SnapshotStore(self._run_dir.path / "snapshots", clean=False)
        return self._store
