"""The latency gate: timing tags, per-test budget messages, noise-flagged changes, comparable runs, run IDs."""

from __future__ import annotations

import json
import random

import pytest

from pytest_forkd.cli import main
from pytest_forkd.errors import ConfigError, ForkdError, IncomparableRuns, InvalidArgument
from pytest_forkd.latency import timings
from pytest_forkd.latency.budgets import (
    MARKER_HELP,
    Budget,
    Violation,
    budget_from_cli,
    budgets_from_config,
    budgets_from_marker,
    check,
    violation_report,
)
from pytest_forkd.latency.compare import compare, environment_differences, parse_compare_fail, run_environment
from pytest_forkd.latency.runs import build_run, save_run
from pytest_forkd.latency.stats import NOISE_FACTOR, noise_multiple, statistic_noise
from pytest_forkd.latency.timings import Sample


def _draw(
    seed: int, n: int, scale: float = 1.0, op: str = "fork", test: str | None = None, backend: str | None = None
) -> list[Sample]:
    rng = random.Random(seed)
    return [Sample(op=op, ms=scale * rng.lognormvariate(3.0, 0.25), test=test, backend=backend) for _ in range(n)]


# --- timing tags ---------------------------------------------------------------------------


def test_workload_exec_samples_have_their_own_row():
    assert timings.tagged_op("exec", "harness") == "exec"
    assert timings.tagged_op("exec", "workload") == "exec[workload]" == timings.OP_EXEC_WORKLOAD
    assert timings.OP_EXEC_WORKLOAD in timings.KNOWN_OPS


def test_an_unknown_timing_tag_names_itself_and_the_valid_ones():
    with pytest.raises(InvalidArgument) as excinfo:
        timings.tagged_op("exec", "agent")
    assert "timing='agent'" in str(excinfo.value)
    assert "'harness'" in str(excinfo.value) and "'workload'" in str(excinfo.value)


def test_budgets_on_exec_leave_workload_samples_out():
    (budget,) = budgets_from_marker("t::a", (), {"exec_ms": 10})
    samples = [Sample("exec", 5.0, test="t::a"), Sample("exec[workload]", 5000.0, test="t::a")]
    assert check([budget], samples) == []
    (workload,) = budgets_from_marker("t::a", (), {"exec_workload_ms": 10})
    assert workload.op == "exec[workload]"
    (violation,) = check([workload], samples)
    assert violation.measured_ms == 5000.0


def test_workload_budgets_from_the_command_line_and_forkd_yaml():
    assert budget_from_cli("exec[workload].p95=300").op == "exec[workload]"
    (budget,) = budgets_from_config({"exec[workload]": {"max_ms": 100}})
    assert (budget.op, budget.stat, budget.limit_ms) == ("exec[workload]", "max", 100.0)
    assert "exec_workload_ms=None" in MARKER_HELP


# --- per-test budgets ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["marker", "fixture"])
def test_a_budget_on_an_unknown_operation_is_a_forkd_error_naming_the_key(kind):
    with pytest.raises(ForkdError) as excinfo:
        budgets_from_marker("t.py::test_x", (), {"forks_ms": 10}, kind=kind)
    message = str(excinfo.value)
    assert message.startswith(f"forkd_budget {kind} on t.py::test_x: unknown argument 'forks_ms'")
    assert "fork_ms" in message and "exec_workload_ms" in message


def test_the_failure_message_names_the_operation_and_the_figure():
    (budget,) = budgets_from_marker("t.py::test_x", (), {"exec_ms": 0.001})
    message = violation_report([Violation(budget, 3.25, 4)])
    assert message.splitlines()[0] == "exec max 3.25 ms > 0.001 ms budget (forkd_budget)"
    assert "exec: max 3.250 ms > budget 0.001 ms (n=4; exec_ms=0.001, marker on t.py::test_x)" in message


def test_the_first_line_names_the_first_limit_exceeded_and_counts_the_others():
    """pytest's short summary (-rf) shows only the first line: it must name the operation and both figures."""
    budgets = budgets_from_marker("t.py::test_x", (), {"exec_ms": 1, "fork_ms": 2})
    message = violation_report([Violation(budgets[0], 31.94, 3), Violation(budgets[1], 40.0, 1)])
    lines = message.splitlines()
    assert lines[0] == "exec max 31.9 ms > 1 ms budget (forkd_budget, 1 more)"
    assert [line.split(":")[0].strip() for line in lines[1:]] == ["exec", "fork"]


@pytest.mark.parametrize(
    ("measured", "limit", "shown"),
    [(7.0, 6, "7"), (6.0004, 6, "6.0004"), (1234.4, 1000, "1234"), (0.0532, 0.001, "0.0532")],
)
def test_the_first_line_shows_the_figure_over_its_limit(measured, limit, shown):
    (budget,) = budgets_from_marker("t.py::test_x", (), {"exec_ms": limit})
    first = violation_report([Violation(budget, measured, 1)]).splitlines()[0]
    assert first == f"exec max {shown} ms > {limit:g} ms budget (forkd_budget)"


