"""The ``uffd`` storage backend: a live branch, whose pause does not grow with memory size.

A child (a VM mapping an immutable snapshot file copy-on-write) is branched by
*pre-copy under asynchronous write-protection* where the host allows it
(Linux 6.7+, ptrace permission on the VMM; see
:mod:`pytest_forkd.engine.writetrack`): while the guest runs, every mapped
page of guest RAM is write-protected with a userfaultfd made inside the VMM,
in the mode where the kernel itself lifts the protection of a page at its
first write, and the pages the child owns (those it changed since its base)
are copied out. The pause then stops the VM, saves the device state, and
copies only the pages written (or first mapped) since the protection, listed
by ``PAGEMAP_SCAN``. No fault handler runs, so nothing the guest does can
wait on this process. The flat memory file (the base plus those pages) is
written in the background from descriptors opened before the pause.

Elsewhere (a root VM, whose RAM file is its own; an older kernel; no ptrace
permission) it uses the engine's ``live_snapshot`` (QEMU: its
``background-snapshot`` migration), which write-protects all of guest RAM and
streams it out while the guest runs; the stream is materialised in the
background (``Machine.materialise``: a loader process reads it into a fresh
flat RAM file and saves the device state children load). Its pause grows with
memory size: QEMU reads every page in and write-protects them all, one
page-table entry each, while the VM is stopped.

QEMU allocates every page it reads on tmpfs: the read before the
write-protection fills the holes of the file the VM maps (its base snapshot's
memory, for a child), and the loader reads each zero page of the stream. When
the snapshot is complete, the zero pages of both files are punched back out
(:func:`~pytest_forkd.engine.memory.punch_zero_pages`, off the pause): the new
snapshot stays as sparse as its content and the base as small as before.

Until the memory is written the snapshot's status is ``writing`` and forking
it waits. The pause is measured the way a guest sees it: the longest gap
between consecutive agent round trips while the branch starts (QEMU's own
downtime figure leaves out work done before its clock starts).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from pytest_forkd.engine import memory
from pytest_forkd.engine.writetrack import WriteTracker, WriteTrackingUnavailable
from pytest_forkd.errors import SnapshotError
from pytest_forkd.storage.backend import (
    MEMORY_FILE,
    STATE_FILE,
    BackendRegistry,
    Capture,
    CaptureSource,
    StorageBackend,
    hookimpl,
)
from pytest_forkd.waiting import poll_until

if TYPE_CHECKING:
    from pytest_forkd.engine.base import MemoryLayout
    from pytest_forkd.storage.snapshot import Snapshot
    from pytest_forkd.storage.store import SnapshotStore

MIGRATION_TIMEOUT_S = 600.0
log = logging.getLogger(__name__)
_counter = itertools.count(1)


class _InFlight:
    """Live snapshots under way per mapped file, so a base is punched only when none reads it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count: dict[Path, int] = {}

    def enter(self, path: Path) -> None:
        with self._lock:
            self._count[path] = self._count.get(path, 0) + 1

    def leave(self, path: Path) -> bool:
        """Forget one; True when it was the last live snapshot of ``path``."""
        with self._lock:
            left = self._count.pop(path) - 1
            if left:
                self._count[path] = left
            return not left


_in_flight = _InFlight()


def _release(base: Path) -> int:
    """Punch the zero pages QEMU's read-in allocated in ``base``; best effort (it may be gone already)."""
    try:
        return memory.punch_zero_pages(base)
    except OSError as exc:
        log.info("could not give back the zero pages of %s: %s", base, exc)
        return 0


def _mapped_base(source: CaptureSource) -> Path | None:
    """The snapshot memory file the VM maps copy-on-write (None for a VM whose RAM file is its own)."""
    base = source.base.memory_path if source.base is not None else None
    if base is None or source.machine.owns_ram or Path(source.machine.ram_path) != Path(base):
        return None
    return Path(base)


class PauseMeter:
    """Pings the guest back to back on a thread; the longest gap between replies is the pause."""

    def __init__(self, ping: Callable[[], object]) -> None:
        self._ping = ping
        self._stop = threading.Event()
        self._replies: list[float] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="forkd-pause-meter", daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._ping()
                self._replies.append(time.perf_counter())
        except BaseException as exc:  # noqa: BLE001 - reported by stop()
            self._error = exc

    def start(self) -> float:
        self._thread.start()
        poll_until(
            lambda: len(self._replies) >= 2 or not self._thread.is_alive(),
            timeout=60,
            interval=0.0005,
            what="the guest agent to answer the pause meter",
        )
        return time.perf_counter()

    def replies_since(self, moment: float) -> int:
        return sum(1 for t in self._replies if t > moment)

    def stop(self, since: float) -> float:
        """Longest gap (ms) between replies, counted from ``since``."""
        self._stop.set()
        self._thread.join(timeout=60)
        if self._error is not None:
            raise SnapshotError(f"the guest stopped answering during a live branch: {self._error}")
        moments = [since] + [t for t in self._replies if t > since]
        return max((b - a) * 1000 for a, b in zip(moments, moments[1:]))


