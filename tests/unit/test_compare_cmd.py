from __future__ import annotations

import json
import random

import pytest

from pytest_forkd.cli import main
from pytest_forkd.latency.runs import build_run, save_run
from pytest_forkd.latency.timings import Sample


def _samples(seed: int, n: int, scale: float = 1.0) -> list[Sample]:
    rng = random.Random(seed)
    return [Sample(op="fork", ms=scale * rng.lognormvariate(5.0, 0.35)) for _ in range(n)]


@pytest.fixture
def runs(tmp_path):
    """Stored runs: a baseline, a noisy rerun of the same distribution (its p95 is
    13% higher by chance), a twice-as-slow run and one with too few samples."""
    return {
        "base": save_run(tmp_path, _samples(1, 60), name="base"),
        "same": save_run(tmp_path, _samples(6, 60), name="same"),
        "slow": save_run(tmp_path, _samples(3, 60, scale=2.0), name="slow"),
        "tiny": save_run(tmp_path, _samples(4, 3, scale=10.0), name="tiny"),
    }


def test_prints_the_table_and_passes_without_thresholds(runs, capsys):
    assert main(["compare", str(runs["base"]), str(runs["slow"])]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"{runs['slow']} compared with {runs['base']}:"
    assert "n old/new" in out and "p50 ms" in out and "p95 ms" in out and "max ms" in out
    assert "fork       60/60" in out
    assert "REGRESSION" not in out


def test_noisy_equal_runs_pass(runs, capsys):
    assert main(["compare", str(runs["base"]), str(runs["same"]), "--fail", "p95:20%"]) == 0
    out = capsys.readouterr().out
    assert "REGRESSION" not in out
    assert " ok " in out


def test_a_threshold_exceeded_within_noise_passes_and_says_so(runs, capsys):
    assert main(["compare", str(runs["base"]), str(runs["same"]), "--fail", "p95:5%"]) == 0
    out = capsys.readouterr().out
    assert "slower, not significant p95:5% p=0.1" in out
    assert "REGRESSION" not in out


def test_a_slower_run_fails_with_exit_1(runs, capsys):
    assert main(["compare", str(runs["base"]), str(runs["slow"]), "--fail", "p95:20%", "--fail", "p50:5ms"]) == 1
    out = capsys.readouterr().out
    assert "REGRESSION: whole run: fork p95" in out
    assert "REGRESSION: whole run: fork p50" in out


def test_too_few_samples_pass_and_say_so(runs, capsys):
    assert main(["compare", str(runs["base"]), str(runs["tiny"]), "--fail", "p95:1%"]) == 0
    assert "insufficient samples (need 5)" in capsys.readouterr().out
    assert main(["compare", str(runs["base"]), str(runs["tiny"]), "--fail", "p95:1%", "--min-samples", "3"]) == 1


def test_different_conditions_are_warned_about_on_stderr(tmp_path, capsys):
    kvm = tmp_path / "kvm.json"
    tcg = tmp_path / "tcg.json"
    kvm.write_text(json.dumps(build_run(_samples(1, 10), conditions={"accel": "kvm"})))
    tcg.write_text(json.dumps(build_run(_samples(1, 10), conditions={"accel": "tcg"})))
    assert main(["compare", str(kvm), str(tcg)]) == 0
    err = capsys.readouterr().err
    assert err.startswith("forkd: warning: ")
    assert "conditions.accel: 'kvm' in the baseline, 'tcg' now" in err


def test_invalid_json_is_a_clear_error(runs, tmp_path, capsys):
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert main(["compare", str(runs["base"]), str(broken)]) == 4
    err = capsys.readouterr().err
    assert err.startswith(f"forkd: error: {broken}: not a forkd benchmark run: invalid JSON")


def test_a_json_file_that_is_not_a_run_is_a_clear_error(runs, tmp_path, capsys):
    other = tmp_path / "package.json"
    other.write_text('{"name": "x"}')
    assert main(["compare", str(other), str(runs["base"])]) == 4
    assert "unsupported benchmark run version None" in capsys.readouterr().err


def test_a_missing_file_is_a_clear_error(runs, tmp_path, capsys):
    assert main(["compare", str(tmp_path / "nope.json"), str(runs["base"])]) == 4
    err = capsys.readouterr().err
    assert "forkd: error: cannot read benchmark run" in err and "No such file or directory" in err


def test_a_malformed_fail_expression_is_a_clear_error(runs, capsys):
    assert main(["compare", str(runs["base"]), str(runs["same"]), "--fail", "p95>20%"]) == 4
    assert "invalid compare-fail expression 'p95>20%'" in capsys.readouterr().err


def test_min_samples_must_allow_a_test(runs, capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["compare", str(runs["base"]), str(runs["same"]), "--min-samples", "1"])
    assert excinfo.value.code == 4
    assert "need at least 2 samples" in capsys.readouterr().err
