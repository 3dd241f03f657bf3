"""A pool of pre-restored children of one snapshot, refilled in parallel and ahead of demand.

Restoring a child costs ~250 ms of QEMU CPU under TCG (process start, then
the guest's first replies while TCG translates its code for the first time),
and nearly all of it is CPU: a refill cannot go faster than the host's cores
allow. A pool hides that cost from a test only when the child is restored
before the test asks for it, so the pool:

- restores on several threads at once (each restore is its own QEMU process,
  so the cores really work in parallel), leaving one core to the running test
  unless a test is already waiting for a child, in which case every core
  refills;
- restores on that core too, and ahead of the measured need, while it sits
  idle (the test sleeps or waits on its guest; :class:`~pytest_forkd.core.cores.IdleCores` reads
  that from ``/proc/stat``): a child restored on a core that would have idled
  is one the rest of the run does not wait for (bounded by the tests still
  to come, by memory and by :data:`IDLE_BANK_PER_CORE`);
- sizes itself by Little's law from the measured interval between takes and
  the measured refill time (:class:`PoolSizer`): children ready = refill time
  / take interval, plus one; when tests consume children faster than the
  cores can restore them it banks as many as it may, since every child ready
  before a burst of short tests is a test that does not wait;
- never keeps more than the tests still to come can use (``demand``), nor
  more than memory allows (:func:`memory_bound`);
- parks every ready child paused (QMP ``stop``): an idle running child costs
  ~2.5% of a core under TCG, which a pool of twenty would take from the tests.

A parked child is resumed when it is handed out; its guest clock is set again
on its first request (the agent adopts the host's time in a new epoch).
Children nobody took are killed when the pool closes.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Generic, TypeVar

from pytest_forkd.core.cores import usable_cores
from pytest_forkd.engine import cgroup

if TYPE_CHECKING:
    from pytest_forkd.core.handles import VMHandle

log = logging.getLogger(__name__)

#: Estimated memory of one parked child before one was measured (RSS of a warm child, MiB).
DEFAULT_CHILD_MIB = 80
#: Share of the host's available memory a pool may fill with parked children.
MEMORY_SHARE = 0.5
#: Hard upper bound on the children one pool keeps ready.
MAX_POOL = 256
#: Consecutive failed restores after which a pool stops refilling (forks then restore on demand).
MAX_FAILURES = 3
#: Memory a filling pool leaves free (MiB): for the tests' own children and the work of their guests.
RESERVE_MIB = 256
#: Seconds a pool that found no room for another child waits before it asks again.
ROOM_RECHECK_S = 1.0
#: Idle cores (see :class:`~pytest_forkd.core.cores.IdleCores`) at which a pool also restores on the test's core.
IDLE_CORE_SHARE = 0.75
#: Children a pool banks ahead on idle cores, per core (each parked child holds ~40 MiB; prefill is not bounded so).
IDLE_BANK_PER_CORE = 8
#: Seconds a refill thread sleeps before it looks again at the wanted size and the idle cores.
REFILL_POLL_S = 0.25
#: The same while an idle-core probe is set: an idle core is worth noticing within a short test's sleep.
IDLE_POLL_S = 0.05

Child = TypeVar("Child")


def host_available_mib() -> int | None:
    """MemAvailable from /proc/meminfo in MiB (None when it cannot be read)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_memory_mib() -> int | None:
    """Memory this process may still use, in MiB (None when unknown).

    The host's MemAvailable, or less: the room left under the memory limit
    of the cgroup this process runs in (a container, a CI job, a systemd
    slice; see :mod:`pytest_forkd.engine.cgroup`), where going past the limit
    thrashes the page cache and then OOM-kills.
    """
    host = host_available_mib()
    limit = cgroup.memory_limit()
    if limit is None:
        return host
    return limit.free_mib if host is None else min(host, limit.free_mib)


def memory_room(child_mib: float = DEFAULT_CHILD_MIB, reserve_mib: int = RESERVE_MIB) -> bool:
    """Whether one more parked child fits and still leaves ``reserve_mib`` for the tests' own VMs."""
    available = available_memory_mib()
    return available is None or available >= child_mib + reserve_mib


