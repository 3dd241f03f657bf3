"""VMs a test starts itself with ``pytest_forkd.boot()`` belong to the run: their timings reach its report and budgets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.vm


def test_a_vm_booted_by_the_test_records_on_the_runs_recorder(pytester: pytest.Pytester, run_forkd, tmp_path: Path):
    pytester.makepyfile(
        test_boot="""
        import pytest
        import pytest_forkd

        @pytest.mark.forkd_budget(exec_ms=0.001)
        def test_boots_its_own(forkd_budget):
            with pytest_forkd.boot() as vm:
                assert vm.exec("echo hi").stdout == "hi\\n"
        """
    )
    report = tmp_path / "report.json"
    result = run_forkd(f"--forkd-json={report}", "-rf")
    # The run's budget saw the test's own VM: its exec cannot take a microsecond.
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*ms > 0.001 ms budget (forkd_budget)*", "*exec: max*> budget 0.001 ms*"])
    samples = json.loads(report.read_text())["samples"]
    ops = {(sample["op"], sample["test"]) for sample in samples}
    assert ("boot", "test_boot.py::test_boots_its_own") in ops
    assert ("exec", "test_boot.py::test_boots_its_own") in ops
