"""The run's CPU bound of the terminal summary: what is counted, and the line users read."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from pytest_forkd.plugin import cpu_bound
from pytest_forkd.plugin.cpu_bound import CpuBound

BUSY = "import time\nend = time.process_time() + 0.15\nwhile time.process_time() < end: pass\n"


def test_the_line_gives_cpu_cores_bound_wall_and_ratio() -> None:
    line = CpuBound(cpu_s=39.6, cores=2, wall_s=32.9).line()
    assert line.startswith("CPU bound: pytest and its VMs used 39.6 s of CPU on 2 cores, ")
    assert "at least 19.8 s; it took 32.9 s (1.66x the bound;" in line
    assert "on 1 core," in CpuBound(cpu_s=1.0, cores=1, wall_s=1.0).line()


def test_the_ratio_of_a_run_without_cpu_is_infinite_not_an_error() -> None:
    assert CpuBound(cpu_s=0.0, cores=2, wall_s=1.0).ratio == float("inf")


def test_reaped_children_count() -> None:
    before = cpu_bound.measure()
    subprocess.run([sys.executable, "-c", BUSY], check=True)
    after = cpu_bound.measure()
    assert before is not None and after is not None
    assert after.cpu_s - before.cpu_s >= 0.12
    assert after.wall_s >= before.wall_s and after.cores >= 1


def test_children_still_running_count() -> None:
    before, own_before = cpu_bound.measure(), time.process_time()
    child = subprocess.Popen([sys.executable, "-c", BUSY + "time.sleep(30)\n"])
    try:
        deadline = time.monotonic() + 10
        while True:  # until the child has used its 0.15 s of CPU, read from /proc as the summary does
            now = cpu_bound.measure()
            assert now is not None and before is not None
            polling = time.process_time() - own_before  # this process's own share, which is not the child's
            if now.cpu_s - before.cpu_s - polling >= 0.12:
                break
            if time.monotonic() > deadline:
                pytest.fail("a live child's CPU never showed up in the run's CPU")
            time.sleep(0.05)
        assert child.poll() is None  # still running: counted from /proc, not from the reaped usage
    finally:
        child.kill()
        child.wait()