class UffdBackend(StorageBackend):
    id = "uffd"
    description = (
        "live branch: memory copied while the guest runs under userfaultfd write-protection "
        "(the pause copies only what it wrote meanwhile), flat file written in background"
    )
    requires_tmpfs_memory = True
    requires = ("live_snapshot",)

    def __init__(self, precopy: bool = True) -> None:
        self.precopy = precopy
        """Pre-copy children's memory under asynchronous write-tracking where the host allows it
        (False: always the engine's live snapshot, whose pause grows with memory size)."""

    def capture(self, source: CaptureSource, target: Path) -> Capture:
        if self.precopy and _mapped_base(source) is not None:  # a child: pre-copy where the host can
            layout = source.machine.memory_layout()
            tracker = self._tracker(source, layout)
            if tracker is not None:
                return self._capture_precopy(source, target, layout, tracker)
        return self._capture_live_snapshot(source, target)

    def _tracker(self, source: CaptureSource, layout: MemoryLayout) -> WriteTracker | None:
        """Write-tracking of a child's guest RAM, or None where the host cannot (said in the log).

        Only a child qualifies: a root VM's RAM file changes with the guest, so it cannot be copied later.
        """
        try:
            return WriteTracker(layout.pid, layout.start, layout.length)
        except WriteTrackingUnavailable as exc:
            log.info("uffd branch of %s uses the engine's live snapshot: %s", source.machine.name, exc)
            return None

    def _capture_precopy(
        self, source: CaptureSource, target: Path, layout: MemoryLayout, tracker: WriteTracker
    ) -> Capture:
        machine = source.machine
        pages_path = machine.directory / f"{machine.name}.precopy{next(_counter)}"
        with tracker:
            base = os.open(layout.path, os.O_RDONLY | os.O_CLOEXEC)  # immutable: the memory the child maps
            try:
                pages = os.open(pages_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except BaseException:
                os.close(base)
                raise
            return self._precopy(source, target, layout, tracker, base, pages, pages_path)

    def _precopy(
        self,
        source: CaptureSource,
        target: Path,
        layout: MemoryLayout,
        tracker: WriteTracker,
        base: int,
        pages: int,
        pages_path: Path,
    ) -> Capture:
        """Copy the child's own pages into ``pages`` while it runs, then pause and copy what it wrote since."""
        machine = source.machine
        meter = PauseMeter(source.ping)
        started = meter.start()
        try:
            owned = tracker.protect()
            os.ftruncate(pages, layout.length)
            precopied = memory.copy_out(layout.pid, layout.start, owned, pages)
            machine.stop()
            try:
                machine.save_device_state(target / STATE_FILE)
                rewritten = tracker.written()
                in_pause = memory.copy_out(layout.pid, layout.start, rewritten, pages)
            finally:
                machine.resume()
            tracker.close()  # lifting the protection left is part of what the guest sees
        except BaseException:
            os.close(base)
            os.close(pages)
            pages_path.unlink(missing_ok=True)
            try:
                meter.stop(started)
            except SnapshotError as exc:
                log.info("pause meter after a failed uffd branch: %s", exc)
            raise
        pause_ms = meter.stop(started)

        def finish(snapshot: Snapshot, store: SnapshotStore) -> tuple[Path, Path | None, dict[str, Any]]:
            try:
                memory_tmp = store.scratch_dir(snapshot.tag) / MEMORY_FILE
                flat = os.open(memory_tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                try:
                    os.ftruncate(flat, layout.length)
                    memory.copy_extents(base, flat, memory.data_extents(base))
                    memory.copy_extents(pages, flat, memory.data_extents(pages))
                    allocated = os.fstat(flat).st_blocks * 512
                finally:
                    os.close(flat)
                return memory_tmp, None, {"bytes_written": allocated}
            finally:
                os.close(base)
                os.close(pages)
                pages_path.unlink(missing_ok=True)

        return Capture(
            pause_ms=pause_ms,
            bytes_written=0,
            memory_file=MEMORY_FILE,
            dirty_bytes=precopied,
            status="writing",
            finish=finish,
            extra={
                "live": True,
                "method": "precopy",
                "precopied_bytes": precopied,
                "pause_copied_bytes": in_pause,
            },
        )

    def _capture_live_snapshot(self, source: CaptureSource, target: Path) -> Capture:
        machine = source.machine
        stream = machine.directory / f"{machine.name}.bgsnap{next(_counter)}"
        base = _mapped_base(source)
        meter = PauseMeter(source.ping)
        started = meter.start()
        if base is not None:
            _in_flight.enter(base)
        try:
            machine.start_live_snapshot(stream, armed=lambda: meter.replies_since(time.perf_counter() - 0.002) > 0)
        except BaseException:
            meter.stop(started)
            stream.unlink(missing_ok=True)
            if base is not None:
                _in_flight.leave(base)
            raise
        pause_ms = meter.stop(started)

        def finish(snapshot: Snapshot, store: SnapshotStore) -> tuple[Path, Path | None, dict[str, Any]]:
            released = 0
            try:
                try:
                    machine.finish_live_snapshot(MIGRATION_TIMEOUT_S)
                finally:
                    if base is not None and _in_flight.leave(base):
                        released = _release(base)
                scratch = store.scratch_dir(snapshot.tag)
                memory_tmp, state_tmp = scratch / MEMORY_FILE, scratch / STATE_FILE
                machine.materialise(stream, source.image, memory_tmp, state_tmp)
                memory.punch_zero_pages(memory_tmp)  # not published yet: nobody maps it
                return (
                    memory_tmp,
                    state_tmp,
                    {
                        "bytes_written": os.stat(memory_tmp).st_blocks * 512,
                        "extra": {**snapshot.extra, "base_bytes_released": released},
                    },
                )
            finally:
                stream.unlink(missing_ok=True)

        return Capture(
            pause_ms=pause_ms,
            bytes_written=0,
            memory_file=MEMORY_FILE,
            status="writing",
            finish=finish,
            extra={"live": True, "method": "live_snapshot"},
        )


@hookimpl
def forkd_register_backends(registry: BackendRegistry) -> None:
    registry.add(UffdBackend())
