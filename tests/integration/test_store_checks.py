"""Checked, private snapshots and arguments refused before QEMU starts, against real VMs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Iterator

import pytest

from pytest_forkd import private
from pytest_forkd.core import branching
from pytest_forkd.core.factory import VMFactory
from pytest_forkd.core.vm import VM
from pytest_forkd.engine import rundir
from pytest_forkd.engine.qemu import machine as qemu_module
from pytest_forkd.engine.qemu.host import userfaultfd_problem
from pytest_forkd.errors import DamagedSnapshot, InvalidArgument
from pytest_forkd.project.config import Project
from pytest_forkd.project.snapshot_builder import SnapshotBuilder, publish_copy
from pytest_forkd.storage.snapshot import Snapshot
from pytest_forkd.storage.store import SnapshotStore


def qemu_children() -> set[int]:
    """Pids of QEMU processes whose parent is this process."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name, rest = stat.split(") ", 1)
        if "qemu" in name and int(rest.split()[1]) == os.getpid():
            found.add(int(entry.name))
    return found


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Records every QEMU process the engine starts from here on."""
    started: list[Any] = []
    real_spawn = qemu_module.spawn

    def spawn(argv: Any, **kwargs: Any) -> Any:
        started.append(argv)
        return real_spawn(argv, **kwargs)

    monkeypatch.setattr(qemu_module, "spawn", spawn)
    return started


@pytest.fixture
def disk_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SnapshotStore:
    monkeypatch.setenv("FORKD_STORE", str(tmp_path / "default-store"))
    return SnapshotStore(tmp_path / "store")


@pytest.fixture
def fresh_factory() -> Iterator[VMFactory]:
    factory = VMFactory(accel=os.environ.get("PYTEST_FORKD_ACCEL", "auto"))
    yield factory
    factory.close()


def test_no_file_or_directory_of_a_store_is_readable_by_others(
    factory: VMFactory, base_snapshot: Snapshot, disk_store: SnapshotStore
) -> None:
    """Freeze (rename on tmpfs), a copy to disk, full and diff branches: all 0700/0600, whatever the umask."""
    old = os.umask(0o022)
    try:
        root = factory.boot()
        try:
            root.write_file("/root/secret", b"hunter2\n")
            frozen = branching.freeze(root, "frozen", store=disk_store, keep_running=True)  # copied to disk
            root.exec("echo more > /root/more", check=True)
            full = branching.branch(root, "full", backend="full", store=disk_store)
            diff = branching.branch(root, "diff", backend="diff", store=disk_store)
        finally:
            root.close()
        copied = publish_copy(base_snapshot, disk_store, "copied")
    finally:
        os.umask(old)

    assert private.exposed(disk_store.root) == []
    assert private.exposed(factory.session_store.root) == []  # base_snapshot: a RAM file renamed in
    for snapshot in (frozen, full, diff, copied):
        assert set(snapshot.files) >= {snapshot.state_file}
        disk_store.verify(snapshot.tag)
    assert diff.diff_file in diff.files and full.memory_file in full.files


def test_a_truncated_memory_file_gives_a_clear_error_naming_it(
    factory: VMFactory, base_snapshot: Snapshot, disk_store: SnapshotStore, launches: list[Any]
) -> None:
    stored = publish_copy(base_snapshot, disk_store, "cut")
    child = factory.fork_snapshot(stored, 1)[0]  # intact: restores
    child.close()
    os.truncate(stored.memory_path, 64 << 20)
    launches.clear()
    before = qemu_children()

    with pytest.raises(DamagedSnapshot) as caught:
        factory.fork_snapshot(disk_store.get("cut"), 1)

    message = str(caught.value)
    assert (
        "snapshot 'cut'" in message and f"{stored.memory_path} is 67108864 bytes" in message and "truncated" in message
    )
    assert f"forkd snapshots rm cut --store {disk_store.root}" in message
    assert launches == [] and qemu_children() <= before


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"memory_mib": 0}, "memory_mib=0 is too small"),
        ({"memory_mib": -1}, "memory_mib=-1 is too small"),
        ({"memory_mib": 10_000_000}, "more than this host allows"),
        ({"memory_mib": 128}, "too small for image 'default'"),
        ({"vcpus": 0}, "at least 1 vCPU"),
        ({"timeout": -1}, "not a positive number"),
    ],
)
def test_bad_arguments_fail_before_any_qemu_process_starts(
    fresh_factory: VMFactory, launches: list[Any], kwargs: dict[str, Any], message: str
) -> None:
    before = qemu_children()

    with pytest.raises(InvalidArgument, match=message):
        fresh_factory.boot(**kwargs)

    assert launches == [] and qemu_children() <= before


def test_bad_guest_arguments_are_refused_and_the_vm_keeps_working(vm: VM) -> None:
    for call in (
        lambda: vm.exec("true", timeout=-1),
        lambda: vm.exec(""),
        lambda: vm.write_file("rel", b"x"),
        lambda: vm.read_file("/etc/\0passwd"),
        lambda: vm.exec("pwd", cwd="tmp"),
        lambda: vm.branch(""),
        lambda: vm.checkpoint("a b"),
        lambda: vm.fork(0),
    ):
        with pytest.raises(InvalidArgument):
            call()
    assert vm.exec("echo alive").stdout == "alive\n"


def test_a_damaged_recipe_snapshot_is_rebuilt_by_itself(fresh_factory: VMFactory, disk_store: SnapshotStore) -> None:
    lines: list[str] = []
    first = SnapshotBuilder(fresh_factory, disk_store, Project(), progress=lines.append).get("base")
    os.truncate(first.memory_path, 1 << 20)

    again = SnapshotBuilder(fresh_factory, disk_store, Project(), progress=lines.append)
    rebuilt = again.get("base")

    assert [event.action for event in again.events] == ["built"]
    assert any("'base' is damaged" in line and "rebuilding" in line for line in lines)
    assert os.stat(rebuilt.memory_path).st_size == rebuilt.memory_mib << 20
    child = fresh_factory.fork_snapshot(rebuilt, 1)[0]
    assert child.exec("echo ok").stdout == "ok\n"


@pytest.mark.skipif(userfaultfd_problem() is not None, reason=str(userfaultfd_problem()))
def test_a_live_branch_interrupted_by_a_kill_is_cleaned_when_the_store_is_opened(
    base_snapshot: Snapshot, tmp_path: Path
) -> None:
    """A uffd branch publishes 'writing' and completes in the background; kill the process in between."""
    root = Path(base_snapshot.path).parent.parent / f"killed-store-{os.getpid()}"  # on tmpfs, in our run dir
    script = textwrap.dedent(f"""
        import os, signal, sys
        from pytest_forkd.core import branching
        from pytest_forkd.core.factory import VMFactory
        from pytest_forkd.storage.snapshot import Snapshot
        from pytest_forkd.storage.store import SnapshotStore
        factory = VMFactory(accel={os.environ.get("PYTEST_FORKD_ACCEL", "auto")!r})
        vm = factory.fork_snapshot(Snapshot.load_from({str(base_snapshot.path)!r}), 1)[0]
        vm.exec("dd if=/dev/urandom of=/root/x bs=1M count=8", check=True)
        snapshot = branching.branch(vm, "live", backend="uffd", store=SnapshotStore({str(root)!r}))
        print(snapshot.status, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    try:
        writer = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert writer.returncode == -signal.SIGKILL, writer.stderr
        if writer.stdout.strip() != "writing":
            pytest.skip(f"the live branch completed before the kill ({writer.stdout.strip()!r})")
        assert Snapshot.load_from(root / "live").status == "writing"

        store = SnapshotStore(root)
        store.clean_stale_temp()

        assert not store.exists("live") and store.list() == []
        assert [entry for entry in os.listdir(root) if not entry.startswith(".locks")] == []
    finally:
        rundir.clean_stale()  # the killed process's run directory and any QEMU it left
        import shutil

        shutil.rmtree(root, ignore_errors=True)
