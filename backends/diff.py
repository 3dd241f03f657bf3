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

from pytest_forkd.backend import (
    DIFF_FILE,
    MEMORY_FILE,
    STATE_FILE,
    Capture,
    CaptureSource,
    StorageBackend,
    hookimpl,
    resolve_base,
)
from pytest_forkd.engine import memory
from pytest_forkd.engine.host import pagemap_scan_problem

from .full import capture_flat

log = logging.getLogger(__name__)


class DiffBackend(StorageBackend):
    id = "diff"
    description = "pause, copy only pages changed since the base (PAGEMAP_SCAN), resume"

    def __init__(self, flatten_fraction: float = 0.5) -> None:
        self.flatten_fraction = flatten_fraction
        self._flatteners: list[threading.Thread] = []

    def unavailable_reason(self) -> str | None:
        return pagemap_scan_problem()

    def capture(self, source: CaptureSource, target: Path) -> Capture:
        machine = source.machine
        started = time.perf_counter()
        machine.stop()
        try:
            machine.save_device_state(target / STATE_FILE)
            if source.base is None:
                written, dirty = capture_flat(source, target)
                flat = True
            else:
                start, length = machine.ram_mapping()
                ranges = memory.private_pages(machine.pid, start, length)
                fd = os.open(target / DIFF_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    os.ftruncate(fd, length)
                    written = dirty = memory.copy_out(machine.pid, start, ranges, fd)
                finally:
                    os.close(fd)
                flat = False
        finally:
            machine.resume()
        pause_ms = (time.perf_counter() - started) * 1000
        if flat:
            return Capture(pause_ms=pause_ms, bytes_written=written, memory_file=MEMORY_FILE, dirty_bytes=dirty,
                           extra={"fallback": "root VM has no base: captured its full memory"})
        return Capture(pause_ms=pause_ms, bytes_written=written, diff_file=DIFF_FILE, base=source.base.tag,
                       dirty_bytes=dirty, extra={"base_dir": str(source.base.path), "ranges": len(ranges)})

    def prepare_child(self, snapshot, machine, store) -> None:
        if snapshot.memory_path is not None or snapshot.diff_path is None:
            return  # flat (or flattened) memory: nothing to apply
        fd = os.open(snapshot.diff_path, os.O_RDONLY)
        try:
            start, _ = machine.ram_mapping()
            memory.copy_in(machine.pid, start, fd, memory.data_extents(fd))
        finally:
            os.close(fd)

    def published(self, snapshot, store) -> None:
        if snapshot.diff_path is None or snapshot.memory_path is not None:
            return
        if (snapshot.dirty_bytes or 0) <= self.flatten_fraction * snapshot.memory_mib * (1 << 20):
            return
        thread = threading.Thread(target=self._flatten, args=(snapshot, store), name=f"flatten-{snapshot.tag}",
                                  daemon=True)
        thread.start()
        self._flatteners = [t for t in self._flatteners if t.is_alive()] + [thread]

    def _flatten(self, snapshot, store) -> None:
        """Write base + diff into a new flat file and attach it to ``snapshot``."""
        base = resolve_base(snapshot, store)
        scratch = store.scratch_dir(snapshot.tag)
        flat = scratch / MEMORY_FILE
        try:
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
def forkd_register_backends(registry) -> None:
    registry.add(DiffBackend())