def test_a_backend_budget_names_its_backend_in_the_first_line():
    budget = Budget("fork", "p95", 10.0, backend="diff", source="forkd.yaml budgets.fork.backends.diff.p95_ms")
    assert violation_report([Violation(budget, 12.0, 5)]).startswith(
        "fork [diff] p95 12 ms > 10 ms budget (forkd_budget)\n"
    )


# --- noise -----------------------------------------------------------------------------------


def test_noise_grows_with_the_spread_and_shrinks_with_more_samples():
    tight = [s.ms for s in _draw(1, 50)]
    wide = [v**1.5 for v in tight]
    assert statistic_noise(wide, "p50") > statistic_noise(tight, "p50") > 0
    assert statistic_noise([s.ms for s in _draw(1, 500)], "p50") < statistic_noise(tight, "p50")
    with pytest.raises(ValueError):
        statistic_noise([1.0], "p95")


def test_equal_distributions_stay_within_the_noise():
    multiples = [
        noise_multiple([s.ms for s in _draw(seed, 20)], [s.ms for s in _draw(1000 + seed, 20)], "p95")
        for seed in range(200)
    ]
    assert max(multiples) < NOISE_FACTOR


def test_a_fourfold_slowdown_is_many_times_the_noise():
    old, new = [s.ms for s in _draw(1, 10)], [s.ms for s in _draw(2, 10, scale=5.25)]
    assert noise_multiple(old, new, "p95") > NOISE_FACTOR
    assert noise_multiple(new, old, "p95") < -NOISE_FACTOR


def _suite(seed: int, slow_fork: float = 1.0, forks: int = 12) -> list[Sample]:
    """A suite of 40 tests with 12 forks and 6 execs each (160 checks with two thresholds)."""
    samples = []
    for i in range(40):
        test = f"tests/test_s.py::test_{i}"
        samples += _draw(seed * 1000 + i, forks, scale=slow_fork, op="fork", test=test)
        samples += _draw(seed * 1000 + 500 + i, 6, op="exec", test=test)
    return samples


@pytest.mark.slow  # thousands of samples through the statistics
def test_a_large_change_with_enough_samples_is_a_regression_despite_many_checks():
    thresholds = [parse_compare_fail("p95:20%"), parse_compare_fail("p50:20%")]
    comparison = compare(build_run(_suite(1)), build_run(_suite(2, slow_fork=5.25)), thresholds)
    per_test_fork = [f for f in comparison.regressions if f.op == "fork" and f.test is not None]
    assert len(per_test_fork) == 40 * 2  # every test's fork p95 and p50: +425%
    assert not [f for f in comparison.regressions if f.op == "exec"]
    finding = next(f for f in per_test_fork if f.threshold.stat == "p95")
    assert finding.beyond_noise and finding.delta_pct > 200
    whole_run = {f.threshold.stat: f for f in comparison.regressions if f.op == "fork" and f.test is None}
    assert set(whole_run) == {"p95", "p50"} and whole_run["p95"].noise_multiple > 10


def test_few_samples_per_test_still_flag_the_whole_run():
    """With 3 forks per test the per-test rows have too few samples, but the run's 120 do."""
    thresholds = [parse_compare_fail("p95:20%")]
    comparison = compare(build_run(_suite(1, forks=3)), build_run(_suite(2, slow_fork=5.25, forks=3)), thresholds)
    (regression,) = [f for f in comparison.regressions if f.op == "fork"]
    assert regression.test is None and regression.beyond_noise


def test_an_unchanged_suite_is_neither_flagged_nor_regressed():
    thresholds = [parse_compare_fail("p95:20%"), parse_compare_fail("p50:20%")]
    comparison = compare(build_run(_suite(1)), build_run(_suite(2)), thresholds)
    assert comparison.regressions == []
    assert comparison.flagged == []


def test_a_large_change_is_flagged_even_without_a_threshold():
    comparison = compare(build_run(_draw(1, 12)), build_run(_draw(2, 12, scale=5.25)))
    (row,) = comparison.rows
    assert row.flagged and row.verdict.startswith("SLOWER p95 ")
    assert comparison.regressions == []
    table = comparison.format_table()
    assert "SLOWER: whole run: fork p95" in table and "x the measured noise" in table


# --- comparable runs --------------------------------------------------------------------------


def _run(backend: str = "diff", accel: str = "tcg", qemu: str = "7.2.0", sample_backend: str | None = None) -> dict:
    document = build_run(
        _draw(1, 10, backend=sample_backend or backend),
        conditions={"accel": accel, "backend": backend},
        qemu_version=qemu,
    )
    return document


def test_run_environment_names_machine_accelerator_backends_and_qemu():
    environment = run_environment(_run(backend="diff", sample_backend="full"))
    assert environment["accelerator"] == "tcg"
    assert environment["backend"] == "diff, full"
    assert environment["QEMU version"] == "7.2.0"
    assert environment["machine"]["cores"]


