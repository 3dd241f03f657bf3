"""fork(n) restores children concurrently, and the pool refills on parallel threads (real QEMU)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

from pytest_forkd.core.factory import VMFactory
from pytest_forkd.core.vm import VM
from pytest_forkd.errors import VMStartError
from pytest_forkd.storage.snapshot import Snapshot


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class CountingLaunches:
    """Wraps ``factory._launch_child``: counts restores running at once, remembers every QEMU pid."""

    def __init__(self, factory: VMFactory, monkeypatch: pytest.MonkeyPatch, fail_at: int | None = None) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.most_at_once = 0
        self.calls = 0
        self.pids: list[int] = []
        original = factory._launch_child

        def launch(*args: Any, **kwargs: Any) -> VM:
            with self.lock:
                self.calls += 1
                number = self.calls
                self.running += 1
                self.most_at_once = max(self.most_at_once, self.running)
            try:
                if fail_at is not None and number == fail_at:
                    time.sleep(0.2)  # let siblings get going first
                    raise VMStartError("injected restore failure")
                child = original(*args, **kwargs)
                with self.lock:
                    self.pids.append(child.machine.pid)
                return child
            finally:
                with self.lock:
                    self.running -= 1

        monkeypatch.setattr(factory, "_launch_child", launch)


def test_fork_n_restores_children_concurrently_all_usable_and_distinct(
    factory: VMFactory, base_snapshot: Snapshot, monkeypatch: pytest.MonkeyPatch
) -> None:
    launches = CountingLaunches(factory, monkeypatch)
    children = base_snapshot.fork(4)
    try:
        assert len(children) == 4
        assert len({child.machine.pid for child in children}) == 4
        assert len({child.name for child in children}) == 4
        assert launches.most_at_once >= 2  # restored on parallel threads, not one after another
        assert all(child.machine.status() == "running" for child in children)  # all resumed together
        for index, child in enumerate(children):
            child.write_file("/root/who", f"child {index}\n")
        for index, child in enumerate(children):  # isolated: each sees only its own write
            assert child.exec("cat /root/marker /root/who", check=True).stdout == f"from-base\nchild {index}\n"
        now = time.time()
        guest_clocks = [float(child.exec(["date", "+%s"], check=True).stdout) for child in children]
        assert all(abs(clock - now) < 60 for clock in guest_clocks)  # parked while siblings restored, clock set again
    finally:
        for child in children:
            child.close()
    assert not any(alive(pid) for pid in launches.pids)


def test_a_failed_restore_in_fork_n_kills_every_sibling(
    factory: VMFactory, base_snapshot: Snapshot, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = set(factory.vms)
    launches = CountingLaunches(factory, monkeypatch, fail_at=3)
    with pytest.raises(VMStartError, match="injected restore failure"):
        base_snapshot.fork(4)
    assert launches.calls >= 3
    assert set(factory.vms) == before  # nothing of the call is left registered
    assert launches.pids and not any(alive(pid) for pid in launches.pids)  # nor running


def test_a_failed_fork_n_also_kills_the_pooled_children_it_took(
    factory: VMFactory, base_snapshot: Snapshot, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = factory.pool(base_snapshot, 1)
    try:
        assert pool.prefill(timeout=120) == 1
        pooled = [vm for vm in factory.vms if vm.machine.status() == "paused"]
        assert len(pooled) == 1
        monkeypatch.setattr(pool, "_launch", lambda: (_ for _ in ()).throw(VMStartError("refill off")))
        CountingLaunches(factory, monkeypatch, fail_at=1)
        with pytest.raises(VMStartError, match="injected restore failure"):
            factory.fork_snapshot(base_snapshot, 3)
        assert pooled[0].closed and pooled[0].machine.process.poll() is not None
    finally:
        factory.drop_pool(base_snapshot)


def test_the_pool_refills_in_parallel_ahead_of_the_tests_and_parks_its_children(
    factory: VMFactory, base_snapshot: Snapshot, monkeypatch: pytest.MonkeyPatch
) -> None:
    launches = CountingLaunches(factory, monkeypatch)
    before = set(factory.vms)
    remaining = [3]
    pool = factory.pool(base_snapshot, 1, maximum=3, demand=lambda: remaining[0])
    taken: list[VM] = []
    try:
        assert pool.prefill(timeout=180) == 3
        pooled = set(factory.vms) - before
        assert len(pooled) == 3
        if (os.cpu_count() or 1) >= 2:
            assert launches.most_at_once >= 2  # the prefill restores on every core
        assert all(vm.machine.status() == "paused" for vm in pooled)  # parked: no CPU while waiting
        for _ in range(3):
            remaining[0] -= 1
            child = factory.fork_snapshot(base_snapshot, 1)[0]
            taken.append(child)
            assert child in pooled
            assert child.machine.status() == "running"
            assert child.exec("cat /root/marker", check=True).stdout == "from-base\n"
        assert pool.target == 0 and len(pool) == 0  # no test left: nothing more is restored
    finally:
        for child in taken:
            child.close()
        factory.drop_pool(base_snapshot)
    assert set(factory.vms) == before
    assert not any(alive(pid) for pid in launches.pids)


def test_close_soon_kills_at_once_and_the_factory_waits_for_the_cleanup(
    factory: VMFactory, base_snapshot: Snapshot
) -> None:
    private = VMFactory(accel=factory.requested_accel)
    run_dir = private.run_dir.path
    try:
        vm = private.fork_snapshot(base_snapshot, 1)[0]
        pid = vm.machine.pid
        private.close_soon(vm)
        assert vm.machine.process.wait(timeout=30) is not None  # SIGKILLed, not left running
    finally:
        private.close()
    assert vm.closed and not alive(pid)
    assert not run_dir.exists()  # its sockets and logs went with the run directory, after the cleanup
