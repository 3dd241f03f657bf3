"""The terminal summary's CPU bound, from real runs: in one process and across xdist workers."""

from __future__ import annotations

import re
import time

import pytest

pytestmark = pytest.mark.vm

SUITE = """
import pytest

@pytest.mark.parametrize("n", range(4))
def test_vm(forkd_vm, n):
    assert forkd_vm.exec("echo ok").stdout == "ok\\n"
"""

LINE = re.compile(
    r"CPU bound: pytest and its VMs used (?P<cpu>[\d.]+) s of CPU on (?P<cores>\d+) cores?, so the run needed at "
    r"least (?P<bound>[\d.]+) s; it took (?P<wall>[\d.]+) s \((?P<ratio>[\d.]+)x the bound;"
)


@pytest.mark.parametrize("workers", [[], ["-p", "xdist", "-n", "2"]], ids=["one-process", "xdist"])
def test_the_summary_reports_the_runs_cpu_bound(pytester, run_forkd, workers: list[str]) -> None:
    pytester.makepyfile(test_suite=SUITE)
    result = run_forkd(*workers)
    result.assert_outcomes(passed=4)
    (match,) = [m for m in map(LINE.search, result.stdout.lines) if m]
    cpu, cores, bound, wall = (float(match[name]) for name in ("cpu", "cores", "bound", "wall"))
    # Four children restored and a snapshot built or restored: each costs QEMU CPU, which the run must count.
    assert cpu >= 0.5 and cores >= 1
    assert bound == pytest.approx(cpu / cores, abs=0.06)
    # The line prints seconds to 0.1 s and the ratio from the unrounded figures: it lies where the rounded ones allow.
    low, high = (wall - 0.05) / (bound + 0.05), (wall + 0.05) / max(bound - 0.05, 0.01)
    assert low - 0.01 <= float(match["ratio"]) <= high + 0.01
    assert wall >= bound * 0.9  # a run cannot be faster than its CPU spread over every core (rounding aside)


def test_the_bound_covers_the_run_not_other_plugins_summaries(pytester, run_forkd) -> None:
    # Another plugin that spends seconds in its terminal summary (hypothesis imports itself there) is not the run.
    pytester.makeconftest(
        """
import time
import pytest

@pytest.hookimpl(tryfirst=True)
def pytest_terminal_summary():
    time.sleep(3)
"""
    )
    pytester.makepyfile(test_suite=SUITE)
    started = time.monotonic()
    result = run_forkd()
    elapsed = time.monotonic() - started
    result.assert_outcomes(passed=4)
    (match,) = [m for m in map(LINE.search, result.stdout.lines) if m]
    assert float(match["wall"]) <= elapsed - 2.5
