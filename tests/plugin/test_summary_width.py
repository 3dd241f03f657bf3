"""forkd's failure messages in pytest's short summary at 80 columns, as CI logs show them (no VM needed).

pytest writes 80 columns when its output is not a terminal, and cuts each
``-rf`` line there: what failed and its figures must come first.
"""

from __future__ import annotations

import pytest

from pytest_forkd.isolate import reports as isolate_reports

SUITE = """
import pytest

@pytest.mark.forkd_budget(exec_ms=1)
def test_slow(forkd):
    forkd.timings.record("exec", 1036.0)

@pytest.mark.forkd_budget(exec_ms=1, fork_ms=2)
def test_two_limits_of_one_test(forkd):
    forkd.timings.record("exec", 31.94)
    forkd.timings.record("fork", 40.0)
"""


@pytest.fixture
def eighty_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)  # a pipe: pytest falls back to 80 columns
    for variable in ("CI", "BUILD_NUMBER"):  # on CI pytest would print the whole message
        monkeypatch.delenv(variable, raising=False)


def test_a_budget_failure_shows_the_operation_and_both_figures_in_80_columns(
    pytester: pytest.Pytester, eighty_columns: None
) -> None:
    pytester.makepyfile(test_budget=SUITE)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", f"--forkd-store={pytester.path / 'store'}", "-rf", timeout=120
    )
    result.assert_outcomes(failed=2)
    summary = {line.split()[1]: line for line in result.outlines if line.startswith("FAILED ")}
    assert all(len(line) <= 80 for line in summary.values()), summary
    assert summary["test_budget.py::test_slow"] == (
        "FAILED test_budget.py::test_slow - exec max 1036 ms > 1 ms budget (forkd_budget)"
    )
    two = summary["test_budget.py::test_two_limits_of_one_test"]
    assert two.startswith("FAILED test_budget.py::test_two_limits_of_one_test - exec max 31.9 ms > 1 ms"), two


def test_an_isolated_tests_failure_leads_with_what_failed(pytester: pytest.Pytester, eighty_columns: None) -> None:
    """The messages forkd puts in an isolated test's report start with the cause, not with the test's name."""
    (item,) = pytester.getitems("def test_x():\n    pass\n")
    from pytest_forkd.isolate.parent import timed_out

    error = timed_out(item.nodeid, 5.0, "child7", "")
    (setup, call, teardown) = isolate_reports.completed(
        item, [isolate_reports.made_here(item, "setup", "passed")], f"{type(error).__name__}: {error}"
    )
    first_line = call.longreprtext.splitlines()[0]
    assert first_line.startswith("TestTimedOut: past its timeout of 5 s"), first_line
    assert item.nodeid not in first_line[:60]
