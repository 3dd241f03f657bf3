"""The ``uffd`` storage backend: a live branch whose pause does not grow with memory.

QEMU's ``background-snapshot`` migration write-protects guest RAM with
userfaultfd and streams it out while the guest runs: a page is copied before
the guest's first write to it, so the stream holds memory exactly as it was
when the branch started. The guest is paused only while QEMU saves the device
state and arms write protection.

The stream is materialised in the background: a loader QEMU (same machine
arguments, ``-incoming``) reads it into a fresh flat RAM file, and the device
state children load is saved from that loader, so memory and devices describe
the same instant. Until then the snapshot's status is ``writing`` and forking
it waits.

The pause is measured the way a guest sees it: the longest gap between
consecutive agent round trips while the branch starts (QEMU's own downtime
figure leaves out work done before its clock starts).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path
from typing import Callable

from pytest_forkd.backend import MEMORY_FILE, STATE_FILE, Capture, CaptureSource, StorageBackend, hookimpl
from pytest_forkd.engine.host import filesystem_type, userfaultfd_problem
from pytest_forkd.engine.qemu import Machine
from pytest_forkd.errors import BackendError, SnapshotError

MIGRATION_TIMEOUT_S = 600.0
_counter = itertools.count(1)


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
        while len(self._replies) < 2 and self._thread.is_alive():
            time.sleep(0.0005)
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
    description = "live branch: userfaultfd write-protect (QEMU background-snapshot), memory written in background"
    requires_tmpfs_memory = True

    def unavailable_reason(self) -> str | None:
        return userfaultfd_problem()

    def capture(self, source: CaptureSource, target: Path) -> Capture:
        machine = source.machine
        filesystem = filesystem_type(machine.ram_path)
        if filesystem != "tmpfs":
            raise BackendError(
                f"the uffd backend cannot branch VM {machine.name}: its memory is a private mapping of "
                f"{machine.ram_path} on {filesystem}, and userfaultfd write-protection covers only anonymous "
                "and tmpfs memory. Fork it from a snapshot on /dev/shm (pytest sessions do this for you; "
                "or use --forkd-store under /dev/shm), or use the diff backend"
            )
        qmp = machine.qmp
        qmp.execute("migrate-set-capabilities", {"capabilities": [
            {"capability": "background-snapshot", "state": True}]})
        qmp.execute("migrate-set-parameters", {"max-bandwidth": 1 << 40})
        stream = machine.directory / f"{machine.name}.bgsnap{next(_counter)}"
        fd = os.open(stream, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        meter = PauseMeter(source.ping)
        started = meter.start()
        try:
            qmp.execute("getfd", {"fdname": "forkd-bgsnap"}, fds=[fd])
            qmp.execute("migrate", {"uri": "fd:forkd-bgsnap"})

            def write_protection_armed() -> bool:
                status = qmp.execute("query-migrate").get("status")
                if status in ("failed", "cancelled"):
                    raise SnapshotError(f"background snapshot of VM {machine.name} {status}")
                return status != "setup" and machine.status() == "running" and meter.replies_since(
                    time.perf_counter() - 0.002) > 0

            qmp.wait_until(write_protection_armed, timeout=120, what="the live branch to start", interval=0.001)
        except BaseException:
            meter.stop(started)
            stream.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        pause_ms = meter.stop(started)

        def finish(snapshot, store) -> tuple[Path, Path, dict]:
            try:
                _wait_migration(machine)
                scratch = store.scratch_dir(snapshot.tag)
                memory_tmp, state_tmp = scratch / MEMORY_FILE, scratch / STATE_FILE
                _materialise(source, stream, memory_tmp, state_tmp)
                return memory_tmp, state_tmp, {"bytes_written": os.stat(memory_tmp).st_blocks * 512}
            finally:
                stream.unlink(missing_ok=True)

        return Capture(pause_ms=pause_ms, bytes_written=0, memory_file=MEMORY_FILE, status="writing",
                       finish=finish, extra={"live": True})


def _wait_migration(machine: Machine) -> None:
    deadline = time.monotonic() + MIGRATION_TIMEOUT_S
    while True:
        info = machine.qmp.execute("query-migrate")
        status = info.get("status")
        if status == "completed":
            return
        if status in ("failed", "cancelled"):
            raise SnapshotError(f"background snapshot of VM {machine.name} {status}: "
                                f"{info.get('error-desc', 'no reason given')}")
        if time.monotonic() > deadline:
            raise SnapshotError(f"background snapshot of VM {machine.name} did not finish in {MIGRATION_TIMEOUT_S} s")
        time.sleep(0.01)


def _materialise(source: CaptureSource, stream: Path, memory_file: Path, state_file: Path) -> None:
    """Load the migration stream into a fresh flat RAM file with a loader QEMU; save its devices."""
    machine = source.machine
    loader = Machine.launch(machine.spec, machine.directory, f"{machine.name}-loader{next(_counter)}",
                            kernel=source.image.stub_kernel, initrd=source.image.stub_initrd,
                            ram_path=memory_file, share=True, owns_ram=False, incoming=True, paused=True)
    try:
        loader.load_device_state(stream, timeout=MIGRATION_TIMEOUT_S)
        loader.save_device_state(state_file)
    finally:
        loader.kill()


@hookimpl
def forkd_register_backends(registry) -> None:
    registry.add(UffdBackend())
