"""The ``diff`` storage backend: only the pages changed since the VM's base.

A VM forked from a snapshot maps that snapshot's flat memory file
copy-on-write, so what it changed since is exactly the private pages of the
mapping. ``PAGEMAP_SCAN`` finds them in well under a millisecond and they are
copied (VM paused) into a sparse file at their guest offsets: the pause grows
with the dirty memory, not with the memory size. Diffs are cumulative against
the flat base (a child restored from a diff holds the diff's pages privately,
so its own diff includes them): there are no chains to walk.

A child of a diff maps the base and has the diff's pages written into it
before its device state is loaded. When a diff grows past
``flatten_fraction`` of the memory size, a flat memory file is written in the
background and attached to the snapshot, so its later children skip the apply
and their own diffs are taken against it.

Because diffs are cumulative, the pause of a VM that keeps branching would
grow with everything it changed since its base. Past ``rebase_mib`` MiB the
branch is taken as a flat file instead (a copy of the base made while the VM
runs, plus the changed pages copied in the pause) and the VM is re-based onto
it: the VMM maps the new file copy-on-write in place of the old base (a remote
``mmap`` while the VM is stopped), so its next diff starts empty. Files that
children map are never written after they are complete.

A root VM (booted, not forked) has no base: a diff branch of it captures its
full memory and says so in ``extra["fallback"]``.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pytest_forkd.engine import memory, remote
from pytest_forkd.errors import BackendError
from pytest_forkd.storage.backend import (
    DIFF_FILE,
    MEMORY_FILE,
    STATE_FILE,
    BackendRegistry,
    Capture,
    CaptureSource,
    StorageBackend,
    hookimpl,
    resolve_base,
)

from .full import capture_flat

if TYPE_CHECKING:
    from pytest_forkd.engine.base import AnyMachine
    from pytest_forkd.storage.snapshot import Snapshot
    from pytest_forkd.storage.store import SnapshotStore

log = logging.getLogger(__name__)

REBASE_MIB = 4
"""Default re-base threshold: the pause copies at most about this much (~0.7 ms per MiB here).

