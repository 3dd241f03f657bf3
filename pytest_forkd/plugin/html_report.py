"""``--forkd-report=PATH``: gather a run's timings, budgets, builds and test times, and write the HTML report.

The page itself is drawn by :mod:`pytest_forkd.latency.html_report`; this
module collects what it shows. Under pytest-xdist the controller writes it:
it receives every test's report (so each test's duration) and, when the
workers finish, their timing samples, budgets and builds (see
:mod:`pytest_forkd.plugin.xdist`); workers write nothing.
"""

from __future__ import annotations

import os
import platform
import time
from typing import TYPE_CHECKING

import pytest

from pytest_forkd.plugin.state import RunState

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_forkd.latency.budgets import Budget


class TestTimes:
    """Sums each test's setup, call and teardown durations and keeps its outcome (on the controller too)."""

    __test__ = False  # a plugin, not a test class

    def __init__(self, state: RunState) -> None:
        self.state = state

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        seconds, outcome = self.state.test_times.get(report.nodeid, (0.0, "passed"))
        if report.failed:
            outcome = "failed"
        elif report.skipped and report.when != "teardown" and outcome == "passed":
            outcome = "skipped"
        self.state.test_times[report.nodeid] = (seconds + float(report.duration or 0.0), outcome)


def check_report_path(path: str) -> None:
    """Refuse, before any test runs, a ``--forkd-report`` path that cannot be written at the end."""
    from pathlib import Path

    target = Path(path)
    problem = None
    if target.is_dir():
        problem = "it is a directory; name a file, e.g. forkd-report.html"
    else:
        parent = next((folder for folder in (target.absolute(), *target.absolute().parents) if folder.exists()), None)
        if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            problem = f"{parent} is not a writable directory; pick a path you can write"
    if problem is not None:
        raise pytest.UsageError(f"--forkd-report {path}: {problem}")


def write_html_report(config: pytest.Config, state: RunState, budgets: list[Budget], exitstatus: int) -> Path:
    """Write the report of this run to ``--forkd-report`` and return its path."""
    from pytest_forkd.latency.html_report import ReportData, TestTime, write_report

    tests = [TestTime(nodeid, seconds, outcome) for nodeid, (seconds, outcome) in state.test_times.items()]
    data = ReportData(
        samples=state.recorder.samples(),
        budgets=budgets,
        violations=state.violations,
        comparison=state.comparison,
        builds=state.build_events,
        tests=tests,
        context=_context(config, state, exitstatus),
        title=f"forkd latency report: {os.path.basename(str(config.rootpath))}",
    )
    return write_report(config.option.forkd_report, data)


def _context(config: pytest.Config, state: RunState, exitstatus: int) -> dict[str, str]:
    from pytest_forkd.plugin.report import cached_accel_verdict

    outcomes: dict[str, int] = {}
    for _, outcome in state.test_times.values():
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    context = {
        "run": f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')} on {platform.node() or 'this machine'}",
        "tests": ", ".join(f"{count} {outcome}" for outcome, count in sorted(outcomes.items())) or "none",
        "exit status": f"{int(exitstatus)}",
    }
    if state.resolved:
        settings = state.settings
        verdict = cached_accel_verdict(settings)
        context["settings"] = (
            f"snapshot {settings.snapshot}, backend {settings.backend}, "
            f"accel {verdict.accel if verdict else settings.accel}, pool {settings.pool}"
        )
    workers = sorted({str(event.get("worker")) for event in state.build_events} - {"main"})
    if workers:
        context["xdist workers"] = ", ".join(workers)
    if state.comparison is not None:
        context["baseline"] = state.comparison.baseline_label
    return context
