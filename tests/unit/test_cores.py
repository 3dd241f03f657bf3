"""Cores this process may use and how many sat idle (within a CPU quota too), from files the test writes (no VM)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pytest_forkd.core.cores import IdleCores, read_cpu_ticks, usable_cores
from pytest_forkd.engine.cgroup import CpuQuota


def stat_text(cpus: list[tuple[int, int]]) -> str:
    """A /proc/stat with per-CPU (busy, idle) ticks: busy as user time, idle split into idle and iowait."""
    lines = []
    total_busy, total_idle = sum(b for b, _ in cpus), sum(i for _, i in cpus)
    lines.append(f"cpu  {total_busy} 0 0 {total_idle - total_idle // 4} {total_idle // 4} 0 0 0 0 0")
    for number, (busy, idle) in enumerate(cpus):
        lines.append(f"cpu{number} {busy} 0 0 {idle - idle // 4} {idle // 4} 0 0 0 0 0")
    lines.append("intr 12345 0 0")
    return "\n".join(lines) + "\n"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_ticks_are_summed_over_the_cpus_asked_for(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(stat_text([(100, 40), (10, 200), (0, 0)]))
    assert read_cpu_ticks(stat, None) == (350, 240)  # the whole host: the aggregate line
    assert read_cpu_ticks(stat, {1}) == (210, 200)
    assert read_cpu_ticks(stat, {0, 1}) == (350, 240)


def test_stolen_time_is_busy_and_guest_time_is_not_counted_twice(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  10 0 0 50 0 0 0 40 10 0\ncpu0 10 0 0 50 0 0 0 40 10 0\n")
    assert read_cpu_ticks(stat, {0}) == (100, 50)


def test_an_unreadable_stat_gives_none(tmp_path: Path) -> None:
    assert read_cpu_ticks(tmp_path / "missing", None) is None
    (tmp_path / "garbled").write_text("cpu0 a b c\n")
    assert read_cpu_ticks(tmp_path / "garbled", {0}) is None


def test_idle_cores_come_from_the_ticks_between_two_readings(tmp_path: Path) -> None:
    stat, clock = tmp_path / "stat", Clock()
    stat.write_text(stat_text([(0, 0), (0, 0)]))
    idle = IdleCores(stat=stat, cpus={0, 1}, clock=clock, window=0.1)
    assert idle() is None  # one reading tells nothing yet
    stat.write_text(stat_text([(10, 0), (0, 10)]))  # cpu0 busy, cpu1 idle over the span
    clock.now += 0.2
    assert idle() == pytest.approx(1.0)
    stat.write_text(stat_text([(20, 0), (10, 10)]))  # both busy since
    clock.now += 0.05
    assert idle() == pytest.approx(1.0)  # within the window: the last figure, the file is not read again
    clock.now += 0.1
    assert idle() == pytest.approx(0.0)


def test_only_this_process_cpus_count(tmp_path: Path) -> None:
    stat, clock = tmp_path / "stat", Clock()
    stat.write_text(stat_text([(0, 0), (0, 0), (0, 0)]))
    idle = IdleCores(stat=stat, cpus={0}, clock=clock)
    idle()
    stat.write_text(stat_text([(10, 0), (0, 10), (0, 10)]))  # cpus 1 and 2 idle, but this process runs on 0
    clock.now += 1
    assert idle() == pytest.approx(0.0)


def test_the_real_host_gives_a_figure_within_its_cores() -> None:
    idle = IdleCores(window=0.0)
    idle()
    end = time.monotonic() + 0.05
    while time.monotonic() < end:  # let the kernel count some ticks
        pass
    figure = idle()
    assert figure is None or 0.0 <= figure <= usable_cores()
    assert usable_cores() >= 1


def test_idle_cpus_do_not_count_once_the_quota_is_used_up(tmp_path: Path) -> None:
    stat, usage = tmp_path / "stat", tmp_path / "cpu.stat"
    quota = CpuQuota(tmp_path, 2, 1.0, usage)
    clock = Clock()
    stat.write_text("cpu0 0 0 0 0 0 0 0 0 0 0\ncpu1 0 0 0 0 0 0 0 0 0 0\n")
    usage.write_text("usage_usec 1000000\n")
    idle = IdleCores(stat=stat, cpus={0, 1}, quota=quota, clock=clock, window=0.1)
    idle()
    # Over 1 s, the host's two CPUs were half idle (1 core) but the cgroup used its whole 1-core quota.
    stat.write_text("cpu0 50 0 0 50 0 0 0 0 0 0\ncpu1 50 0 0 50 0 0 0 0 0 0\n")
    usage.write_text("usage_usec 2000000\n")
    clock.now += 1.0
    assert idle() == pytest.approx(0.0)
    # The next second it used a quarter of its quota: 0.75 of a core is idle within it.
    stat.write_text("cpu0 100 0 0 100 0 0 0 0 0 0\ncpu1 100 0 0 100 0 0 0 0 0 0\n")
    usage.write_text("usage_usec 2250000\n")
    clock.now += 1.0
    assert idle() == pytest.approx(0.75)
