"""Snapshots, branches and forks of real VMs, with every storage backend.

Most tests branch the ``vm`` fixture (a child of the session's base snapshot),
so only one test boots a root VM of its own (freezing needs one).
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Iterator

import pytest
from forkd_backends.diff import DiffBackend
from forkd_backends.uffd import UffdBackend
from tenacity import Retrying, retry_if_exception_type, retry_if_result, stop_after_delay, wait_fixed

from pytest_forkd.core.factory import VMFactory
from pytest_forkd.core.pool import ChildPool
from pytest_forkd.core.vm import VM
from pytest_forkd.engine import memory
from pytest_forkd.errors import BackendError, SnapshotError
from pytest_forkd.guest.client import GuestOSError
from pytest_forkd.latency import timings
from pytest_forkd.storage.backend import (
    BackendRegistry,
    Capture,
    CaptureSource,
    StorageBackend,
    hookimpl,
)
from pytest_forkd.storage.snapshot import Snapshot
from pytest_forkd.storage.store import SnapshotStore

BACKENDS = ["full", "diff", "uffd"]
MIB = 1 << 20
FAILING_BACKEND = "itest-fails-mid-capture"
EAGER_FLATTEN_BACKEND = "itest-diff-flattens-early"
LIVE_SNAPSHOT_BACKEND = "itest-uffd-engine-live-snapshot"


# -- helpers ------------------------------------------------------------------------


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def exists(vm: VM, path: str) -> bool:
    return vm.exec(["test", "-e", path]).exit_code == 0


def read_counter(vm: VM) -> int:
    """The guest loop's counter; retry until the loop has written it once, and after a torn read
    (the loop truncates the file before writing it)."""
    poll = Retrying(
        stop=stop_after_delay(10),
        wait=wait_fixed(0.02),
        retry=retry_if_exception_type((ValueError, GuestOSError)),
        reraise=True,
    )
    return poll(lambda: int(vm.read_file("/root/counter")))


class Owned:
    """The VMs a test started; called with a list of VMs, it remembers and returns them."""

    def __init__(self) -> None:
        self._vms: list[VM] = []
        self._lock = threading.Lock()

    def __call__(self, vms: list[VM]) -> list[VM]:
        with self._lock:
            self._vms.extend(vms)
        return vms

    def close(self) -> None:
        for vm in self._vms:
            vm.close()


@pytest.fixture
def owned() -> Iterator[Owned]:
    """Closes the VMs a test forked or booted, whether it passed or not."""
    vms = Owned()
    yield vms
    vms.close()


@pytest.fixture
def recorder(factory: VMFactory, monkeypatch: pytest.MonkeyPatch) -> timings.Recorder:
    """A fresh timing recorder for the factory's runtime during the test (its own is put back afterwards)."""
    fresh = timings.Recorder()
    monkeypatch.setattr(factory.runtime, "recorder", fresh)
    return fresh


# -- external backends, registered as a third party would --------------------------------


class FailsMidCapture(StorageBackend):
    """Pauses the VM like every backend, then fails: the source must be resumed by the caller."""

    id = FAILING_BACKEND
    description = "stops the VM, then fails (tests that a failed branch resumes its source)"

    def capture(self, source: CaptureSource, target: Path) -> Capture:
        source.machine.stop()
        raise BackendError("injected failure while capturing memory")


class FlattensEarly(DiffBackend):
    """The diff backend with a flattening threshold low enough to reach in a test."""

    id = EAGER_FLATTEN_BACKEND

    def __init__(self) -> None:
        super().__init__(flatten_fraction=0.01, rebase_mib=None)  # a diff, however much the VM changed


class EngineLiveSnapshot(UffdBackend):
    """The uffd backend without pre-copy: always the engine's live snapshot (what root VMs and older kernels get)."""

    id = LIVE_SNAPSHOT_BACKEND

    def __init__(self) -> None:
        super().__init__(precopy=False)


