"""The child pool's sizing policy and refill machinery, with a fake clock and fake restores (no VM)."""

from __future__ import annotations

import threading
from typing import Callable

import pytest
from tenacity import Retrying, retry_if_result, stop_after_delay, wait_fixed

from pytest_forkd.core.pool import (
    IDLE_BANK_PER_CORE,
    MAX_FAILURES,
    MAX_POOL,
    ChildPool,
    PoolSizer,
    child_memory_mib,
    cpu_workers,
    memory_bound,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def eventually(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    """Wait (bounded) for a background refill to reach a state; asserts the state, never a duration."""
    poll = Retrying(
        stop=stop_after_delay(timeout), wait=wait_fixed(0.01), retry=retry_if_result(lambda ok: not ok), reraise=True
    )
    assert poll(predicate)


# -- PoolSizer ----------------------------------------------------------------------------------------------
def takes(sizer: PoolSizer, clock: FakeClock, count: int, every: float) -> None:
    for _ in range(count):
        sizer.taken()
        clock.advance(every)


def test_the_minimum_holds_until_the_take_rate_is_known() -> None:
    clock = FakeClock()
    sizer = PoolSizer(1, 10, clock=clock)
    sizer.refilled(0.3)
    assert sizer.target(workers=2) == 1
    takes(sizer, clock, PoolSizer.WARMUP_TAKES - 1, every=0.01)
    assert sizer.target(workers=2) == 1


def test_littles_law_sizes_the_pool_when_the_cores_keep_up() -> None:
    clock = FakeClock()
    sizer = PoolSizer(1, 10, clock=clock)
    sizer.refilled(0.3)
    takes(sizer, clock, 5, every=0.1)  # a take every 100 ms, a refill takes 300 ms, 4 at once: supply keeps up
    assert sizer.target(workers=4) == 4  # 300 / 100 in the pipe, plus one


def test_a_demand_faster_than_the_cores_banks_up_to_the_maximum() -> None:
    clock = FakeClock()
    sizer = PoolSizer(1, 10, clock=clock)
    sizer.refilled(0.3)
    takes(sizer, clock, 5, every=0.1)  # 2 restores at once give one child per 150 ms: never enough
    assert sizer.target(workers=2) == 10


def test_the_remaining_demand_caps_the_target() -> None:
    clock = FakeClock()
    sizer = PoolSizer(1, 10, clock=clock)
    sizer.refilled(0.3)
    takes(sizer, clock, 5, every=0.1)
    assert sizer.target(workers=2, demand=3) == 3
    assert sizer.target(workers=2, demand=0) == 0


def test_the_target_shrinks_when_takes_stop() -> None:
    clock = FakeClock()
    sizer = PoolSizer(1, 10, clock=clock)
    sizer.refilled(0.3)
    takes(sizer, clock, 5, every=0.1)
    clock.advance(30)  # the suite moved on to tests without VMs
    assert sizer.target(workers=2) <= 2


def test_a_fixed_pool_never_grows() -> None:
    clock = FakeClock()
    sizer = PoolSizer(2, 2, clock=clock)
    sizer.refilled(1.0)
    takes(sizer, clock, 10, every=0.01)
    assert sizer.target(workers=2) == 2


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="minimum <= maximum"):
        PoolSizer(3, 2)


def test_memory_bounds_the_pool() -> None:
    assert memory_bound(80, 1000) == 6  # half of 1000 MiB holds six 80 MiB children
    assert memory_bound(80, 1_000_000) == MAX_POOL  # never more than the hard limit
    assert memory_bound(80, 10) == 1
    assert memory_bound(80, None) == 8  # unknown memory: a modest pool


def test_restores_leave_a_core_to_the_test_unless_it_waits() -> None:
    assert cpu_workers(2, waiting=False) == 1
    assert cpu_workers(2, waiting=True) == 2
    assert cpu_workers(1, waiting=False) == 1
    assert cpu_workers(None, waiting=True) == 1


# -- ChildPool ----------------------------------------------------------------------------------------------
class FakeChild:
    def __init__(self, number: int) -> None:
        self.number = number
        self.parked = False
        self.closed = False
        self.dead = False


class FakeRestores:
    """Restores on demand; ``gate`` holds them until the test releases it."""

    def __init__(self, fail: int = 0, gated: bool = False) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.fail = fail
        self.children: list[FakeChild] = []
        self.gate = threading.Event()
        if not gated:
            self.gate.set()
        self.running = 0
        self.most_at_once = 0

    def launch(self) -> FakeChild:
        with self.lock:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        try:
            self.gate.wait(timeout=20)
            with self.lock:
                self.count += 1
                if self.count <= self.fail:
                    raise RuntimeError("restore failed")
                child = FakeChild(self.count)
                self.children.append(child)
                return child
        finally:
            with self.lock:
                self.running -= 1


def make_pool(restores: FakeRestores, size: int = 1, **options: object) -> ChildPool[FakeChild]:
    def park(child: FakeChild) -> None:
        child.parked = True

    def unpark(child: FakeChild) -> None:
        child.parked = False

    def discard(child: FakeChild) -> None:
        child.closed = True

    return ChildPool(
        restores.launch,
        size,
        "test",
        park=park,
        unpark=unpark,
        discard=discard,
        usable=lambda child: not child.dead,
        **options,
    )  # type: ignore[arg-type]


def test_a_pool_keeps_its_size_ready_and_parked() -> None:
    restores = FakeRestores()
    pool = make_pool(restores, 2, cpus=2)
    try:
        eventually(lambda: len(pool) == 2)
        assert all(child.parked for child in restores.children)
        child = pool.take()
        assert child is not None and not child.parked  # handed out resumed
        eventually(lambda: len(pool) == 2)  # refilled
        assert pool.launched == 3 and pool.handed_out == 1
    finally:
        pool.close()
    assert sum(child.closed for child in restores.children) == 2  # the two nobody took
    assert not child.closed


def test_a_dead_ready_child_is_discarded_not_handed_out() -> None:
    restores = FakeRestores()
    pool = make_pool(restores, 1, cpus=2)
    try:
        eventually(lambda: len(pool) == 1)
        restores.children[0].dead = True
        child = pool.take()
        assert child is None or child is not restores.children[0]
        assert restores.children[0].closed
    finally:
        pool.close()


def test_a_take_waits_for_the_restore_in_flight() -> None:
    restores = FakeRestores(gated=True)
    pool = make_pool(restores, 1, cpus=2)
    taken: list[FakeChild | None] = []
    try:
        eventually(lambda: pool.in_flight == 1)
        taker = threading.Thread(target=lambda: taken.append(pool.take(wait=20)))
        taker.start()
        restores.gate.set()
        taker.join(timeout=30)
        assert taken and taken[0] is restores.children[0]
    finally:
        pool.close()


def test_a_waiting_take_lets_every_core_restore() -> None:
    restores = FakeRestores(gated=True)
    clock = FakeClock()
    pool = make_pool(restores, 1, maximum=4, cpus=2, clock=clock)
    pool.sizer.refilled(0.3)
    takes(pool.sizer, clock, 5, every=0.01)  # tests take far faster than the cores restore: the pool wants 4
    try:
        eventually(lambda: pool.in_flight == 1)  # yet one core is left to the running test
        assert pool.target == 4
        taker = threading.Thread(target=lambda: pool.take(wait=20))
        taker.start()
        eventually(lambda: restores.most_at_once == 2)  # a test waits: both cores restore
        restores.gate.set()
        taker.join(timeout=30)
    finally:
        restores.gate.set()
        pool.close()


def test_repeated_failures_stop_the_pool_and_takes_fall_back() -> None:
    restores = FakeRestores(fail=100)
    pool = make_pool(restores, 1, cpus=2)
    try:
        eventually(lambda: pool.stopped)
        assert pool.failures == MAX_FAILURES
        assert pool.take(wait=5) is None  # the caller restores its own child
    finally:
        pool.close()


def test_one_failure_is_retried() -> None:
    restores = FakeRestores(fail=1)
    pool = make_pool(restores, 1, cpus=2)
    try:
        eventually(lambda: len(pool) == 1)
        assert pool.failures == 0
    finally:
        pool.close()


def test_no_demand_no_restores() -> None:
    restores = FakeRestores()
    pool = make_pool(restores, 1, maximum=8, cpus=2, demand=lambda: 0)
    try:
        assert pool.target == 0
        assert pool.take() is None
    finally:
        pool.close()
    assert restores.count == 0


def test_prefill_readies_a_child_per_test_to_come_within_the_maximum() -> None:
    restores = FakeRestores()
    remaining = [5]
    pool = make_pool(restores, 1, maximum=8, cpus=2, demand=lambda: remaining[0])
    try:
        assert pool.prefill(timeout=30) == 5
        assert len(pool) == 5 and all(child.parked for child in restores.children)
        remaining[0] = 20
        assert pool.prefill(timeout=30) == 8  # bounded by the maximum (memory)
    finally:
        pool.close()
    assert all(child.closed for child in restores.children)


def test_a_restore_finishing_after_close_is_discarded() -> None:
    restores = FakeRestores(gated=True)
    pool = make_pool(restores, 1, cpus=2)
    eventually(lambda: pool.in_flight == 1)
    closer = threading.Thread(target=pool.close)
    closer.start()
    restores.gate.set()
    closer.join(timeout=30)
    assert restores.children and all(child.closed for child in restores.children)
    assert len(pool) == 0


def test_the_first_ready_child_resizes_the_pool_once() -> None:
    restores = FakeRestores()
    measured: list[int] = []

    def resize(child: FakeChild) -> int:
        measured.append(child.number)
        return 3

    pool = make_pool(restores, 1, maximum=8, cpus=2, demand=lambda: 10, resize=resize)
    try:
        assert pool.prefill(timeout=30) == 3  # the measured bound, not the estimate it started with
        assert len(measured) == 1  # once, with whichever child was ready first
    finally:
        pool.close()


def test_a_process_memory_is_read_from_proc() -> None:
    import os

    used = child_memory_mib(os.getpid())
    assert used is not None and used > 1
    assert child_memory_mib(2**22 + 12345) is None  # no such process


# -- restoring on an idle core ----------------------------------------------------------------------------------
def test_an_idle_core_restores_too_and_banks_for_the_tests_to_come() -> None:
    restores = FakeRestores(gated=True)
    pool = make_pool(restores, 1, maximum=8, cpus=2, demand=lambda: 5, idle=lambda: 1.0)
    try:
        eventually(lambda: restores.most_at_once == 2)  # the test's core idles: both cores restore
        assert pool.target == 5  # ahead of the measured need, up to the tests still to come
        restores.gate.set()
        eventually(lambda: len(pool) == 5)
        assert restores.count == 5  # never more than the run can take
    finally:
        restores.gate.set()
        pool.close()


def test_a_busy_core_is_left_to_the_running_test() -> None:
    restores = FakeRestores(gated=True)
    idle_asked = threading.Event()

    def busy() -> float:
        idle_asked.set()
        return 0.2

    pool = make_pool(restores, 1, maximum=8, cpus=2, demand=lambda: 5, idle=busy)
    try:
        eventually(lambda: pool.in_flight == 1)
        eventually(idle_asked.is_set)
        assert pool.target == 1  # the minimum: no measured need yet, and no idle core to bank on
        assert pool.in_flight == 1 and restores.most_at_once == 1
    finally:
        restores.gate.set()
        pool.close()


def test_an_idle_core_banks_nothing_when_the_demand_is_unknown() -> None:
    restores = FakeRestores(gated=True)
    pool = make_pool(restores, 1, maximum=8, cpus=2, idle=lambda: 2.0)
    try:
        eventually(lambda: pool.in_flight == 1)
        assert pool.target == 1  # nobody said how many children the caller will take
    finally:
        restores.gate.set()
        pool.close()


def test_an_idle_core_lets_every_core_restore() -> None:
    assert cpu_workers(2, waiting=False, idle_core=True) == 2
    assert cpu_workers(4, waiting=False, idle_core=False) == 3


def test_banking_on_idle_cores_stops_at_its_bound_per_core() -> None:
    restores = FakeRestores()
    pool = make_pool(restores, 1, maximum=100, cpus=1, demand=lambda: 50, idle=lambda: 1.0)
    try:
        eventually(lambda: len(pool) == IDLE_BANK_PER_CORE)
        assert pool.target == IDLE_BANK_PER_CORE  # not the 50 tests to come, nor the memory bound of 100
    finally:
        pool.close()
    assert restores.count == IDLE_BANK_PER_CORE
