"""The pool as a suite sees it: prefilled ahead of the tests, and the overhead bench read from real runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_forkd.cli.overhead_bench import GROUPS, measure_overhead

SUITE = """
import pytest

@pytest.mark.parametrize("n", range(4))
def test_vm(forkd_vm, n):
    assert forkd_vm.exec("echo ok").stdout == "ok\\n"
"""


@pytest.mark.vm
def test_prefill_readies_a_child_for_every_test_before_the_first(pytester, run_forkd, tmp_path: Path) -> None:
    pytester.makepyfile(test_suite=SUITE)
    timings = tmp_path / "timings.json"
    result = run_forkd("--forkd-pool-prefill", f"--forkd-json={timings}")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(
        [
            "*pool prefill: 4 children of 'base' ready in * s before the first test (session cost*",
            "*fixture_overhead_ms per test (forkd_vm setup + teardown): p50 *(n=4)*",
        ]
    )
    forks = [sample for sample in json.loads(timings.read_text())["samples"] if sample["op"] == "fork"]
    assert len(forks) == 4 and all(sample["extra"]["pooled"] for sample in forks)  # every test got a ready child


def test_pool_prefill_is_a_setting(pytester, run_forkd) -> None:
    pytester.makefile(".yaml", forkd="settings:\n  pool_prefill: yes please\n")
    pytester.makepyfile(test_suite=SUITE)
    result = run_forkd()
    result.stderr.fnmatch_lines(["*settings.pool_prefill: expected true or false*"])


@pytest.mark.vm
def test_bench_reads_the_overhead_of_each_group_from_a_real_run(
    run_forkd, shared_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FORKD_STORE", str(shared_store))
    result = measure_overhead(per_group=2)
    for name in GROUPS:
        figure = result[f"overhead_{name}"]
        assert figure["n"] == 2 and 0 < figure["p50"] <= figure["p95"] <= figure["max"]
    summary = result["overhead_terminal_summary"]
    assert summary is not None and summary["n"] == 2 * len(GROUPS)  # the terminal summary shows the same tests
    assert summary["max"] == pytest.approx(max(result[f"overhead_{name}"]["max"] for name in GROUPS), abs=0.1)
