"""The host cores this process may use, and how many of them sat idle lately.

Under TCG a child VM costs CPU, so a pool that restores children ahead of
the tests is limited by cores, not by waiting. It normally leaves one core to
the running test; but a test that sleeps, waits on a network reply or on its
guest leaves that core idle, and a run whose cores idle takes longer than
the CPU it needs. :class:`IdleCores` tells the pool when a core is idle, so
it can restore on it meanwhile (see :mod:`pytest_forkd.core.pool`).

Idle time comes from ``/proc/stat`` for the CPUs in this process's affinity
mask (a container's cpuset). Under a CPU quota (a container's ``--cpus``,
see :func:`pytest_forkd.engine.cgroup.cpu_quota`) the cores are the
quota's, and a core is idle only if the cgroup also used less than its
quota over the span: CPUs idle on the host do not help a job that has used
up its share.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Callable

from pytest_forkd.engine import cgroup
from pytest_forkd.engine.cgroup import CpuQuota

__all__ = ["IdleCores", "affinity_cpus", "usable_cores"]

#: Shortest span over which idle time is measured (``/proc/stat`` counts in 10 ms ticks).
DEFAULT_WINDOW_S = 0.05


def _affinity() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def affinity_cpus() -> int:
    """CPUs this process may run on: its affinity mask (a container's cpuset), else all of them; no quota."""
    return len(_affinity() or ()) or os.cpu_count() or 1


def usable_cores(quota: CpuQuota | None = None) -> int:
    """Cores this process may use: the CPUs of its affinity mask (a container's cpuset), at most its CPU quota.

    ``quota`` defaults to the binding quota of this process's cgroups; a
    quota of 1.5 cores counts as 2.
    """
    cpus = affinity_cpus()
    quota = quota if quota is not None else cgroup.cpu_quota()
    return cpus if quota is None else max(1, min(cpus, math.ceil(quota.cores - 1e-9)))


def read_cpu_ticks(stat: Path, cpus: set[int] | None) -> tuple[int, int] | None:
    """(all ticks, idle ticks) summed over ``cpus`` (None: the whole host), or None where none could be read.

    Idle counts ``idle`` and ``iowait``; stolen time counts as busy, since a
    hypervisor that takes the core away leaves nothing to restore on.
    """
    total = idle = matched = 0
    try:
        with open(stat, encoding="ascii") as lines:
            for line in lines:
                if not line.startswith("cpu"):
                    break
                name, *fields = line.split()
                if (name == "cpu") != (cpus is None):
                    continue
                if cpus is not None and int(name[3:]) not in cpus:
                    continue
                ticks = [int(value) for value in fields[:8]]  # guest time is already in user and nice
                total += sum(ticks)
                idle += ticks[3] + ticks[4]
                matched += 1
    except (OSError, ValueError, IndexError):
        return None
    return (total, idle) if matched else None


class IdleCores:
    """Callable: how many cores sat idle over the last measured span (None until two readings exist).

    Each call reads ``/proc/stat`` at most once per ``window`` seconds and
    otherwise returns the last figure, so the pool's refill threads may ask as
    often as they wake. The clock and the file are injectable for tests.
    """

    def __init__(
        self,
        *,
        window: float = DEFAULT_WINDOW_S,
        stat: Path = Path("/proc/stat"),
        cpus: set[int] | None = None,
        quota: CpuQuota | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._window = window
        self._stat = stat
        self._cpus = cpus if cpus is not None else _affinity()
        self._cores = len(self._cpus) if self._cpus else affinity_cpus()
        found = quota if quota is not None else (cgroup.cpu_quota() if cpus is None else None)
        self._quota = found if found is not None and found.cores < self._cores else None
        """The cgroup's CPU quota, where it allows fewer cores than the CPUs (it then bounds the idle figure)."""
        self._clock = clock
        self._last: tuple[float, int, int, float | None] | None = None
        self._idle: float | None = None

    def __call__(self) -> float | None:
        now = self._clock()
        if self._last is not None and now - self._last[0] < self._window:
            return self._idle
        reading = read_cpu_ticks(self._stat, self._cpus)
        if reading is None:
            return self._idle
        total, idle = reading
        used = self._quota.usage_s() if self._quota is not None else None
        if self._last is not None and total > self._last[1]:
            figure = self._cores * (idle - self._last[2]) / (total - self._last[1])
            previous_used = self._last[3]
            if self._quota is not None and used is not None and previous_used is not None and now > self._last[0]:
                figure = min(figure, self._quota.cores - (used - previous_used) / (now - self._last[0]))
            self._idle = max(0.0, figure)
        self._last = (now, total, idle, used)
        return self._idle
