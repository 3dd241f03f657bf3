"""Per-test latency budgets against real VMs: the test that breaks its budget fails by itself."""

from __future__ import annotations

import json
import re

import pytest

pytestmark = pytest.mark.vm

NEIGHBOURS = """
import pytest

def test_before(forkd_vm):
    assert forkd_vm.exec("true").ok

@pytest.mark.forkd_budget(exec_ms=0.001)
def test_breaks_its_budget(forkd_vm):
    assert forkd_vm.exec("true").ok

@pytest.mark.forkd_budget(exec_ms=600000, fork_ms=600000)
def test_within_a_huge_budget(forkd_vm):
    assert forkd_vm.exec("true").ok

def test_fixture_budget(forkd_vm, forkd_budget):
    forkd_budget(fork_ms=0.001)
    assert forkd_vm.exec("true").ok

@pytest.mark.forkd_budget(exec_ms=0.001)
def test_workload_is_left_out(forkd_vm):
    assert forkd_vm.exec(["sh", "-c", "echo workload"], timing="workload").stdout == "workload\\n"

def test_after(forkd_vm):
    from pytest_forkd.errors import ForkdError

    with pytest.raises(ForkdError, match="timing='bogus' is not a timing tag"):
        forkd_vm.exec("true", timing="bogus")
    assert forkd_vm.exec("true").ok
"""


@pytest.mark.parametrize("xdist", [(), ("-p", "xdist", "-n", "2")], ids=["serial", "xdist"])
def test_a_test_that_breaks_its_budget_fails_by_itself(pytester, run_forkd, tmp_path, xdist, monkeypatch):
    pytester.makepyfile(test_neighbours=NEIGHBOURS)
    report = tmp_path / "report.json"
    transcripts = tmp_path / "transcripts"
    monkeypatch.setenv("COLUMNS", "160")  # room for the short summary's whole first line
    for variable in ("CI", "BUILD_NUMBER"):  # on CI pytest prints every line of the message, not only the first
        monkeypatch.delenv(variable, raising=False)
    result = run_forkd("-rf", f"--forkd-json={report}", f"--forkd-transcript={transcripts}", *xdist)
    result.assert_outcomes(passed=4, failed=2)
    failed = sorted(line.split()[1] for line in result.outlines if line.startswith("FAILED "))
    assert failed == ["test_neighbours.py::test_breaks_its_budget", "test_neighbours.py::test_fixture_budget"]
    summary = {line.split()[1]: line for line in result.outlines if line.startswith("FAILED ")}
    assert re.fullmatch(  # the -rf line names the operation, the figure measured and the limit
        r"FAILED test_neighbours\.py::test_breaks_its_budget - exec max [0-9.]+ ms > 0\.001 ms budget \(forkd_budget\)",
        summary["test_neighbours.py::test_breaks_its_budget"],
    )
    assert summary["test_neighbours.py::test_fixture_budget"].endswith(" ms > 0.001 ms budget (forkd_budget)")
    assert " - fork max " in summary["test_neighbours.py::test_fixture_budget"]
    result.stdout.fnmatch_lines(
        [
            "*_ test_breaks_its_budget _*",
            "exec max * ms > 0.001 ms budget (forkd_budget)",
            "  exec: max * ms > budget 0.001 ms (n=1; exec_ms=0.001, marker on test_neighbours.py::test_breaks_its_budget)",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "*_ test_fixture_budget _*",
            "  fork: max * ms > budget 0.001 ms (n=1; fork_ms=0.001, fixture on test_neighbours.py::test_fixture_budget)",
        ]
    )
    document = json.loads(report.read_text())
    workload = [s for s in document["samples"] if s["op"] == "exec[workload]"]
    assert [s["test"] for s in workload] == ["test_neighbours.py::test_workload_is_left_out"]
    assert workload[0]["extra"] == {"timing": "workload"}
    assert {s["extra"]["timing"] for s in document["samples"] if s["op"] == "exec"} == {"harness"}
    assert "exec[workload]" in document["operations"]
    assert any(line.startswith("exec[workload]  ") for line in result.outlines)
    outcomes = {}
    for path in transcripts.glob("*.jsonl"):
        header = json.loads(path.read_text().splitlines()[0])
        outcomes[header["test"].split("::")[1]] = header["outcome"]
    assert outcomes["test_breaks_its_budget"] == "failed" and outcomes["test_before"] == "passed"
