"""The end-of-run summary table: the budget column shows the markers' budgets, builds have their own row,
and under xdist every test's marker budget counts once although every worker collects every test."""

from __future__ import annotations

import json
from types import SimpleNamespace

from pytest_forkd.latency.budgets import Budget, describe_budgets
from pytest_forkd.latency.timings import Recorder, Sample
from pytest_forkd.plugin.report import BUILD_ROW, operations_table
from pytest_forkd.plugin.state import RunState
from pytest_forkd.plugin.xdist import WORKER_OUTPUT_KEY, XdistHooks

SUITE = Budget("exec", "max", 2000, source="--forkd-budget exec.max=2000")


def marker(test: str, limit: float) -> Budget:
    return Budget("exec", "max", limit, test=test, source=f"exec_ms={limit:g}, marker on {test}")


def test_the_budget_column_counts_the_tests_with_their_own_budget():
    budgets = [SUITE, marker("t::a", 100), marker("t::b", 100), marker("t::c", 500)]
    assert describe_budgets("exec", budgets) == "max<=2000, max<=100-500 in 3 tests"
    assert describe_budgets("exec", [marker("t::a", 100)]) == "max<=100 in 1 test"
    assert describe_budgets("fork", budgets) == "-"


def test_builds_have_their_own_row_without_a_budget():
    samples = [Sample("exec", 10.0, test="t::a"), Sample("exec", 30.0, test="t::b")]
    table = operations_table(samples, [SUITE, marker("t::a", 100)], None, builds=[3.2, 4.8])
    rows = {line.split("  ")[0]: line.split() for line in table.splitlines()[1:]}
    assert rows["exec"][1] == "2" and "max<=2000," in rows["exec"]
    assert rows[BUILD_ROW][2:7] == ["2", "4000.0", "4720.0", "4800.0", "not"]


def test_the_controller_keeps_one_of_each_marker_budget():
    state = RunState(config=None, recorder=Recorder())  # type: ignore[arg-type]
    hooks = XdistHooks(state)
    worker = Recorder()
    worker.record("exec", 12.0, test="t::a")
    with worker.building("web"):
        worker.record("exec", 3000.0)
    payload = json.dumps(
        {
            "samples": worker.to_json(),
            "marker_budgets": [vars(marker("t::a", 100)), vars(marker("t::b", 100))],
            "build_events": [],
            "kept": [],
        }
    )
    for _ in ("gw0", "gw1"):
        hooks.pytest_testnodedown(SimpleNamespace(workeroutput={WORKER_OUTPUT_KEY: payload}), None)
    assert sorted(budget.test for budget in state.marker_budgets) == ["t::a", "t::b"]
    assert len(state.recorder.samples()) == 2 and len(state.recorder.build_samples()) == 2
