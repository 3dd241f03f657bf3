"""Per-test budgets and the strict compare gate, driven by recorded samples (no VM needed).

The inner tests record timing samples themselves on the session's recorder (``forkd.timings``),
where the VMs of the session report theirs, so each outcome is deterministic.
"""

from __future__ import annotations

import json

import pytest

SUITE = """
import pytest

@pytest.fixture
def slow_teardown(forkd):
    yield
    forkd.timings.record("exec", 7.0)

def test_before(forkd):
    forkd.timings.record("exec", 5.0)

@pytest.mark.forkd_budget(exec_ms=6)
def test_broken_by_its_teardown(forkd, slow_teardown):
    forkd.timings.record("exec", 5.0)

@pytest.mark.forkd_budget(exec_ms=60000, fork_ms=60000)
def test_within_a_huge_budget(forkd):
    forkd.timings.record("exec", 5.0)
    forkd.timings.record("fork", 50.0)

def test_fixture_budget(forkd, forkd_budget):
    forkd_budget(fork_ms=1)
    forkd.timings.record("fork", 2.5)

@pytest.mark.forkd_budget(exec_ms=1)
def test_workload_is_left_out(forkd):
    forkd.timings.record("exec[workload]", 500.0)

def test_after(forkd):
    forkd.timings.record("exec", 5.0)
"""


@pytest.fixture
def run(pytester: pytest.Pytester, tmp_path):
    store = tmp_path / "store"

    def run(*args: str) -> pytest.RunResult:
        return pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--forkd-store={store}", *args, timeout=120)

    return run


@pytest.mark.parametrize("xdist", [(), ("-p", "xdist", "-n", "2")], ids=["serial", "xdist"])
def test_a_broken_budget_fails_only_its_test_naming_operation_and_figure(pytester, run, xdist):
    pytester.makepyfile(test_budgets=SUITE)
    result = run("-rf", *xdist)
    result.assert_outcomes(passed=4, failed=2)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    failed = sorted(line.split()[1] for line in result.outlines if line.startswith("FAILED "))
    assert failed == ["test_budgets.py::test_broken_by_its_teardown", "test_budgets.py::test_fixture_budget"]
    result.stdout.fnmatch_lines(
        [
            "*_ test_broken_by_its_teardown _*",
            "exec max 7 ms > 6 ms budget (forkd_budget)",
            "  exec: max 7.000 ms > budget 6 ms (n=2; exec_ms=6, marker on test_budgets.py::test_broken_by_its_teardown)",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "*_ test_fixture_budget _*",
            "fork max 2.5 ms > 1 ms budget (forkd_budget)",
            "  fork: max 2.500 ms > budget 1 ms (n=1; fork_ms=1, fixture on test_budgets.py::test_fixture_budget)",
        ]
    )
    assert "ERROR" not in result.stdout.str()


def test_the_short_summary_names_the_first_limit_exceeded_and_both_figures(pytester, run, monkeypatch):
    """``-rf`` shows only the first line of a failure: it names the operation, the figure and the limit."""
    pytester.makepyfile(
        test_two="""
        import pytest

        @pytest.mark.forkd_budget(exec_ms=1, fork_ms=2)
        def test_two_limits(forkd):
            forkd.timings.record("exec", 31.94)
            forkd.timings.record("fork", 40.0)
    """
    )
    monkeypatch.setenv("COLUMNS", "160")  # room for the whole line; pytest cuts it to the terminal's width
    monkeypatch.delenv("CI", raising=False)  # on CI pytest prints the whole message, not only its first line
    monkeypatch.delenv("BUILD_NUMBER", raising=False)
    result = run("-rf")
    result.assert_outcomes(failed=1)
    summary = [line for line in result.outlines if line.startswith("FAILED ")]
    assert summary == ["FAILED test_two.py::test_two_limits - exec max 31.9 ms > 1 ms budget (forkd_budget, 1 more)"]
    result.stdout.fnmatch_lines(
        [
            "exec max 31.9 ms > 1 ms budget (forkd_budget, 1 more)",
            "  exec: max 31.940 ms > budget 1 ms *",
            "  fork: max 40.000 ms > budget 2 ms *",
        ]
    )