class ItestBackends:
    """A backend plugin object, registered at run time with the factory's runtime (no entry point)."""

    @hookimpl
    def forkd_register_backends(self, registry: BackendRegistry) -> None:
        registry.add(FailsMidCapture())
        registry.add(FlattensEarly())
        registry.add(EngineLiveSnapshot())


@pytest.fixture(scope="module")
def external_backends(factory: VMFactory) -> None:
    if FAILING_BACKEND not in factory.runtime.backends:
        factory.runtime.register(ItestBackends())
    assert {FAILING_BACKEND, EAGER_FLATTEN_BACKEND, LIVE_SNAPSHOT_BACKEND, *BACKENDS} <= set(
        factory.runtime.backends.ids()
    )


# -- isolation ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_children_of_a_branch_are_isolated_from_each_other_and_the_source(vm: VM, backend: str, owned: Owned) -> None:
    vm.write_file("/root/before-branch", "shared")
    snapshot = vm.branch(backend=backend)
    first, second = owned(snapshot.fork(2))

    first.write_file("/root/written-by-first", "first")
    vm.write_file("/root/written-by-source", "source")

    assert snapshot.backend == backend
    for child in (first, second):
        assert child.origin is not None and child.origin.tag == snapshot.tag
        assert child.read_file("/root/before-branch") == b"shared"
        assert child.read_file("/root/marker") == b"from-base\n"
        assert not exists(child, "/root/written-by-source")
    assert not exists(second, "/root/written-by-first")
    assert not exists(vm, "/root/written-by-first")
    assert len({vm.machine.pid, first.machine.pid, second.machine.pid}) == 3


def test_snapshot_files_never_change_while_children_and_source_write(
    vm: VM, base_snapshot: Snapshot, owned: Owned
) -> None:
    full = vm.branch(backend="full")
    diff = vm.branch(backend="diff")
    files = [
        base_snapshot.memory_path,
        base_snapshot.state_path,
        full.memory_path,
        full.state_path,
        diff.diff_path,
        diff.state_path,
    ]
    before = {path: sha256_of(path) for path in files}

    writers = [vm, *owned(full.fork(1) + diff.fork(1) + base_snapshot.fork(1))]
    for writer in writers:
        writer.exec("dd if=/dev/urandom of=/root/big bs=1M count=20 2>/dev/null", check=True)

    assert {path: sha256_of(path) for path in files} == before


# -- repeated, concurrent and live branches ------------------------------------------------


