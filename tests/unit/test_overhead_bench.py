"""The overhead bench (generated suite, how it reads a run's output) and the diff drift figure (no VM)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pytest_forkd.cli import bench_cmd
from pytest_forkd.cli.overhead_bench import GROUPS, figure3, overhead_by_test, summary_line, write_suite
from pytest_forkd.errors import ConfigError


def test_the_generated_suite_has_one_file_per_group_in_order(tmp_path: Path) -> None:
    paths = write_suite(tmp_path, 3)
    assert [path.name for path in paths] == sorted(path.name for path in paths)  # pytest runs them in this order
    for path, (name, ms) in zip(paths, GROUPS.items()):
        text = path.read_text()
        ast.parse(text)
        assert f"def test_sleep_{name}(forkd_vm, index)" in text
        assert "range(3)" in text and f"if {ms}:" in text


def test_the_terminal_summary_line_is_parsed() -> None:
    text = "noise\nfixture_overhead_ms per test (forkd_vm setup + teardown): p50 7.5, p95 19.0, max 250.1 (n=150)\n"
    assert summary_line(text) == {"p50": 7.5, "p95": 19.0, "max": 250.1, "n": 150.0}
    assert summary_line("no forkd summary here") is None


def test_only_fixture_overhead_samples_of_tests_count() -> None:
    samples = [
        {"op": "fixture_overhead", "ms": 12.0, "test": "t.py::test_a[0]"},
        {"op": "fork", "ms": 5.0, "test": "t.py::test_a[0]"},
        {"op": "fixture_overhead", "ms": 3.0, "test": None},
    ]
    assert overhead_by_test(samples) == {"t.py::test_a[0]": 12.0}


def test_figures_are_rounded_summaries() -> None:
    assert figure3([1.0, 2.0, 3.0]) == {"n": 3, "p50": 2.0, "p95": pytest.approx(2.9, abs=0.11), "max": 3.0}


def test_a_missing_external_suite_is_refused_before_anything_runs(tmp_path: Path) -> None:
    parser = bench_cmd.argparse.ArgumentParser()
    bench_cmd.add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--external-suite", str(tmp_path / "missing")])
    with pytest.raises(ConfigError, match="--external-suite .*missing: no such file"):
        args.run(args)


def test_diff_drift_is_the_10th_over_the_2nd_of_each_run_of_ten() -> None:
    from pytest_forkd.cli.bench import drift_ratios

    flat = [10.0] * 10
    growing = [10.0 + index for index in range(10)]  # 2nd 11, 10th 19
    assert drift_ratios(flat) == [1.0]
    assert drift_ratios(growing) == [pytest.approx(19 / 11)]
    assert drift_ratios(flat + growing + flat[:9]) == [1.0, pytest.approx(19 / 11)]  # an incomplete run is left out
    assert drift_ratios(flat[:9]) == []
