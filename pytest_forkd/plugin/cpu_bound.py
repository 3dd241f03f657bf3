"""How close a run came to its CPU bound: the CPU of pytest and all it started, spread over the cores, against the wall.

Under TCG every child VM costs CPU (QEMU translating guest code), so a suite
cannot finish sooner than the CPU it needs divided by the cores it may use. A
run whose wall time is near that bound was limited by the host; one well
above it left cores idle part of the time (tests waiting on something, or
children not ready when tests wanted them). The terminal summary prints both,
so users see which of the two limits their run.

The CPU counted is this process's own, that of its reaped descendants (QEMU
processes, xdist workers and the VMs they reaped: the kernel adds a waited-for
child's CPU, with its own reaped children's, to its parent), and that of its
children still alive at the end, read from /proc. The wall time is the age of
this process, the same span the CPU was counted over. Both are read when the
session finishes, once its VMs are closed: the run's own work, not what other
plugins do afterwards for their terminal summaries.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CpuBound", "measure"]


@dataclass(frozen=True)
class CpuBound:
    """CPU seconds of the run, the cores it could use, and its wall seconds."""

    cpu_s: float
    cores: int
    wall_s: float

    @property
    def bound_s(self) -> float:
        """The shortest wall time the run's CPU allows on ``cores`` cores."""
        return self.cpu_s / max(1, self.cores)

    @property
    def ratio(self) -> float:
        """Wall time over the bound: 1.0 means every core was busy all the time."""
        return self.wall_s / self.bound_s if self.bound_s > 0 else float("inf")

    def line(self) -> str:
        return (
            f"CPU bound: pytest and its VMs used {self.cpu_s:.1f} s of CPU on {self.cores} "
            f"core{'s' if self.cores != 1 else ''}, so the run needed at least {self.bound_s:.1f} s; it took "
            f"{self.wall_s:.1f} s ({self.ratio:.2f}x the bound; near 1x the host's cores were the limit, "
            "above it they were idle part of the time)"
        )


def _clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


def _stat_fields(path: Path) -> list[str] | None:
    try:
        return path.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _live_children_cpu_s(pid: int) -> float:
    """CPU of ``pid``'s children still alive (with what they reaped themselves), from /proc/*/stat."""
    total_ticks = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(entry / "stat")
        # After the command name: state is fields[0], ppid fields[1]; utime, stime, cutime, cstime 11-14.
        if fields is None or len(fields) < 15 or fields[1] != str(pid) or fields[0] in ("Z", "X"):
            continue
        total_ticks += sum(int(value) for value in fields[11:15])
    return total_ticks / _clock_ticks()


def _process_age_s() -> float | None:
    fields = _stat_fields(Path("/proc/self/stat"))
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if fields is None or len(fields) < 20:
        return None
    return max(0.0, uptime - int(fields[19]) / _clock_ticks())


def measure() -> CpuBound | None:
    """The run so far (see the module's docstring); None where /proc cannot tell (not Linux)."""
    from pytest_forkd.core.cores import usable_cores  # the plugin loads no core module before it is used

    wall = _process_age_s()
    if wall is None:
        return None
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime + _live_children_cpu_s(os.getpid())
    return CpuBound(cpu_s=cpu, cores=usable_cores(), wall_s=wall)