@pytest.mark.parametrize(
    ("changed", "named"),
    [
        ({"backend": "uffd"}, "backend: 'diff' in the baseline, 'uffd' now"),
        ({"accel": "kvm"}, "accelerator: 'tcg' in the baseline, 'kvm' now"),
        ({"qemu": "10.0.0"}, "QEMU version: '7.2.0' in the baseline, '10.0.0' now"),
    ],
)
def test_different_environments_warn_and_strict_refuses(changed, named):
    old, new = _run(), _run(**changed)
    assert environment_differences(old, new) == [named]
    comparison = compare(old, new)
    assert comparison.environment_differences == [named]
    assert comparison.warnings
    with pytest.raises(IncomparableRuns) as excinfo:
        compare(old, new, strict=True)
    assert named in str(excinfo.value) and "refusing to compare" in str(excinfo.value)
    assert isinstance(excinfo.value, ConfigError)


def test_a_different_machine_is_named_field_by_field():
    old, new = _run(), _run()
    new["machine_info"] = dict(new["machine_info"], cpu="Other CPU", cores=64)
    (difference,) = environment_differences(old, new)
    assert difference.startswith("machine: ") and "cpu" in difference and "-> 64" in difference
    with pytest.raises(IncomparableRuns):
        compare(old, new, strict=True)


def test_a_backend_only_the_samples_name_is_warned_about():
    old, new = _run(backend="diff"), _run(backend="diff", sample_backend="uffd")
    comparison = compare(old, new)
    assert any("different storage backends" in warning and "uffd" in warning for warning in comparison.warnings)


def test_same_environment_compares_strictly():
    assert compare(_run(), _run(), strict=True).environment_differences == []


# --- forkd compare with run IDs --------------------------------------------------------------


@pytest.fixture
def stored(tmp_path):
    save_run(tmp_path, _draw(1, 20), name="first", conditions={"accel": "tcg", "backend": "diff"})
    save_run(tmp_path, _draw(2, 20, scale=5.25), name="second", conditions={"accel": "tcg", "backend": "diff"})
    save_run(tmp_path, _draw(3, 20), name="third", conditions={"accel": "tcg", "backend": "uffd"})
    return tmp_path


def test_compare_accepts_run_ids(stored, monkeypatch, capsys):
    monkeypatch.chdir(stored)
    assert main(["compare", "0001", "0002", "--fail", "p95:20%"]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "0002 compared with 0001:"
    assert "REGRESSION: whole run: fork p95" in out


def test_compare_finds_the_runs_from_a_subdirectory(stored, monkeypatch, capsys):
    (stored / "tests" / "unit").mkdir(parents=True)
    monkeypatch.chdir(stored / "tests" / "unit")
    assert main(["compare", "1", "2"]) == 0
    assert "SLOWER: whole run: fork p95" in capsys.readouterr().out


def test_compare_accepts_names_stems_and_paths_mixed(stored, capsys):
    second = next(stored.glob(".forkd/benchmarks/*/0002_second.json"))
    assert main(["compare", "first", str(second), "--root", str(stored)]) == 0
    assert main(["compare", "0001_first", "2", "--root", str(stored)]) == 0
    assert "SLOWER" in capsys.readouterr().out


def test_an_unknown_run_id_names_it_and_the_stored_runs(stored, capsys):
    assert main(["compare", "0009", "0001", "--root", str(stored)]) == 4
    err = capsys.readouterr().err
    assert "no run '0009'" in err and "0001_first" in err and "0003_third" in err


def test_compare_strict_refuses_another_backend(stored, capsys):
    assert main(["compare", "1", "3", "--root", str(stored)]) == 0
    assert "backend: 'diff' in the baseline, 'uffd' now" in capsys.readouterr().err
    assert main(["compare", "1", "3", "--root", str(stored), "--strict"]) == 4
    err = capsys.readouterr().err
    assert err.startswith("forkd: error: refusing to compare 3 with 1") and "backend" in err


def test_run_files_written_by_save_are_plain_json(stored):
    for path in stored.glob(".forkd/benchmarks/*/*.json"):
        assert json.loads(path.read_text())["conditions"]["accel"] == "tcg"


def test_five_tight_samples_on_a_busier_machine_are_left_to_the_permutation_test():
    """Seen on a shared 2-core host: a test's 5 execs all doubled because the machine got busier."""
    old = build_run([Sample("exec", ms, test="t::a") for ms in (40.4, 41.0, 42.3, 45.1, 47.3)])
    new = build_run([Sample("exec", ms, test="t::a") for ms in (80.1, 82.9, 84.0, 101.0, 107.0)])
    comparison = compare(old, new, [parse_compare_fail("p95:50%")])
    assert all(not row.flagged for row in comparison.rows)
    assert all(finding.noise_multiple == 0.0 for row in comparison.rows for finding in row.findings)
