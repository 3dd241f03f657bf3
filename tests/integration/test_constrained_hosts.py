"""Small and full filesystems against real QEMU: the runtime directory, the snapshot store, archives.

Containers give /dev/shm 64 MiB, disks fill up. Each test mounts a small
tmpfs of its own (root only: skipped otherwise), fills it the way a real host
would be full, and checks that forkd either works or fails in one line naming
the filesystem and its free space, that a paused VM is always resumed, that
nothing half-written is left, and that the same operation works once there
is room again.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Iterator

import pytest

from pytest_forkd.archives import archive
from pytest_forkd.core import branching
from pytest_forkd.core.factory import VMFactory
from pytest_forkd.engine import rundir, space
from pytest_forkd.errors import ArchiveError, GuestCrashed, HostNotReady, SnapshotError
from pytest_forkd.storage.snapshot import Snapshot
from pytest_forkd.storage.store import SnapshotStore

MIB = 1 << 20


class SmallFs:
    """A tmpfs of ``size_mib`` mounted at ``path``, which :meth:`fill` makes (nearly) full and :meth:`free` empties."""

    def __init__(self, path: Path, size_mib: int) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0700", "tmpfs", str(path)],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
        self.filler = path / "filler"

    def fill(self, leave_mib: int) -> None:
        """Take all but ``leave_mib`` MiB, as other files on a full disk would."""
        free = space.filesystem_of(self.path).free
        with open(self.filler, "ab") as handle:
            os.posix_fallocate(handle.fileno(), 0, os.fstat(handle.fileno()).st_size + free - leave_mib * MIB)

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=False)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A scratch directory with a short path: run directories under it hold Unix sockets (107 bytes at most)."""
    path = Path(tempfile.mkdtemp(prefix="fk-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def small_fs(tmp_path: Path, short_tmp: Path) -> Iterator[type[SmallFs]]:  # unmounted before short_tmp goes
    """Mount small tmpfs filesystems (``small_fs(path, size_mib)``); each is unmounted at the end."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mounted: list[SmallFs] = []

    class Tracked(SmallFs):
        def __init__(self, path: Path, size_mib: int) -> None:
            super().__init__(path, size_mib)
            mounted.append(self)

    yield Tracked
    for filesystem in mounted:
        filesystem.unmount()


def test_a_runtime_directory_too_small_for_guest_ram_is_refused_in_one_line(
    small_fs: type[SmallFs], short_tmp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shm = small_fs(short_tmp / "shm", 64)
    monkeypatch.setenv("FORKD_SHM_DIR", str(shm.path / "forkd"))
    factory = VMFactory()
    try:
        with pytest.raises(HostNotReady) as caught:
            factory.boot()
    finally:
        factory.close()
    message = str(caught.value)
    assert "\n" not in message
    assert f"tmpfs at {shm.path}" in message and "MiB free of 64 MiB" in message
    assert "--shm-size" in message and "FORKD_SHM_DIR" in message and "memory_mib" in message
    assert list(shm.path.iterdir()) == []  # the run directory went with the factory


def test_doctor_flags_a_small_runtime_filesystem_with_the_fix(
    small_fs: type[SmallFs], short_tmp: Path, tmp_path: Path
) -> None:
    shm = small_fs(short_tmp / "shm", 64)
    result = subprocess.run(
        [sys.executable, "-m", "pytest_forkd.cli", "doctor"],
        env={**os.environ, "FORKD_SHM_DIR": str(shm.path / "forkd")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1, result.stdout
    line = next(line for line in result.stdout.splitlines() if "runtime space" in line)
    assert line.startswith("[FAIL]") and f"tmpfs at {shm.path} (64 MiB free of 64 MiB)" in line
    fix = result.stdout.splitlines()[result.stdout.splitlines().index(line) + 1]
    assert "--shm-size" in fix and "FORKD_SHM_DIR" in fix


def test_a_small_default_runtime_directory_falls_back_to_one_with_room_and_the_guest_can_use_its_memory(
    small_fs: type[SmallFs], short_tmp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/dev/shm as a container has it (64 MiB): run directories go elsewhere, with one warning."""
    shm = small_fs(short_tmp / "shm", 64)
    fallback = short_tmp / "fallback"
    monkeypatch.delenv("FORKD_SHM_DIR", raising=False)
    monkeypatch.setattr(rundir, "shm_root", lambda: shm.path / "pytest-forkd")
    monkeypatch.setattr(rundir, "fallback_roots", lambda: [fallback])
    factory = VMFactory()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            vm = factory.boot()
        said = [str(w.message) for w in caught if issubclass(w.category, rundir.RuntimeSpaceWarning)]
        assert len(said) == 1 and str(fallback) in said[0] and "--shm-size" in said[0]
        assert factory.run_dir.path.parent == fallback
        touched = vm.exec(
            ["python3", "-c", "b = bytearray(100 << 20)\nb[::4096] = b'x' * len(b[::4096])\nprint(len(b))"],
            timeout=120,
        )
        assert touched.exit_code == 0 and touched.stdout.strip() == str(100 << 20)
    finally:
        factory.close()
    assert not list(fallback.glob("run-*"))


def test_qemu_killed_by_sigbus_names_the_filesystem_that_ran_out(
    small_fs: type[SmallFs], short_tmp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runtime filesystem fills up after the VM started: the guest's next touch kills QEMU with SIGBUS."""
    shm = small_fs(short_tmp / "shm", 320)
    monkeypatch.setenv("FORKD_SHM_DIR", str(shm.path / "forkd"))
    factory = VMFactory()
    try:
        vm = factory.boot()
        shm.fill(leave_mib=8)
        with pytest.raises(GuestCrashed) as caught:
            vm.exec(["python3", "-c", "b = bytearray(150 << 20)\nb[::4096] = b'x' * len(b[::4096])"], timeout=120)
    finally:
        factory.close()
    message = str(caught.value).splitlines()[0]
    assert "SIGBUS" in message and "status -7" in message
    assert f"tmpfs at {shm.path}" in message and "--shm-size" in message


@pytest.fixture(scope="module")
def writer_vm_factory() -> Iterator[VMFactory]:
    factory = VMFactory()
    yield factory
    factory.close()


def test_freezing_into_a_full_store_fails_naming_it_and_keeps_the_vm_running_then_works_once_freed(
    small_fs: type[SmallFs], tmp_path: Path, writer_vm_factory: VMFactory
) -> None:
    store_fs = small_fs(tmp_path / "store", 400)
    store = SnapshotStore(store_fs.path / "snapshots")
    vm = writer_vm_factory.boot(memory_mib=640)
    try:
        vm.exec("head -c 150000000 /dev/zero | tr '\\0' 'x' > /root/big", check=True, timeout=300)
        allocated = os.stat(vm.machine.ram_path).st_blocks * 512
        assert 150 * MIB < allocated < 390 * MIB  # fits in the empty store, not in a half-full one
        store_fs.fill(leave_mib=allocated // MIB // 2)
        with pytest.raises(SnapshotError) as caught:
            vm.freeze("full-store", store=store, keep_running=True)
        message = str(caught.value)
        assert str(store.root) in message and "no space left" in message and "MiB free of 400 MiB" in message
        assert "resumed" in message
        assert vm.exec("wc -c < /root/big", check=True, timeout=60).stdout.strip() == "150000000"
        assert store.list() == [] and not store.exists("full-store")
        assert sorted(p.name for p in store.root.iterdir()) == []  # no temporary directory left either

        store_fs.free()
        snapshot = vm.freeze("full-store", store=store, keep_running=True)
        assert [s.tag for s in store.list()] == ["full-store"] and snapshot.is_ready
        assert vm.exec("wc -c < /root/big", check=True, timeout=60).stdout.strip() == "150000000"
    finally:
        vm.close()


def test_export_and_import_on_full_filesystems_fail_naming_them_and_leave_nothing(
    small_fs: type[SmallFs], tmp_path: Path, base_snapshot: Snapshot
) -> None:
    target = small_fs(tmp_path / "target", 400)
    target.fill(leave_mib=4)
    destination = target.path / "base.forkd.tar.zst"
    with pytest.raises(ArchiveError) as caught:
        archive.export_snapshot(base_snapshot, destination)
    assert str(target.path) in str(caught.value) and "MiB free of 400 MiB" in str(caught.value)
    assert sorted(p.name for p in target.path.iterdir()) == ["filler"]  # no partial archive
    target.free()
    archive.export_snapshot(base_snapshot, destination)
    assert destination.stat().st_size > 0

    store_fs = small_fs(tmp_path / "store", 400)
    store = SnapshotStore(store_fs.path / "snapshots")
    store_fs.fill(leave_mib=8)
    with pytest.raises(ArchiveError) as imported:
        archive.import_archive(destination, store=store, name="imported")
    assert str(store.root) in str(imported.value) and "MiB free of 400 MiB" in str(imported.value)
    assert store.list() == [] and sorted(p.name for p in store.root.iterdir()) == []
    store_fs.free()
    info = archive.import_archive(destination, store=store, name="imported")
    assert info.snapshot is not None and [s.tag for s in store.list()] == ["imported"]


def test_branching_into_a_full_store_fails_naming_it_and_the_vm_runs_on(
    small_fs: type[SmallFs], tmp_path: Path, base_snapshot: Snapshot
) -> None:
    store_fs = small_fs(tmp_path / "store", 400)
    store = SnapshotStore(store_fs.path / "snapshots")
    vm = base_snapshot.fork(1)[0]
    try:
        vm.exec("echo kept > /root/kept", check=True)
        store_fs.fill(leave_mib=8)
        with pytest.raises(SnapshotError) as caught:
            branching.branch(vm, "full-branch", backend="full", store=store)
        message = str(caught.value)
        assert str(store.root) in message and "no space left" in message and "resumed" in message
        assert vm.exec("cat /root/kept", check=True).stdout == "kept\n"
        assert store.list() == [] and sorted(p.name for p in store.root.iterdir()) == []

        store_fs.free()
        snapshot = branching.branch(vm, "full-branch", backend="full", store=store)
        assert [s.tag for s in store.list()] == ["full-branch"] and snapshot.is_ready
        assert vm.exec("cat /root/kept", check=True).stdout == "kept\n"
    finally:
        vm.close()