def test_a_failing_test_keeps_its_own_failure_and_gets_the_budget_as_a_section(pytester, run):
    pytester.makepyfile(
        test_both="""
        import pytest

        @pytest.mark.forkd_budget(exec_ms=1)
        def test_fails_and_is_slow(forkd):
            forkd.timings.record("exec", 5.0)
            assert False, "the test's own failure"
    """
    )
    result = run()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*the test's own failure*", "*forkd_budget*", "*exec: max 5.000 ms > budget 1 ms*"])


def test_session_fixture_work_is_charged_to_no_test(pytester, run, tmp_path):
    pytester.makepyfile(
        test_session="""
        import pytest

        @pytest.fixture(scope="session")
        def prepared(forkd):
            forkd.timings.record("exec", 900.0)

        @pytest.mark.forkd_budget(exec_ms=10)
        def test_first_to_use_it(forkd, prepared):
            forkd.timings.record("exec", 5.0)
    """
    )
    report = tmp_path / "report.json"
    result = run(f"--forkd-json={report}")
    result.assert_outcomes(passed=1)
    assert {(s["ms"], s["test"]) for s in json.loads(report.read_text())["samples"]} == {
        (900.0, None),
        (5.0, "test_session.py::test_first_to_use_it"),
    }


def test_a_budget_on_an_unknown_operation_names_the_key(pytester, run):
    pytester.makepyfile(
        test_typo="""
        def test_fixture_typo(forkd_budget):
            forkd_budget(forks_ms=10)
    """
    )
    result = run()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*ConfigError: forkd_budget fixture on test_typo.py::test_fixture_typo: "
            "unknown argument 'forks_ms'; did you mean 'fork_ms'? valid arguments: fork_ms, *"
        ]
    )

    pytester.makepyfile(
        test_typo="""
        import pytest

        @pytest.mark.forkd_budget(exec_msec=10)
        def test_marker_typo():
            pass
    """
    )
    result = run()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "forkd_budget marker on test_typo.py::test_marker_typo: unknown argument 'exec_msec'" in result.stderr.str()


RECORDING = """
def test_records(forkd):
    for ms in (20.0, 21.0, 22.0, 23.0, 24.0, 25.0):
        forkd.timings.record("fork", ms, backend="{backend}")
"""


def test_compare_strict_refuses_another_backend(pytester, run):
    pytester.makepyfile(test_rec=RECORDING.format(backend="diff"))
    assert run("--forkd-backend=diff", "--forkd-save=first").ret == pytest.ExitCode.OK

    pytester.makepyfile(test_rec=RECORDING.format(backend="full"))
    warned = run("--forkd-backend=full", "--forkd-compare=first")
    assert warned.ret == pytest.ExitCode.OK
    warned.stdout.fnmatch_lines(["*warning:*backend*"])

    refused = run("--forkd-backend=full", "--forkd-compare=first", "--forkd-compare-strict")
    refused.assert_outcomes(passed=1)
    assert refused.ret == pytest.ExitCode.TESTS_FAILED
    refused.stdout.fnmatch_lines(
        ["*--forkd-compare-strict: refusing to compare*backend: 'diff' in the baseline, 'full' now*"]
    )


def test_a_several_fold_slowdown_fails_the_compare_gate(pytester, run):
    pytester.makepyfile(test_rec=RECORDING.format(backend="diff"))
    assert run("--forkd-backend=diff", "--forkd-save=first").ret == pytest.ExitCode.OK
    pytester.makepyfile(test_rec=RECORDING.format(backend="diff").replace("ms, backend", "ms * 5.25, backend"))
    result = run(
        "--forkd-backend=diff", "--forkd-compare=first", "--forkd-compare-fail=p95:20%", "--forkd-compare-strict"
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*REGRESSION: whole run: fork p95 *(+425.0%)*"])
