"""The fake engine and the core logic it makes testable without QEMU: refusals, failures, pools, diffs, trajectories."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_forkd.analysis.trajectory import Trajectory
from pytest_forkd.core.factory import VMFactory
from pytest_forkd.core.pool import MAX_FAILURES, ChildPool
from pytest_forkd.core.vm import VM
from pytest_forkd.engine.base import Capabilities, engine_class, engine_names, make_engine
from pytest_forkd.engine.fake import FakeEngine, FakeMachine, guest_path
from pytest_forkd.engine.memory import pagemap_scan_problem
from pytest_forkd.errors import (
    BackendError,
    ConfigError,
    ExecTimeout,
    HostNotReady,
    IncompatibleSnapshot,
    InvalidArgument,
    NetworkError,
    SnapshotError,
    VMError,
    VMStartError,
)
from pytest_forkd.storage.snapshot import Snapshot
from pytest_forkd.waiting import poll_until

MEMORY_MIB = 64
needs_dirty_tracking = pytest.mark.skipif(pagemap_scan_problem() is not None, reason=str(pagemap_scan_problem()))


@pytest.fixture(scope="module")
def base(factory: VMFactory) -> Snapshot:
    root = factory.boot(memory_mib=MEMORY_MIB)
    root.exec(["sh", "-c", "echo base > marker"])
    return root.freeze("fake-base", keep_running=False)


@pytest.fixture
def vm(base: Snapshot) -> Iterator[VM]:
    (child,) = base.fork()
    yield child
    child.close()


def cat(vm: VM, name: str) -> str:
    return vm.exec(["sh", "-c", f"cat {name} 2>/dev/null || echo missing"]).stdout.strip()


# -- choosing engines ------------------------------------------------------------------------------
def test_engines_are_found_by_name_and_unknown_ones_are_named() -> None:
    assert {"qemu", "fake"} <= set(engine_names())
    assert engine_class("fake") is FakeEngine
    assert isinstance(make_engine("fake"), FakeEngine)
    engine = FakeEngine()
    assert make_engine(engine) is engine
    with pytest.raises(ConfigError, match="unknown engine 'firecracker'.*known engines: .*fake"):
        make_engine("firecracker")


def test_the_default_engine_is_qemu() -> None:
    factory = VMFactory(accel="tcg")
    try:
        assert factory.engine.name == "qemu"
    finally:
        factory.close()


def test_a_missing_vmm_is_named_before_any_image_is_built() -> None:
    built: list[str] = []

    class NoVmm(FakeEngine):
        def unavailable_reason(self) -> str | None:
            return "qemu-system-x86_64 was not found; install it (Debian/Ubuntu package qemu-system-x86)"

        def image(self, name: str, *, progress: Any = None) -> Any:
            built.append(name)
            return super().image(name, progress=progress)

    factory = VMFactory(engine=NoVmm())
    try:
        with pytest.raises(HostNotReady, match="package qemu-system-x86"):
            factory.boot()
        assert built == []  # a first boot would build the image for minutes, then fail on the missing VMM
    finally:
        factory.close()


def test_capabilities_name_what_is_missing_and_refuse_unknown_names() -> None:
    capabilities = FakeEngine().capabilities()
    assert not capabilities.live_snapshot and not capabilities.network and capabilities.incoming_restore
    assert "no live snapshot" in capabilities.missing(["live_snapshot"])
    assert capabilities.missing(["incoming_restore"]) is None
    assert Capabilities(engine="x").missing(["network"]) == "the x engine has no network capability"
    with pytest.raises(ConfigError, match="unknown engine capability 'teleport'"):
        capabilities.has("teleport")


# -- what the fake refuses ----------------------------------------------------------------------------
def test_a_network_is_refused_before_anything_starts(factory: VMFactory, vm: VM) -> None:
    with pytest.raises(NetworkError, match="fake engine has no network"):
        factory.boot(memory_mib=MEMORY_MIB, network="outbound")
    with pytest.raises(NetworkError, match="no network"):
        vm.forward(8000)
    with pytest.raises(NetworkError, match="no host address"):
        _ = vm.host_address
    assert vm.network.mode == "none" and vm.forwards == {} and vm._network_record() is None


def test_the_live_backend_is_refused_and_the_vm_keeps_running(vm: VM) -> None:
    with pytest.raises(BackendError, match="storage backend 'uffd' is unavailable on this host: .*no live snapshot"):
        vm.branch(backend="uffd")
    assert cat(vm, "marker") == "base"
    for method, args in [
        ("start_live_snapshot", (Path("x"), lambda: True)),
        ("finish_live_snapshot", (1.0,)),
        ("materialise", (Path("x"), None, Path("m"), Path("s"))),
    ]:
        with pytest.raises(VMError, match="no live snapshot"):
            getattr(vm.machine, method)(*args)


def test_guest_path_is_inside_the_vm_s_own_directory(vm: VM) -> None:
    path = guest_path(vm, "file")
    vm.write_file(path, b"data")
    assert cat(vm, "file") == "data" and Path(path).read_bytes() == b"data"
    with pytest.raises(InvalidArgument, match="does not run on the fake engine"):
        guest_path(type("Other", (), {"machine": object(), "name": "x"})())


# -- failures -------------------------------------------------------------------------------------------
def test_a_guest_too_large_for_its_memory_fails_the_branch_and_resumes_the_vm(vm: VM) -> None:
    vm.exec(["sh", "-c", f"head -c {MEMORY_MIB + 1}M /dev/zero > big"])
    with pytest.raises(VMError, match="does not fit"):
        vm.branch(backend="full")
    assert vm.machine.status() == "running"
    vm.exec(["rm", "big"])
    assert vm.branch(backend="full").is_ready


def test_a_device_state_from_elsewhere_is_a_start_error(factory: VMFactory, base: Snapshot) -> None:
    (child,) = base.fork()
    snapshot = child.branch(backend="full")
    child.close()
    snapshot.state_path.chmod(0o600)
    snapshot.state_path.write_text(json.dumps({"format": "something else"}))
    copy = Snapshot.load_from(snapshot.path).replace(files={}).with_owner(factory)
    with pytest.raises((VMStartError, SnapshotError), match="fake engine|changed|damaged"):
        copy.fork()


def test_a_snapshot_of_another_engine_is_incompatible(factory: VMFactory, base: Snapshot) -> None:
    foreign = base.replace(fingerprint={**base.fingerprint, "engine": "other", "machine": "0" * 16})
    with pytest.raises(IncompatibleSnapshot):
        factory.fork_snapshot(foreign)


def test_an_exec_past_its_timeout_is_an_exec_timeout(vm: VM) -> None:
    with pytest.raises(ExecTimeout):
        vm.exec(["sleep", "5"], timeout=0.1)
    assert vm.exec("echo ok").stdout == "ok\n"


def test_a_closed_vm_says_so(base: Snapshot) -> None:
    (child,) = base.fork()
    child.close()
    child.close()
    with pytest.raises(VMError, match="closed"):
        child.exec("true")
    assert not child.machine.alive() and child.machine.status() == "shutdown"


# -- defaults, forks, pools -------------------------------------------------------------------------------
def test_exec_defaults_travel_to_children(vm: VM) -> None:
    vm.env = {"FORKD_COLOUR": "blue"}
    vm.cwd = guest_path(vm, "tmp")
    assert vm.exec(["sh", "-c", "echo $FORKD_COLOUR; pwd"]).stdout.split() == ["blue", guest_path(vm, "tmp")]
    (child,) = vm.fork(backend="full")
    try:
        assert child.env == {"FORKD_COLOUR": "blue"} and child.cwd == vm.cwd
    finally:
        child.close()


def test_many_children_fork_at_once_and_each_is_timed(base: Snapshot) -> None:
    children = base.fork(3)
    try:
        assert len({child.name for child in children}) == 3
        assert all(cat(child, "marker") == "base" for child in children)
    finally:
        for child in children:
            child.close()


def test_a_pool_drops_dead_children_and_refills(factory: VMFactory, base: Snapshot) -> None:
    pool = factory.pool(base, 2)
    try:
        deadline = time.monotonic() + 30
        while len(pool) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(pool) == 2
        first = pool.take()
        assert first is not None
        first.close()
        second = pool._ready[0]
        second.machine.kill()
        taken = pool.take()
        assert taken is not second
        if taken is not None:
            taken.close()
        assert factory.pool(base, 3) is not pool  # a new size replaces the pool
    finally:
        factory.drop_pool(base)
        factory.drop_pool(base)


def test_a_pool_gives_up_after_repeated_failures_and_closes_cleanly() -> None:
    attempts = []

    def failing() -> VM:
        attempts.append(1)
        raise RuntimeError("no VM today")

    pool = ChildPool(failing, 1, name="failing")
    poll_until(lambda: pool.stopped, timeout=10, what="the pool to give up")
    assert pool.failures == MAX_FAILURES and len(attempts) == MAX_FAILURES and pool.take() is None
    pool.close()
    empty = ChildPool(failing, 0)
    assert empty.take() is None
    empty.close()


def test_a_pool_closed_while_refilling_closes_what_it_made() -> None:
    made: list[object] = []
    release = threading.Event()

    class Stub:
        closed = False

        def close(self) -> None:
            self.closed = True

    def slow() -> Stub:
        release.wait(10)
        made.append(Stub())
        return made[-1]

    pool = ChildPool(slow, 1)  # type: ignore[arg-type]
    poll_until(lambda: pool.in_flight == 1, timeout=10, what="the pool to start a restore")
    closer = threading.Thread(target=pool.close)
    closer.start()
    time.sleep(0.05)
    release.set()
    closer.join(10)
    assert made and all(stub.closed for stub in made)


# -- diffs -----------------------------------------------------------------------------------------------
@needs_dirty_tracking
def test_a_large_diff_is_flattened_and_its_children_map_the_flat_file(factory: VMFactory, vm: VM) -> None:
    diff = factory.runtime.backends.get("diff")
    previous = diff.flatten_fraction
    diff.flatten_fraction = 0.0
    try:
        vm.exec(["sh", "-c", "echo changed > marker"])
        snapshot = vm.branch(backend="diff")
        diff.wait_flattened(30)
    finally:
        diff.flatten_fraction = previous
    flattened = Snapshot.load_from(snapshot.path).with_owner(factory)
    assert flattened.memory_path is not None and flattened.diff_path is not None
    (child,) = flattened.fork()
    try:
        assert cat(child, "marker") == "changed"
        assert child.machine.memory_layout().path == flattened.memory_path
    finally:
        child.close()


@needs_dirty_tracking
def test_a_diff_of_a_root_vm_falls_back_to_full_memory(factory: VMFactory) -> None:
    root = factory.boot(memory_mib=MEMORY_MIB)
    try:
        snapshot = root.branch(backend="diff")
        assert snapshot.memory_path is not None and "fallback" in snapshot.extra
    finally:
        root.close()


# -- trajectories run on the fake engine too ---------------------------------------------------------------
@needs_dirty_tracking
def test_bisect_finds_the_first_bad_step(vm: VM) -> None:
    with Trajectory(vm, every=2) as trajectory:
        for step in range(6):
            trajectory.step(["sh", "-c", f"echo {step} >> log" + ("; rm -f marker" if step == 3 else "")])
        result = trajectory.bisect(lambda guest: cat(guest, "marker") == "base")
    assert result.found and result.first_bad == 4, result.report()
    assert "step 4" in result.report()


def test_the_fake_machine_refuses_memory_of_another_size(tmp_path: Path) -> None:
    memory = tmp_path / "memory.ram"
    memory.write_bytes(b"\0" * 4096)
    from pytest_forkd.engine.fake import FakeSpec

    with pytest.raises(VMError, match="holds 4096 bytes"):
        FakeMachine.launch(FakeSpec(memory_mib=1), tmp_path, "odd", ram_path=memory, owns_ram=False, python="python3")
    assert list(tmp_path.iterdir()) == [memory]


def test_a_backend_s_own_host_check_still_counts_with_an_engine_that_can_serve_it() -> None:
    from pytest_forkd.storage.backend import StorageBackend

    class Picky(StorageBackend):
        id = "picky"
        requires = ("incoming_restore",)

        def unavailable_reason(self) -> str | None:
            return "needs a host this is not"

    capabilities = FakeEngine().capabilities()
    with pytest.raises(BackendError, match="storage backend 'picky' is unavailable on this host: needs a host"):
        Picky().require_available(capabilities)
    with pytest.raises(BackendError, match="needs a host"):
        Picky().require_available()

    class Live(StorageBackend):
        id = "live"
        requires = ("live_snapshot",)

    with pytest.raises(BackendError, match="no live snapshot"):
        Live().require_available(capabilities)
    assert StorageBackend().unavailable_reason() is None


def test_the_qemu_engine_reports_host_facts_as_capabilities(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from pytest_forkd.engine.qemu import engine as qemu_engine

    monkeypatch.setattr(qemu_engine, "userfaultfd_problem", lambda: "userfaultfd is closed here")
    capabilities = qemu_engine.QemuEngine.host_capabilities()
    assert capabilities.engine == "qemu" and capabilities.network and not capabilities.live_snapshot
    assert capabilities.missing(["live_snapshot", "uffd_write_protect"]) == "userfaultfd is closed here"
    monkeypatch.setenv("FORKD_QEMU", str(tmp_path / "no-such-qemu"))
    assert "FORKD_QEMU=" in qemu_engine.QemuEngine().unavailable_reason()
    with pytest.raises(ConfigError, match="accel 'fast' is not one of"):
        qemu_engine.QemuEngine(accel="fast")