def test_ten_diff_branches_in_a_row_copy_only_what_the_guest_changed(
    vm: VM, owned: Owned, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each diff copies what changed since the base, not more: its growth tracks the guest's writes.

    Without re-basing (test_rebase.py covers it), so every diff is against the same base. How long
    the pauses take is ``forkd bench``'s to measure (``diff_pause_10th_over_2nd``); what the pause
    copies is deterministic and checked here.
    """
    monkeypatch.setattr(vm.factory.runtime.backends.get("diff"), "rebase_mib", None)
    written = 256 * 1024
    snapshots = []
    for number in range(10):
        vm.exec(f"head -c {written} /dev/urandom > /root/dirt{number}", check=True)
        snapshots.append(vm.branch(backend="diff"))
    dirty = [snapshot.dirty_bytes for snapshot in snapshots]

    assert all(isinstance(size, int) and size > 0 for size in dirty), dirty
    assert dirty == sorted(dirty), f"a later diff lost pages of an earlier one: {dirty}"  # cumulative
    growth = [later - earlier for earlier, later in zip(dirty, dirty[1:])]
    # 256 KiB of file data plus the guest kernel's own bookkeeping (page cache, slab, the agent);
    # a diff that re-copied whole regions or the base would grow by tens of MiB per step.
    assert max(growth) <= 4 * MIB, f"a diff grew far more than the guest wrote: {growth}"
    assert dirty[-1] - dirty[0] >= 9 * written, f"the diffs missed the written files: {dirty}"
    assert all(snapshot.pause_ms > 0 for snapshot in snapshots)
    assert len({snapshot.tag for snapshot in snapshots}) == 10
    child = owned(snapshots[-1].fork(1))[0]
    assert child.exec("ls /root | grep -c '^dirt'").stdout == "10\n"


def test_forks_requested_from_several_threads_at_once_all_succeed(base_snapshot: Snapshot, owned: Owned) -> None:
    start = threading.Barrier(4)
    children: list[VM] = []
    errors: list[BaseException] = []

    def fork_one() -> None:
        start.wait()
        try:
            children.extend(owned(base_snapshot.fork(1)))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=fork_one) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert errors == []
    assert len(children) == 4 and len({child.machine.pid for child in children}) == 4
    for number, child in enumerate(children):
        child.write_file("/root/who", str(number))
    assert [child.read_file("/root/who") for child in children] == [b"0", b"1", b"2", b"3"]
    assert all(child.read_file("/root/marker") == b"from-base\n" for child in children)


BUSY_LOOP = "sh -c 'i=0; while true; do i=$((i+1)); echo $i > /root/counter; done' >/dev/null 2>&1 &"


@pytest.mark.parametrize("backend", ["full", "diff", "uffd"])
def test_branch_of_a_busy_vm_keeps_the_command_effects_as_of_the_pause(vm: VM, owned: Owned, backend: str) -> None:
    vm.exec(BUSY_LOOP, check=True)
    before_branch = read_counter(vm)

    child = owned(vm.fork(1, backend=backend))[0]
    in_child = read_counter(child)
    in_source = read_counter(vm)

    assert before_branch <= in_child <= in_source
    poll = Retrying(
        stop=stop_after_delay(10), wait=wait_fixed(0.05), retry=retry_if_result(lambda value: value <= in_child)
    )
    assert poll(read_counter, child) > in_child  # the loop goes on in the child


def test_live_branches_of_a_busy_guest_give_healthy_children(vm: VM, owned: Owned) -> None:
    """The memory image of a uffd branch and its device state describe the same instant, also
    while the guest keeps writing: every child runs a fresh Python process."""
    vm.exec(BUSY_LOOP, check=True)
    for _ in range(5):
        child = owned(vm.fork(1, backend="uffd"))[0]
        assert child.exec("python3 -c 'print(6*7)'", timeout=60).stdout == "42\n"
        child.close()


def test_failed_branch_propagates_and_resumes_its_source(vm: VM, external_backends: None) -> None:
    store = vm.factory.session_store

    with pytest.raises(BackendError, match="injected failure"):
        vm.branch("itest-failed-branch", backend=FAILING_BACKEND)

    assert vm.machine.status() == "running"
    assert vm.exec("echo alive").stdout == "alive\n"
    assert not store.exists("itest-failed-branch")


# -- restore, checkpoints, freeze ------------------------------------------------------------


def test_restore_in_place_keeps_the_handle_and_rewinds_the_guest(vm: VM) -> None:
    vm.write_file("/root/state", "at snapshot")
    snapshot = vm.branch()
    old_machine = vm.machine
    vm.write_file("/root/state", "changed")
    vm.write_file("/root/later", "x")
    handle = vm

    vm.restore(snapshot)

    assert vm is handle and vm.origin is not None and vm.origin.tag == snapshot.tag
    assert vm.machine is not old_machine and vm.machine.alive()
    assert old_machine.process.poll() is not None  # the replaced QEMU is gone
    assert vm.read_file("/root/state") == b"at snapshot"
    assert not exists(vm, "/root/later")


def test_checkpoint_rolls_back_on_exit_even_after_an_error(vm: VM) -> None:
    with vm.checkpoint() as checkpoint:
        vm.exec("rm /root/marker && echo damage > /root/scratch", check=True)
    assert vm.read_file("/root/marker") == b"from-base\n"
    assert not exists(vm, "/root/scratch")
    assert checkpoint.snapshot.backend == vm.factory.default_backend

    with pytest.raises(RuntimeError, match="agent went rogue"):
        with vm.checkpoint():
            vm.exec("rm /root/marker", check=True)
            raise RuntimeError("agent went rogue")
    assert vm.read_file("/root/marker") == b"from-base\n"


def test_checkpoint_keep_keeps_the_changes(vm: VM, owned: Owned) -> None:
    vm.write_file("/root/result", "before")
    with vm.checkpoint() as checkpoint:
        vm.write_file("/root/result", "good")
        checkpoint.keep()

    assert vm.read_file("/root/result") == b"good"
    (alternative,) = owned(checkpoint.fork(1))  # a kept checkpoint still forks the state it was taken at
    assert alternative.read_file("/root/result") == b"before"


def test_checkpoint_forks_alternatives_from_the_checkpoint(vm: VM, owned: Owned) -> None:
    vm.write_file("/root/before", "1")
    with vm.checkpoint() as checkpoint:
        vm.write_file("/root/after", "2")
        alternatives = owned(checkpoint.fork(3))

    assert len({child.machine.pid for child in alternatives}) == 3
    for child in alternatives:
        assert child.read_file("/root/before") == b"1"
        assert not exists(child, "/root/after")


def test_frozen_root_vm_continues_as_a_child_of_its_snapshot(factory: VMFactory, owned: Owned) -> None:
    root = factory.boot()
    owned([root])
    root.write_file("/root/frozen-state", "kept")

    snapshot = root.freeze("itest-freeze")

    assert snapshot.extra["frozen"] and snapshot.memory_path.is_file()
    assert not root.closed and not root.machine.owns_ram
    assert root.origin is not None and root.origin.tag == "itest-freeze"
    assert root.read_file("/root/frozen-state") == b"kept"
    frozen_memory = sha256_of(snapshot.memory_path)
    root.exec("dd if=/dev/urandom of=/root/after-freeze bs=1M count=8 2>/dev/null", check=True)
    assert sha256_of(snapshot.memory_path) == frozen_memory
    child = owned(snapshot.fork(1))[0]
    assert child.read_file("/root/frozen-state") == b"kept"
    assert not exists(child, "/root/after-freeze")
    with pytest.raises(SnapshotError, match="only a booted root VM can be frozen"):
        root.freeze("itest-freeze-again")


# -- backend specifics --------------------------------------------------------------------------


#: Pre-copy needs asynchronous userfaultfd write-protection, from the same kernel release as PAGEMAP_SCAN.
NO_PRECOPY = memory.pagemap_scan_problem()
UFFD_METHODS = [
    pytest.param(
        "uffd", "precopy", id="uffd-precopy", marks=pytest.mark.skipif(NO_PRECOPY is not None, reason=str(NO_PRECOPY))
    ),
    pytest.param(LIVE_SNAPSHOT_BACKEND, "live_snapshot", id="uffd-engine-live-snapshot"),
]


@pytest.mark.parametrize(("backend", "method"), UFFD_METHODS)
def test_uffd_branch_is_written_in_the_background_and_forks_wait_for_it(
    vm: VM, owned: Owned, external_backends: None, backend: str, method: str
) -> None:
    vm.write_file("/root/before-branch", "captured")

    snapshot = vm.branch(backend=backend)
    vm.write_file("/root/after-branch", "not captured")

    assert snapshot.status == "writing" and snapshot.extra["live"]
    assert snapshot.extra["method"] == method  # a child on this kernel is pre-copied
    child = owned(snapshot.fork(1))[0]  # waits for the memory to be written
    assert child.read_file("/root/before-branch") == b"captured"
    assert not exists(child, "/root/after-branch")
    stored = SnapshotStore(snapshot.path.parent).get(snapshot.tag)
    assert stored.status == "ready" and stored.memory_path.stat().st_size == vm.memory_mib << 20


def allocated(path: Path) -> int:
    return path.stat().st_blocks * 512


@pytest.mark.parametrize(("backend", "method"), UFFD_METHODS)
def test_uffd_branch_leaves_its_snapshot_and_the_base_sparse(
    vm: VM, owned: Owned, external_backends: None, backend: str, method: str
) -> None:
    """Pre-copy never reads the holes of the base; QEMU's read of every page allocates them, and
    the branch gives them back. Either way the new snapshot keeps its zero pages as holes."""
    base = vm.memory_base
    assert base is not None and base.memory_path is not None and vm.machine.ram_path == base.memory_path
    base_before, base_mtime = allocated(base.memory_path), base.memory_path.stat().st_mtime_ns
    content = vm.exec("head -c 2097152 /dev/urandom > /root/payload && sha256sum /root/payload", check=True).stdout

    snapshot = vm.branch(backend=backend)
    child = owned(snapshot.fork(1))[0]  # waits until the memory is written (and zero pages punched)

    stored = SnapshotStore(snapshot.path.parent).get(snapshot.tag)
    assert stored.memory_path is not None and stored.extra["method"] == method
    size = stored.memory_path.stat().st_size
    assert size == vm.memory_mib << 20
    assert allocated(stored.memory_path) < size * 0.8, "the snapshot's zero pages are still allocated"
    if method == "live_snapshot":
        assert allocated(base.memory_path) <= base_before, "the base grew by the pages QEMU read in"
        assert stored.extra["base_bytes_released"] > 0
    else:  # the guest itself may read a hole or two of its base meanwhile, never most of them
        assert allocated(base.memory_path) <= base_before + MIB, "the branch read the holes of the base"
        assert stored.extra["precopied_bytes"] >= 2 * MIB  # the payload's pages are the child's own
    assert base.memory_path.stat().st_mtime_ns == base_mtime  # its checked record still holds
    assert child.exec("sha256sum /root/payload", check=True).stdout == content
    assert vm.exec("sha256sum /root/payload", check=True).stdout == content
    assert owned(base.fork(1))[0].exec(["true"]).exit_code == 0  # the base still restores


@pytest.mark.skipif(NO_PRECOPY is not None, reason=str(NO_PRECOPY))
def test_uffd_branch_pause_copies_only_what_the_guest_wrote_after_the_precopy(vm: VM, owned: Owned) -> None:
    """The child's own pages (a 16 MiB file it wrote) are copied before the pause; the pause copies
    only the pages written while that copy ran, and the snapshot holds both."""
    content = vm.exec("head -c 16777216 /dev/urandom > /root/big && sha256sum /root/big", check=True).stdout

    snapshot = vm.branch(backend="uffd")

    assert snapshot.extra["method"] == "precopy"
    assert snapshot.extra["precopied_bytes"] >= 16 * MIB
    assert snapshot.extra["pause_copied_bytes"] < snapshot.extra["precopied_bytes"] / 4
    child = owned(snapshot.fork(1))[0]
    assert child.exec("sha256sum /root/big", check=True).stdout == content


def test_diff_past_the_threshold_is_flattened_into_its_own_memory(
    vm: VM, external_backends: None, owned: Owned
) -> None:
    content = vm.exec("head -c 4194304 /dev/urandom > /root/payload && sha256sum /root/payload", check=True).stdout
    snapshot = vm.branch(backend=EAGER_FLATTEN_BACKEND)
    assert snapshot.diff_file is not None and snapshot.memory_file is None and snapshot.base is not None

    vm.factory.runtime.backends.get(EAGER_FLATTEN_BACKEND).wait_flattened(timeout=120)

    flattened = SnapshotStore(snapshot.path.parent).get(snapshot.tag).with_owner(vm.factory)
    assert flattened.memory_path is not None and flattened.memory_path.is_file()
    assert flattened.base is None
    from_record, from_flat = owned(snapshot.fork(1) + flattened.fork(1))
    for child in (from_record, from_flat):
        assert child.exec("sha256sum /root/payload", check=True).stdout == content
    assert from_flat.memory_base is not None and from_flat.memory_base.tag == snapshot.tag
    grandchild_snapshot = from_flat.branch(backend="diff")
    assert grandchild_snapshot.base == snapshot.tag
    grandchild = owned(grandchild_snapshot.fork(1))[0]
    assert grandchild.exec("sha256sum /root/payload", check=True).stdout == content


# -- pools ---------------------------------------------------------------------------------------


def wait_for_pool(pool: ChildPool, size: int) -> None:
    poll = Retrying(
        stop=stop_after_delay(120), wait=wait_fixed(0.1), retry=retry_if_result(lambda n: n < size), reraise=True
    )
    assert poll(len, pool) == size


def test_pool_hands_out_prerestored_children_and_drop_kills_the_rest(
    factory: VMFactory, base_snapshot: Snapshot, recorder: timings.Recorder, owned: Owned
) -> None:
    before = set(factory.vms)
    unused: set[VM] = set()
    pool = factory.pool(base_snapshot, 2)
    try:
        wait_for_pool(pool, 2)
        pooled = set(factory.vms) - before

        children = owned(factory.fork_snapshot(base_snapshot, 2))

        assert set(children) == pooled
        assert factory.pool(base_snapshot, 2) is pool  # asked again, the snapshot's pool is the one it has
        forks = [sample for sample in recorder.samples() if sample.op == "fork"]
        assert [sample.extra["pooled"] for sample in forks] == [True, True]
        assert all(child.exec("cat /root/marker").stdout == "from-base\n" for child in children)
        wait_for_pool(pool, 2)  # refilled in the background
        unused = set(factory.vms) - before - pooled
        assert len(unused) == 2
    finally:
        factory.drop_pool(base_snapshot)
    assert all(vm.closed and vm.machine.process.poll() is not None for vm in unused)
    assert set(factory.vms) - before == pooled


def test_closing_the_factory_kills_unused_pooled_children(factory: VMFactory, base_snapshot: Snapshot) -> None:
    private = VMFactory(accel=factory.requested_accel)
    run_dir = private.run_dir.path
    try:
        pool = private.pool(base_snapshot, 1)
        wait_for_pool(pool, 1)
        pooled = private.vms
    finally:
        private.close()
    assert len(pooled) == 1 and pooled[0].closed and pooled[0].machine.process.poll() is not None
    assert not run_dir.exists()


# -- timings ----------------------------------------------------------------------------------------


def test_every_fork_branch_restore_and_exec_is_timed(
    base_snapshot: Snapshot, recorder: timings.Recorder, owned: Owned
) -> None:
    child = owned(base_snapshot.fork(1))[0]
    child.exec("true")
    snapshot = child.branch(backend="diff")
    child.restore(snapshot)

    by_op = recorder.by_op()
    assert {"fork", "exec", "branch_pause", "branch_total", "restore"} <= set(by_op)
    assert all(sample.memory_mib == 256 for samples in by_op.values() for sample in samples)
    first_fork = by_op["fork"][0]
    assert (first_fork.backend, first_fork.cold) == ("full", True)
    assert by_op["exec"][0].cold is False
    for op in ("branch_pause", "branch_total"):
        assert [(sample.backend, sample.dirty_bytes > 0) for sample in by_op[op]] == [("diff", True)]
    assert [sample.backend for sample in by_op["restore"]] == ["diff"]
    assert by_op["fork"][-1].backend == "diff"  # the restore started a child of the diff
    assert all(sample.ms > 0 for sample in recorder.samples())
