"""The ``uffd`` storage backend: a live branch whose pause does not grow with memory.

QEMU's ``background-snapshot`` migration write-protects guest RAM with
userfaultfd and streams it out while the guest runs: a page is copied before
the guest's first write to it, so the stream holds memory exactly as it was
when the branch started. The pause is only the device-state save and the
write-protect setup (~10 ms at 1 GiB on these machines).

The stream is then materialised in the background: a loader QEMU (same machine
arguments, ``-incoming``) reads it into a fresh flat RAM file, which is moved
into the snapshot. Until then the snapshot's status is ``writing`` and forking
it waits.

The device state children load is saved by us with the VM stopped, right
before the migration starts; QEMU's background migration stops the (already
stopped) VM, enables write protection and restarts it itself, so the memory
image and the device state describe the same instant.
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

from pytest_forkd.backend import MEMORY_FILE, STATE_FILE, Capture, CaptureSource, StorageBackend, hookimpl
from pytest_forkd.engine.host import userfaultfd_problem
from pytest_forkd.engine.qemu import Machine
from pytest_forkd.errors import SnapshotError

MIGRATION_TIMEOUT_S = 600.0
_counter = itertools.count(1)


class UffdBackend(StorageBackend):
    id = "uffd"
    description = "live branch: userfaultfd write-protect (QEMU background-snapshot), memory written in background"

    def unavailable_reason(self) -> str | None:
        return userfaultfd_problem()

    def capture(self, source: CaptureSource, target: Path) -> Capture:
        machine = source.machine
        qmp = machine.qmp
        qmp.execute("migrate-set-capabilities", {"capabilities": [
            {"capability": "background-snapshot", "state": True}]})
        qmp.execute("migrate-set-parameters", {"max-bandwidth": 1 << 40})
        stream = machine.directory / f"{machine.name}.bgsnap{next(_counter)}"
        fd = os.open(stream, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        started = time.perf_counter()
        machine.stop()
        try:
            machine.save_device_state(target / STATE_FILE)
            qmp.execute("getfd", {"fdname": "forkd-bgsnap"}, fds=[fd])
            qmp.execute("migrate", {"uri": "fd:forkd-bgsnap"})
        except BaseException:
            os.close(fd)
            stream.unlink(missing_ok=True)
            raise
        os.close(fd)
        try:
            qmp.wait_until(lambda: machine.status() == "running", timeout=60,
                           what="the VM to resume after write protection was set up", interval=0.0002)
        except BaseException:
            stream.unlink(missing_ok=True)
            raise
        pause_ms = (time.perf_counter() - started) * 1000

        def finish(snapshot, store) -> tuple[Path, dict]:
            try:
                _wait_migration(machine)
                scratch = store.scratch_dir(snapshot.tag)
                memory_tmp = scratch / MEMORY_FILE
                _materialise(source, stream, memory_tmp)
                return memory_tmp, {"bytes_written": os.stat(memory_tmp).st_blocks * 512}
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


def _materialise(source: CaptureSource, stream: Path, memory_file: Path) -> None:
    """Load the migration stream into a fresh flat RAM file with a loader QEMU."""
    machine = source.machine
    loader = Machine.launch(machine.spec, machine.directory, f"{machine.name}-loader{next(_counter)}",
                            kernel=source.image.stub_kernel, initrd=source.image.stub_initrd,
                            ram_path=memory_file, share=True, owns_ram=False, incoming=True)
    try:
        loader.load_device_state(stream, timeout=MIGRATION_TIMEOUT_S)
    finally:
        loader.kill()


@hookimpl
def forkd_register_backends(registry) -> None:
    registry.add(UffdBackend())
