"""pytest-xdist: the controller gathers each worker's timing samples, budgets, snapshot builds and kept VMs.

Every worker collects every test, so each sends every test's marker budgets:
the controller keeps one of each.

Each worker is a pytest process with its own forkd session (its own warm
parent); at the end it sends what it recorded through xdist's
``workeroutput`` (see :func:`pytest_forkd.plugin.hooks.pytest_sessionfinish`),
and the controller judges budgets and prints the summary over all of them.
"""

from __future__ import annotations

import json
from typing import Any, Final

import pytest

from pytest_forkd.plugin.state import KeptVM, RunState

#: Key of a worker's results in xdist's ``workeroutput``.
WORKER_OUTPUT_KEY: Final = "forkd"


class XdistHooks:
    """Controller side of pytest-xdist, registered only when xdist is installed."""

    def __init__(self, state: RunState) -> None:
        self.state = state

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: object) -> None:
        from pytest_forkd.latency.budgets import Budget
        from pytest_forkd.latency.timings import Recorder

        output = getattr(node, "workeroutput", {}).get(WORKER_OUTPUT_KEY)
        if output is None:
            self.state.worker_died |= error is not None
            return
        data = json.loads(output)
        worker = Recorder.from_json(data["samples"])
        self.state.recorder.extend(worker.samples(), worker.build_samples())
        known = set(self.state.marker_budgets)  # every worker collects every test, and so sends every marker
        self.state.marker_budgets += [
            budget for budget in (Budget(**fields) for fields in data["marker_budgets"]) if budget not in known
        ]
        self.state.build_events += data["build_events"]
        self.state.kept += [KeptVM(**kept) for kept in data["kept"]]