def fork_memory_problem(n: int, child_mib: float = DEFAULT_CHILD_MIB) -> str | None:
    """Why ``n`` children started at once would not fit in memory (one sentence with the fix), or None."""
    available = available_memory_mib()
    if available is None or n * child_mib <= available:
        return None
    limit = cgroup.memory_limit()
    where = (
        f"the memory limit of {limit.describe()}"
        if limit is not None and limit.free_mib <= available
        else (f"the host ({available} MiB available)")
    )
    return (
        f"{n} children need about {n * child_mib:.0f} MiB (at least {child_mib:.0f} MiB each), more than "
        f"{where} leaves ({available} MiB): fork fewer at once, or give the job more memory"
    )


def memory_bound(
    child_mib: float, available_mib: int | None, *, share: float = MEMORY_SHARE, limit: int = MAX_POOL
) -> int:
    """How many parked children fit in ``share`` of the available memory, at most ``limit`` (at least 1)."""
    if available_mib is None or child_mib <= 0:
        return max(1, min(limit, 8))
    return max(1, min(limit, int(available_mib * share // child_mib)))


def cpu_workers(cpus: int | None, *, waiting: bool, idle_core: bool = False) -> int:
    """Restores that may run at once: all cores while a test waits for a child or a core idles, else all but one."""
    cores = max(1, cpus or 1)
    return cores if waiting or idle_core else max(1, cores - 1)


@dataclass
class _Ewma:
    """Exponentially weighted moving average (None until the first sample)."""

    alpha: float = 0.3
    value: float | None = None

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else self.alpha * sample + (1 - self.alpha) * self.value


class PoolSizer:
    """How many ready children a pool should hold, from the take rate and the refill time it measured.

    ``minimum`` children are kept whatever the rate; ``maximum`` is the bound
    from memory (and configuration). The clock is injectable so the policy is
    tested without VMs or sleeps.
    """

    #: Takes observed before the rate is trusted to grow the pool past ``minimum``.
    WARMUP_TAKES = 3

    def __init__(self, minimum: int, maximum: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        if minimum < 0 or maximum < minimum:
            raise ValueError(f"pool bounds must satisfy 0 <= minimum <= maximum, got {minimum} and {maximum}")
        self.minimum = minimum
        self.maximum = maximum
        self._clock = clock
        self._interval = _Ewma()
        self._refill = _Ewma()
        self._last_take: float | None = None
        self.takes = 0

    def taken(self) -> None:
        """A child was handed out (or asked for) now."""
        now = self._clock()
        if self._last_take is not None:
            self._interval.add(max(1e-6, now - self._last_take))
        self._last_take = now
        self.takes += 1

    def refilled(self, seconds: float) -> None:
        """One restore, from start to a warm child, took ``seconds`` of wall time."""
        self._refill.add(max(1e-6, seconds))

    @property
    def take_interval(self) -> float | None:
        """Seconds between takes, as now measured; grows while nobody takes (the suite slowed or ended)."""
        if self._interval.value is None or self._last_take is None:
            return None
        return max(self._interval.value, self._clock() - self._last_take)

    @property
    def refill_seconds(self) -> float | None:
        return self._refill.value

    def target(self, *, workers: int, demand: int | None = None) -> int:
        """Ready children wanted now.

        Little's law: covering a refill time R at one take per interval T
        takes R / T children in the pipe, plus one for jitter. When the
        cores (``workers`` restores at once) cannot restore a child per
        interval, no size keeps up: bank up to the maximum. ``demand`` (the
        children the rest of the run can still take) caps it.
        """
        wanted = self.minimum
        interval, refill = self.take_interval, self.refill_seconds
        if self.takes >= self.WARMUP_TAKES and interval is not None and refill is not None:
            supply_interval = refill / max(1, workers)
            if supply_interval > interval:
                wanted = self.maximum
            else:
                wanted = max(wanted, math.ceil(refill / interval) + 1)
        wanted = min(wanted, self.maximum)
        if demand is not None:
            wanted = min(wanted, max(0, demand))
        return wanted


class ChildPool(Generic[Child]):
    """Keeps ready children made by ``launch``, refilled by background threads.

    ``size`` is the minimum kept ready; with ``maximum`` above it the pool
    grows with the measured demand (:class:`PoolSizer`). ``park`` is called
    on each child once it is ready (the factory pauses it), ``unpark`` when it
    is handed out, ``usable`` tells a child that died while parked. ``demand``
    returns how many more children the run may take (None: unknown).
    ``resize`` is asked once, with the first ready child, for a new maximum
    (from the memory that child really uses; None keeps the maximum).
    ``room`` is asked before each restore whether memory holds one more
    child (:func:`memory_room`, which knows the cgroup's limit); while it says
    no, the pool keeps fewer children ready instead of pushing the host or
    container into thrashing or OOM kills, and a prefill ends with what fits.
    ``idle`` returns the cores that sat idle lately (:class:`~pytest_forkd.core.cores.IdleCores`;
    None: unknown); while at least :data:`IDLE_CORE_SHARE` of one idles and
    ``demand`` is known, the pool restores on every core and ahead of the
    measured need, up to ``demand``, ``maximum`` and
    :data:`IDLE_BANK_PER_CORE` children a core.
    """

    def __init__(
        self,
        launch: Callable[[], Child],
        size: int,
        name: str = "pool",
        *,
        maximum: int | None = None,
        park: Callable[[Child], None] = lambda child: None,
        unpark: Callable[[Child], None] = lambda child: None,
        usable: Callable[[Child], bool] = lambda child: True,
        discard: Callable[[Child], None] | None = None,
        demand: Callable[[], int | None] = lambda: None,
        resize: Callable[[Child], int | None] | None = None,
        room: Callable[[], bool] | None = None,
        idle: Callable[[], float | None] | None = None,
        cpus: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        start: bool = True,
    ) -> None:
        self.size = size
        self.name = name
        self.sizer = PoolSizer(size, max(size, maximum if maximum is not None else size), clock=clock)
        self.cpus = cpus if cpus is not None else usable_cores()
        self._launch = launch
        self._park = park
        self._unpark = unpark
        self._usable = usable
        self._discard = discard or (lambda child: child.close())  # type: ignore[attr-defined]
        self._demand = demand
        self._resize = resize
        self._room = room
        self._idle = idle
        self._room_checked = -math.inf
        self.memory_capped = False
        """True while ``room`` says memory holds no more children: the pool keeps fewer ready than it wants."""
        self._measuring = resize is not None
        """Until the first child is measured the maximum is an estimate: restore no more than the cores do."""
        self._clock = clock
        self._ready: deque[Child] = deque()
        self._in_flight = 0
        self._waiting = 0
        self._ahead = False
        """Prefill mode: keep a child ready for every take still to come (bounded by ``maximum``)."""
        self._prefilling = False
        self._cond = threading.Condition()
        self._closed = False
        self.failures = 0
        """Consecutive failed restores; at MAX_FAILURES the pool stops refilling."""
        self.launched = 0
        self.handed_out = 0
        self._threads: list[threading.Thread] = []
        if start and size >= 0 and self.sizer.maximum > 0:
            self._ensure_workers()

    # -- what callers see -------------------------------------------------------------------------------
    def __len__(self) -> int:
        with self._cond:
            return len(self._ready)

    @property
    def in_flight(self) -> int:
        """Restores running now."""
        with self._cond:
            return self._in_flight

    @property
    def target(self) -> int:
        with self._cond:
            return self._target_locked()

    @property
    def stopped(self) -> bool:
        """True once the pool closed or gave up after repeated failures."""
        with self._cond:
            return self._closed or self.failures >= MAX_FAILURES

    def take(self, wait: float = 0.0) -> Child | None:
        """A ready child, resumed; or None when there is none (the caller then restores one itself).

        With ``wait`` > 0 and a restore in flight, wait up to ``wait``
        seconds for it rather than start a competing restore: on a host with
        few cores the in-flight one finishes first.
        """
        deadline = self._clock() + max(0.0, wait)
        dead: list[Child] = []
        with self._cond:
            self.sizer.taken()
            self._cond.notify_all()
            while True:
                child = self._pop_usable_locked(dead)
                if child is not None:
                    break
                remaining = deadline - self._clock()
                if remaining <= 0 or self._closed or self.failures >= MAX_FAILURES:
                    break
                self._waiting += 1
                try:
                    if self._in_flight == 0 and not self._wants_restore_locked():
                        break  # nothing is coming: the caller restores its own child
                    self._cond.notify_all()  # let every core refill while a test waits
                    self._cond.wait(timeout=min(remaining, 0.5))
                finally:
                    self._waiting -= 1
            self._cond.notify_all()  # a slot is free (or a test gave up waiting): refill
        for corpse in dead:
            self._discard(corpse)
        if child is None:
            return None
        try:
            self._unpark(child)
        except Exception:  # noqa: BLE001 - a child that cannot resume is replaced by a fresh restore
            log.warning("resuming a pooled child failed", exc_info=True)
            self._discard(child)
            return None
        return child

    def prefill(self, timeout: float) -> int:
        """Fill the pool ahead of the run: a child for every take ``demand`` announces, at most ``maximum``.

        Blocks until they are ready (all cores restore meanwhile), the pool
        stops after failures, or ``timeout`` seconds pass; from then on the
        pool keeps that many ready as long as takes remain. Returns the
        number of ready children.
        """
        deadline = self._clock() + timeout
        with self._cond:
            self._ahead = self._prefilling = True
            self._cond.notify_all()
            try:
                while (
                    len(self._ready) < self._target_locked()
                    and not self._closed
                    and self.failures < MAX_FAILURES
                    and not (self.memory_capped and self._in_flight == 0)
                    and self._clock() < deadline
                ):
                    self._cond.wait(timeout=0.25)
            finally:
                self._prefilling = False
                self._cond.notify_all()
            return len(self._ready)

    def close(self) -> None:
        """Stop refilling and kill every child nobody took (restores in flight are killed as they finish)."""
        with self._cond:
            self._closed = True
            ready, self._ready = list(self._ready), deque()
            self._cond.notify_all()
            threads = list(self._threads)
        for child in ready:
            self._discard(child)
        current = threading.current_thread()
        for thread in threads:
            if thread is not current and thread.is_alive():
                thread.join(timeout=60)

    def _pop_usable_locked(self, dead: list[Child]) -> Child | None:
        while self._ready:
            child = self._ready.popleft()
            if self._usable(child):
                self.handed_out += 1
                return child
            dead.append(child)
        return None

    # -- refilling -----------------------------------------------------------------------------------------
    def _measure_once(self, child: Child) -> tuple[bool, int | None]:
        """(whether this child was the one measured, the new maximum or None to keep the estimate)."""
        with self._cond:
            resize, self._resize = self._resize, None
        if resize is None:
            return False, None
        try:
            return True, resize(child)
        except Exception:  # noqa: BLE001 - keep the estimate the pool started with
            log.warning("measuring a pooled child's memory failed", exc_info=True)
            return True, None

    def _all_cores(self) -> bool:
        return self._waiting > 0 or self._prefilling

    def _core_idles_locked(self, demand: int | None) -> bool:
        """Whether a core sits idle now and the run still has tests to restore children for."""
        if self._idle is None or demand is None or demand <= 0:
            return False
        idle = self._idle()
        return idle is not None and idle >= IDLE_CORE_SHARE

    def _target_locked(self) -> int:
        return self._sizing_locked()[0]

    def _sizing_locked(self) -> tuple[int, int]:
        """(children wanted ready, restores that may run at once)."""
        demand = self._demand()
        idle_core = self._core_idles_locked(demand)
        workers = cpu_workers(self.cpus, waiting=self._all_cores(), idle_core=idle_core)
        target = self.sizer.target(workers=workers, demand=demand)
        if self._ahead:
            target = max(target, self.sizer.maximum if demand is None else min(demand, self.sizer.maximum))
        elif idle_core and demand is not None:
            target = max(target, min(demand, self.sizer.maximum, IDLE_BANK_PER_CORE * max(1, self.cpus)))
        if self._waiting:  # a test is waiting now: at least one child for it
            target = max(target, min(self.sizer.maximum, self._waiting))
        return target, workers

    def _wants_restore_locked(self) -> bool:
        if self._closed or self.failures >= MAX_FAILURES:
            return False
        target, workers = self._sizing_locked()
        if self._in_flight >= workers:
            return False
        if self._measuring and len(self._ready) + self._in_flight >= workers:
            return False
        return len(self._ready) + self._in_flight < target and self._has_room_locked()

    def _has_room_locked(self) -> bool:
        """Whether memory holds another child; asked at most once per :data:`ROOM_RECHECK_S` after a no."""
        if self._room is None:
            return True
        if self.memory_capped and self._clock() - self._room_checked < ROOM_RECHECK_S:
            return False
        self._room_checked = self._clock()
        capped = not self._room()
        if capped and not self.memory_capped:
            log.info("pool %s: no memory for more ready children; keeping %d", self.name, len(self._ready))
        self.memory_capped = capped
        return not capped

    def _ensure_workers(self) -> None:
        with self._cond:
            self._threads = [t for t in self._threads if t.is_alive()]
            for index in range(len(self._threads), max(1, self.cpus)):
                thread = threading.Thread(target=self._refill, name=f"forkd-{self.name}-refill{index}", daemon=True)
                self._threads.append(thread)
                thread.start()

    def _refill(self) -> None:
        while True:
            with self._cond:
                while not self._wants_restore_locked():
                    if self._closed or self.failures >= MAX_FAILURES:
                        return
                    # The wanted size moves with time (and idle cores) as well as with takes.
                    self._cond.wait(timeout=REFILL_POLL_S if self._idle is None else IDLE_POLL_S)
                self._in_flight += 1
            started = self._clock()
            child: Child | None = None
            try:
                child = self._launch()
                self._park(child)
            except Exception:  # noqa: BLE001 - a pool is an optimisation; forks still work without it
                if child is not None:
                    self._discard(child)
                with self._cond:
                    self._in_flight -= 1
                    closing = self._closed
                    if not closing:
                        self.failures += 1
                    self._cond.notify_all()
                if not closing:  # a restore cut short by the pool's own close is no failure
                    log.warning("pre-restoring a pooled child failed", exc_info=True)
                continue
            measured, resized = self._measure_once(child)
            surplus: list[Child] = []
            with self._cond:
                if resized is not None:
                    self.sizer.maximum = max(self.sizer.minimum, resized)
                if measured:
                    self._measuring = False
                self._in_flight -= 1
                self.launched += 1
                self.failures = 0
                self.sizer.refilled(self._clock() - started)
                if self._closed:
                    closed = True
                else:
                    closed = False
                    self._ready.append(child)
                    while len(self._ready) > self.sizer.maximum:  # restored before the measured bound was known
                        surplus.append(self._ready.pop())
                self._cond.notify_all()
            for extra in surplus:
                self._discard(extra)
            if closed:
                self._discard(child)
                return


def child_memory_mib(pid: int) -> float | None:
    """Memory one more process like ``pid`` costs, in MiB: its private pages (USS), else its Pss or Rss.

    Pages it shares with its siblings (the snapshot's memory file in the page
    cache, QEMU's code) are paid once for all of them.
    """
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as rollup:
            fields = {}
            for line in rollup:
                key, _, value = line.partition(":")
                if value.strip().endswith("kB"):
                    fields[key] = int(value.split()[0])
        if "Private_Clean" in fields and "Private_Dirty" in fields:
            return (fields["Private_Clean"] + fields["Private_Dirty"]) / 1024
        for key in ("Pss", "Rss"):
            if key in fields:
                return fields[key] / 1024
    except (OSError, ValueError):
        return None
    return None


def park_vm(vm: "VMHandle") -> None:
    """Pause a warm pooled child: a paused QEMU costs no CPU while it waits to be handed out."""
    vm.machine.stop()


def unpark_vm(vm: "VMHandle") -> None:
    """Resume a parked child; its next request sets the guest clock to the host's (a new epoch)."""
    vm.agent.new_epoch()
    vm.machine.resume()


def vm_usable(vm: "VMHandle") -> bool:
    return not vm.closed and vm.machine.alive()


def vm_memory_bound(vm: "VMHandle") -> int | None:
    """The pool bound from the memory one parked child of it really uses (its PSS) and the host's available memory."""
    used = child_memory_mib(vm.machine.pid)
    return None if used is None else memory_bound(used, available_memory_mib())
