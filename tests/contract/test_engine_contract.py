"""The engine contract: what forkd's core needs from any engine, checked on the fake engine and on QEMU."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest
from engine_support import home, qemu_checked_by, read

from pytest_forkd.core.factory import VMFactory
from pytest_forkd.core.vm import VM
from pytest_forkd.engine.base import Capabilities, Engine, Machine, MemoryLayout, capability_names
from pytest_forkd.errors import BackendError, GuestCrashed, VMError
from pytest_forkd.storage.snapshot import Snapshot
from pytest_forkd.storage.store import SnapshotStore


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def backends_for(factory: VMFactory) -> list[str]:
    capabilities = factory.engine.capabilities()
    return [
        b.id for b in factory.runtime.backends if b.id in ("full", "diff") and capabilities.missing(b.requires) is None
    ]


# -- the interface itself ------------------------------------------------------------------
def test_the_engine_and_its_machines_implement_the_protocols(factory: VMFactory, vm: VM) -> None:
    assert isinstance(factory.engine, Engine)
    assert isinstance(vm.machine, Machine)
    capabilities = factory.engine.capabilities()
    assert isinstance(capabilities, Capabilities) and capabilities.incoming_restore
    assert capabilities.engine == factory.engine.name
    for name in capability_names():
        assert capabilities.has(name) in (True, False)
        if not capabilities.has(name):
            assert capabilities.missing([name])  # says why
    assert factory.engine.describe()["engine"] == factory.engine.name


def test_a_restored_child_maps_its_snapshot_copy_on_write(vm: VM, base: Snapshot) -> None:
    layout = vm.machine.memory_layout()
    assert isinstance(layout, MemoryLayout)
    assert layout.path == base.memory_path and not layout.shared
    assert layout.length == base.memory_mib << 20 and layout.start > 0
    assert os.path.exists(f"/proc/{layout.pid}/mem")


def test_stop_freezes_the_guest_and_resume_lets_it_go_on(vm: VM, tmp_path: Path) -> None:
    machine = vm.machine
    assert machine.alive() and machine.status() == "running"
    machine.stop()
    try:
        assert machine.status() != "running"
        state = tmp_path / "state.bin"
        machine.save_device_state(state)
        assert state.stat().st_size > 0 and stat.S_IMODE(state.stat().st_mode) == 0o600
    finally:
        machine.resume()
    assert machine.status() == "running"
    assert vm.exec("echo alive").stdout == "alive\n"


def test_the_agent_channel_speaks_the_wire_protocol(vm: VM) -> None:
    assert isinstance(vm.ping(), dict)
    result = vm.exec(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (result.stdout, result.stderr, result.exit_code) == ("out\n", "err\n", 3)
    path = f"{home(vm)}/written"
    vm.write_file(path, b"\x00binary\xff", mode=0o640)
    assert vm.read_file(path) == b"\x00binary\xff"
    assert vm.exec(["stat", "-c", "%a", path]).stdout.strip() == "640"


@qemu_checked_by(
    "tests/integration/test_vm_faults.py::test_killed_qemu_is_reported_on_next_use_and_its_sibling_still_works",
    "tests/integration/test_vm_faults.py::test_guest_dying_mid_command_raises_guest_crashed_with_the_console_tail",
)
def test_a_guest_that_dies_is_reported_with_its_console(factory: VMFactory, base: Snapshot) -> None:
    (child,) = base.fork()
    try:
        pid = child.machine.agent_pid if hasattr(child.machine, "agent_pid") else None
        if pid is None:
            child.machine.kill(remove_files=False)
        else:
            os.kill(pid, 9)
        with pytest.raises((GuestCrashed, VMError)):
            child.exec("true")
        assert child.closed
    finally:
        child.close()


# -- forks, branches, restores -------------------------------------------------------------------
@qemu_checked_by(
    "tests/integration/test_snapshots.py::test_children_of_a_branch_are_isolated_from_each_other_and_the_source",
    "tests/integration/test_snapshots.py::test_forks_requested_from_several_threads_at_once_all_succeed",
)
def test_children_start_from_the_snapshot_and_are_isolated(base: Snapshot) -> None:
    first, second = base.fork(2)
    try:
        assert read(first, "marker") == read(second, "marker") == "from-base\n"
        first.exec(["sh", "-c", "echo first > marker"])
        assert read(second, "marker") == "from-base\n"
        assert first.origin is not None and first.origin.tag == base.tag
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("backend", ["full", "diff"])
def test_a_branch_keeps_the_state_of_its_pause(factory: VMFactory, vm: VM, backend: str) -> None:
    if backend not in backends_for(factory):
        pytest.skip(f"{backend} backend unavailable: {factory.runtime.backends.get(backend).unavailable_reason()}")
    vm.exec(["sh", "-c", "echo one > counter"])
    snapshot = vm.branch(backend=backend)
    vm.exec(["sh", "-c", "echo two > counter"])
    (child,) = snapshot.fork()
    try:
        assert read(child, "counter") == "one\n" and read(vm, "counter") == "two\n"
        assert snapshot.backend == backend and snapshot.is_ready
        if backend == "diff":
            assert snapshot.base == vm.memory_base.tag and 0 < snapshot.dirty_bytes < snapshot.memory_mib << 20
        child.exec(["sh", "-c", "echo three >> counter"])
        (grandchild,) = child.fork(backend=backend)
        try:
            assert read(grandchild, "counter") == "one\nthree\n"
        finally:
            grandchild.close()
    finally:
        child.close()


def test_snapshot_memory_never_changes_while_children_write(factory: VMFactory, base: Snapshot) -> None:
    before = digest(base.memory_path)
    children = base.fork(2)
    try:
        for index, child in enumerate(children):
            child.exec(["sh", "-c", f"head -c 200000 /dev/urandom > noise{index}; echo {index} > marker"])
            child.branch(backend="full")
    finally:
        for child in children:
            child.close()
    assert digest(base.memory_path) == before


@qemu_checked_by("tests/integration/test_snapshots.py::test_restore_in_place_keeps_the_handle_and_rewinds_the_guest")
def test_restore_rewinds_the_guest_in_place(vm: VM) -> None:
    vm.exec(["sh", "-c", "echo before > state"])
    snapshot = vm.branch()
    vm.exec(["sh", "-c", "echo after > state; echo new > extra"])
    machine = vm.machine
    vm.restore(snapshot)
    assert vm.machine is not machine and not machine.alive()  # same handle, a new machine behind it
    assert read(vm, "state") == "before\n" and read(vm, "extra") == "<missing>\n"


@qemu_checked_by(
    "tests/integration/test_snapshots.py::test_checkpoint_rolls_back_on_exit_even_after_an_error",
    "tests/integration/test_snapshots.py::test_checkpoint_keep_keeps_the_changes",
)
def test_a_checkpoint_rolls_back_unless_kept(vm: VM) -> None:
    vm.exec(["sh", "-c", "echo safe > data"])
    with vm.checkpoint() as checkpoint:
        vm.exec(["sh", "-c", "echo damaged > data"])
    assert read(vm, "data") == "safe\n"
    with vm.checkpoint() as checkpoint:
        vm.exec(["sh", "-c", "echo chosen > data"])
        checkpoint.keep()
    assert read(vm, "data") == "chosen\n"
    (alternative,) = checkpoint.fork()
    try:
        assert read(alternative, "data") == "safe\n"
    finally:
        alternative.close()


@qemu_checked_by("tests/integration/test_snapshots.py::test_frozen_root_vm_continues_as_a_child_of_its_snapshot")
def test_a_frozen_root_vm_goes_on_as_a_child_of_its_snapshot(factory: VMFactory, memory_mib: int) -> None:
    root = factory.boot(memory_mib=memory_mib)
    try:
        root.exec(["sh", "-c", "echo root > mine"])
        snapshot = root.freeze("contract-frozen")
        assert root.origin == snapshot and snapshot.extra.get("frozen")
        assert read(root, "mine") == "root\n"
        root.exec(["sh", "-c", "echo later > mine"])
        (child,) = snapshot.fork()
        try:
            assert read(child, "mine") == "root\n"
        finally:
            child.close()
    finally:
        root.close()


def test_the_live_backend_needs_the_live_snapshot_capability(factory: VMFactory, vm: VM) -> None:
    capabilities = factory.engine.capabilities()
    uffd = factory.runtime.backends.get("uffd")
    if capabilities.live_snapshot:
        vm.exec(["sh", "-c", "echo live > state"])
        snapshot = vm.branch(backend="uffd")
        (child,) = snapshot.fork()
        try:
            assert read(child, "state") == "live\n"
        finally:
            child.close()
    else:
        with pytest.raises(BackendError, match="unavailable"):
            vm.branch(backend="uffd")
        assert vm.exec("echo still running").exit_code == 0
        assert capabilities.missing(uffd.requires)


# -- pools and stores ---------------------------------------------------------------------------------
@qemu_checked_by(
    "tests/integration/test_snapshots.py::test_pool_hands_out_prerestored_children_and_drop_kills_the_rest"
)
def test_a_pool_hands_out_prerestored_children(factory: VMFactory, base: Snapshot) -> None:
    pool = factory.pool(base, 1)
    try:
        (child,) = base.fork()
        try:
            assert read(child, "marker") == "from-base\n"
        finally:
            child.close()
        assert factory.pool(base, 1) is pool
    finally:
        factory.drop_pool(base)


def test_a_snapshot_in_a_store_outlives_its_factory(engine_name: str, memory_mib: int, tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "store")
    with _closing(VMFactory(engine=engine_name)) as first:
        root = first.boot(memory_mib=memory_mib)
        root.exec(["sh", "-c", "echo stored > kept"])
        root.freeze("stored", store=store, keep_running=False)
    second = VMFactory(engine=engine_name)
    try:
        snapshot = store.get("stored").with_owner(second)
        store.verify("stored")
        (child,) = snapshot.fork()
        assert read(child, "kept") == "stored\n"
        child.close()
    finally:
        second.close()


class _closing:
    def __init__(self, factory: VMFactory) -> None:
        self.factory = factory

    def __enter__(self) -> VMFactory:
        return self.factory

    def __exit__(self, *exc_info: object) -> None:
        self.factory.close()


def test_closing_the_factory_leaves_nothing_behind(engine_name: str, memory_mib: int) -> None:
    factory = VMFactory(engine=engine_name)
    root = factory.boot(memory_mib=memory_mib)
    snapshot = root.branch(backend="full")
    children = snapshot.fork(2)
    run_dir = factory.run_dir.path
    machines = [root.machine, *(child.machine for child in children)]
    factory.close()
    assert all(not machine.alive() for machine in machines)
    assert not run_dir.exists()