At 4 MiB the changed pages add at most about half of a diff pause's fixed part
(stop, device state, scan, cont: 6-8 ms under TCG); at 8 MiB the pause of ten
successive branches rose 1.6-1.7x between re-bases. A re-base copies the base
file while the VM runs: the branch call takes that much longer, its pause
does not.
"""


def remap_guest_ram(machine: AnyMachine, descriptor: int, memory_file: Path) -> None:
    """Make a *stopped* VM map ``memory_file`` copy-on-write in place of its current RAM mapping.

    ``memory_file`` must hold exactly the VM's memory and be open in the VMM
    as ``descriptor`` (read-only). The VMM is made to ``mmap`` it
    ``MAP_PRIVATE|MAP_FIXED`` over guest RAM (a remote system call): the
    private pages of the old mapping are dropped, so the VM's next diff starts
    from nothing. The file is never written again.
    """
    layout = machine.memory_layout()
    mapped = remote.remote_call_ok(
        layout.pid,
        remote.SYS_MMAP,
        layout.start,
        layout.length,
        remote.PROT_READ | remote.PROT_WRITE,
        remote.MAP_PRIVATE | remote.MAP_FIXED,
        descriptor,
        0,
        what="mapping the new base of guest RAM",
    )
    if mapped != layout.start:
        raise BackendError(
            f"re-basing VM {machine.name}: its VMM mapped the new base at {mapped:#x}, "
            f"not at guest RAM {layout.start:#x}"
        )
    machine.ram_path = memory_file


class DiffBackend(StorageBackend):
    id = "diff"
    description = "pause, copy only pages changed since the base (PAGEMAP_SCAN), resume"

    def __init__(self, flatten_fraction: float = 0.5, rebase_mib: int | None = REBASE_MIB) -> None:
        self.flatten_fraction = flatten_fraction
        self.rebase_mib = rebase_mib
        """Re-base a VM whose changes since its base reach this many MiB (None: never)."""
        self._flatteners: list[threading.Thread] = []

    requires = ("dirty_page_tracking",)

    def capture(self, source: CaptureSource, target: Path) -> Capture:
        machine = source.machine
        base_memory = source.base.memory_path if source.base is not None else None
        if source.base is None or base_memory is None or not self._should_rebase(source):
            return self._capture_diff(source, target)
        memory.copy_sparse(base_memory, target / MEMORY_FILE)  # the new base: a copy made while the VM runs
        descriptor = remote.open_in(machine.pid, target / MEMORY_FILE)
        try:
            started = time.perf_counter()
            machine.stop()
            try:
                machine.save_device_state(target / STATE_FILE)
                written, dirty = capture_flat(source, target, precopied=True)
                remap_guest_ram(machine, descriptor, target / MEMORY_FILE)
            finally:
                machine.resume()
            pause_ms = (time.perf_counter() - started) * 1000
        finally:
            remote.remote_syscall(machine.pid, remote.SYS_CLOSE, descriptor)
        return Capture(
            pause_ms=pause_ms,
            bytes_written=written,
            memory_file=MEMORY_FILE,
            dirty_bytes=dirty,
            remapped=True,
            extra={"rebased": True, "rebased_from": source.base.tag},
        )

    def _should_rebase(self, source: CaptureSource) -> bool:
        """True when the VM changed more than ``rebase_mib`` since its base (scanned while it runs)."""
        machine = source.machine
        # Re-basing replaces the RAM mapping inside the VMM process: only engines that allow it.
        if self.rebase_mib is None or remote.unsupported_reason() is not None or not source.capabilities.memory_remap:
            return False
        layout = machine.memory_layout()
        changed = sum(size for _, size in memory.private_pages(layout.pid, layout.start, layout.length))
        if changed < self.rebase_mib << 20:
            return False
        try:  # re-basing needs remote calls into the VMM: check they work before pausing
            remote.remote_syscall(layout.pid, remote.SYS_GETPID)
        except BackendError as exc:
            log.warning("not re-basing VM %s: %s", machine.name, exc)
            return False
        return True

    def _capture_diff(self, source: CaptureSource, target: Path) -> Capture:
        machine = source.machine
        started = time.perf_counter()
        machine.stop()
        try:
            machine.save_device_state(target / STATE_FILE)
            if source.base is None:
                written, dirty = capture_flat(source, target)
                flat = True
            else:
                layout = machine.memory_layout()
                ranges = memory.private_pages(layout.pid, layout.start, layout.length)
                fd = os.open(target / DIFF_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.ftruncate(fd, layout.length)
                    written = dirty = memory.copy_out(layout.pid, layout.start, ranges, fd)
                finally:
                    os.close(fd)
                flat = False
        finally:
            machine.resume()
        pause_ms = (time.perf_counter() - started) * 1000
        if flat or source.base is None:
            return Capture(
                pause_ms=pause_ms,
                bytes_written=written,
                memory_file=MEMORY_FILE,
                dirty_bytes=dirty,
                extra={"fallback": "root VM has no base: captured its full memory"},
            )
        return Capture(
            pause_ms=pause_ms,
            bytes_written=written,
            diff_file=DIFF_FILE,
            base=source.base.tag,
            dirty_bytes=dirty,
            extra={"base_dir": str(source.base.path), "ranges": len(ranges)},
        )

    def prepare_child(self, snapshot: Snapshot, machine: AnyMachine, store: SnapshotStore) -> None:
        if snapshot.memory_path is not None or snapshot.diff_path is None:
            return  # flat (or flattened) memory: nothing to apply
        fd = os.open(snapshot.diff_path, os.O_RDONLY)
        try:
            layout = machine.memory_layout()
            memory.copy_in(layout.pid, layout.start, fd, memory.data_extents(fd))
        finally:
            os.close(fd)

    def published(self, snapshot: Snapshot, store: SnapshotStore) -> None:
        if snapshot.diff_path is None or snapshot.memory_path is not None:
            return
        if (snapshot.dirty_bytes or 0) <= self.flatten_fraction * snapshot.memory_mib * (1 << 20):
            return
        thread = threading.Thread(
            target=self._flatten, args=(snapshot, store), name=f"flatten-{snapshot.tag}", daemon=True
        )
        thread.start()
        self._flatteners = [t for t in self._flatteners if t.is_alive()] + [thread]

    def _flatten(self, snapshot: Snapshot, store: SnapshotStore) -> None:
        """Write base + diff into a new flat file and attach it to ``snapshot``."""
        base = resolve_base(snapshot, store)
        scratch = store.scratch_dir(snapshot.tag)
        flat = scratch / MEMORY_FILE
        try:
            if base.memory_path is None or snapshot.diff_path is None:  # published() saw a diff
                raise BackendError(f"base {base.tag!r} of diff snapshot {snapshot.tag!r} has no flat memory file")
            memory.copy_sparse(base.memory_path, flat)
            src = os.open(snapshot.diff_path, os.O_RDONLY)
            dst = os.open(flat, os.O_WRONLY)
            try:
                memory.copy_extents(src, dst, memory.data_extents(src))
            finally:
                os.close(src)
                os.close(dst)
            store.attach_memory(snapshot.tag, flat, MEMORY_FILE)
        except Exception:  # noqa: BLE001 - flattening is an optimisation; children still apply the diff
            log.exception("flattening diff snapshot %s failed", snapshot.tag)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def wait_flattened(self, timeout: float | None = None) -> None:
        """Wait for background flattening (tests and orderly shutdown)."""
        for thread in list(self._flatteners):
            thread.join(timeout)


@hookimpl
def forkd_register_backends(registry: BackendRegistry) -> None:
    registry.add(DiffBackend())
