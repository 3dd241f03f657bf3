"""The ``full`` storage backend: a flat copy of all guest memory.

Pause, save the device state, copy the VM's whole memory into a new flat file,
resume. The pause grows with memory size (a sparse copy at memory bandwidth),
but children of a full snapshot start from one file with nothing to apply, and
the snapshot stands alone: it can become the base of later diffs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from pytest_forkd.engine import memory
from pytest_forkd.storage.backend import (
    MEMORY_FILE,
    STATE_FILE,
    BackendRegistry,
    Capture,
    CaptureSource,
    StorageBackend,
    hookimpl,
)


def capture_flat(source: CaptureSource, target: Path, *, precopied: bool = False) -> tuple[int, int]:
    """Copy a *stopped* VM's memory into ``target/memory.ram``; returns (bytes written, dirty bytes).

    The VM's RAM file holds its memory, except for the pages a copy-on-write
    child changed: those are private pages of its mapping (in the VMM process
    the engine's memory layout names), copied over the file copy from
    /proc/PID/mem. With ``precopied`` the file copy was made
    before the pause (possible when the RAM file is an immutable snapshot).
    """
    layout = source.machine.memory_layout()
    destination = target / MEMORY_FILE
    written = 0 if precopied else memory.copy_sparse(layout.path, destination)
    ranges = memory.private_pages(layout.pid, layout.start, layout.length)
    if ranges:
        fd = os.open(destination, os.O_WRONLY)
        try:
            dirty = memory.copy_out(layout.pid, layout.start, ranges, fd)
        finally:
            os.close(fd)
    else:
        dirty = 0
    return written + dirty, dirty


class FullBackend(StorageBackend):
    id = "full"
    description = "pause, copy all guest memory to a new flat file, resume"

    def capture(self, source: CaptureSource, target: Path) -> Capture:
        machine = source.machine
        # A child's RAM file is its (immutable) base snapshot: copy it while the
        # VM runs, so the pause only covers the pages the child changed.
        precopied = source.base is not None and not machine.owns_ram
        written = memory.copy_sparse(machine.ram_path, target / MEMORY_FILE) if precopied else 0
        started = time.perf_counter()
        machine.stop()
        try:
            machine.save_device_state(target / STATE_FILE)
            copied, dirty = capture_flat(source, target, precopied=precopied)
        finally:
            machine.resume()
        pause_ms = (time.perf_counter() - started) * 1000
        return Capture(
            pause_ms=pause_ms,
            bytes_written=written + copied,
            memory_file=MEMORY_FILE,
            dirty_bytes=dirty,
            extra={"precopied_base": precopied},
        )


@hookimpl
def forkd_register_backends(registry: BackendRegistry) -> None:
    registry.add(FullBackend())
