from __future__ import annotations

import json
import random
import re
import shutil
import subprocess

import pytest

from pytest_forkd.errors import ConfigError
from pytest_forkd.latency import runs
from pytest_forkd.latency.compare import compare, compare_with_baseline, parse_compare_fail
from pytest_forkd.latency.runs import build_run, find_baseline, list_runs, load_run, save_run, storage_dir
from pytest_forkd.latency.timings import Recorder, Sample


def _draw(seed: int, n: int, scale: float = 1.0, op: str = "fork", test: str | None = None) -> list[Sample]:
    """Latency-like samples: log-normal around 150 ms, as forks under TCG."""
    rng = random.Random(seed)
    return [Sample(op=op, ms=scale * rng.lognormvariate(5.0, 0.35), test=test) for _ in range(n)]


def _doc(*sample_lists: list[Sample], conditions: dict | None = None) -> dict:
    return build_run([s for samples in sample_lists for s in samples], conditions=conditions)


# --- storage ---------------------------------------------------------------------------


def test_machine_id_looks_like_pytest_benchmarks():
    assert re.fullmatch(r"[A-Za-z]+-[A-Za-z]+-\d+\.\d+-\d+bit", runs.machine_id())


def test_save_run_counts_up_per_machine_folder(tmp_path):
    first = save_run(tmp_path, _draw(1, 5), name="before")
    second = save_run(tmp_path, _draw(2, 5))
    assert first == tmp_path / ".forkd" / "benchmarks" / runs.machine_id() / "0001_before.json"
    assert second.name == "0002_unversioned.json"
    assert list_runs(tmp_path) == [first, second]
    assert not [p for p in storage_dir(tmp_path).iterdir() if p.name.endswith(".partial")]


def test_counter_continues_after_the_highest_existing_run(tmp_path):
    folder = storage_dir(tmp_path)
    folder.mkdir(parents=True)
    for name in ("0007_old.json", "0002_older.json", "notes.txt", "0001.json"):
        (folder / name).write_text("{}")
    assert save_run(tmp_path, _draw(1, 1), name="new").name == "0008_new.json"


def test_save_run_rejects_names_that_are_not_file_safe(tmp_path):
    with pytest.raises(ConfigError, match=re.escape("invalid benchmark run name '../x'")):
        save_run(tmp_path, _draw(1, 1), name="../x")


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_run_name_and_commit_info_come_from_git(tmp_path):
    def git(*args):
        subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args],
            cwd=tmp_path,
            check=True,
            capture_output=True,
        )

    git("init", "-q", "-b", "trunk")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", "code.py")
    git("commit", "-q", "-m", "first")
    commit_id = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=tmp_path, check=True, capture_output=True, text=True
    ).stdout.strip()

    path = save_run(tmp_path, _draw(1, 3))
    assert path.name == f"0001_{commit_id[:7]}.json"
    info = load_run(path)["commit_info"]
    assert (info["id"], info["branch"], info["dirty"]) == (commit_id, "trunk", False)
    assert info["time"]

    (tmp_path / "code.py").write_text("x = 2\n")
    assert runs.commit_info(tmp_path)["dirty"] is True


def test_commit_info_is_absent_outside_a_repository(tmp_path):
    # GIT_CEILING_DIRECTORIES is not needed: tmp_path has no .git and no git parent.
    if subprocess.run(["git", "rev-parse"], cwd=tmp_path, capture_output=True).returncode == 0:
        pytest.skip("the temporary directory lies inside a git checkout")
    assert runs.commit_info(tmp_path) is None
    assert "commit_info" not in build_run(_draw(1, 1), root=tmp_path)


def test_run_document_layout(tmp_path):
    recorder = Recorder()
    recorder.extend(_draw(1, 4, test="t.py::a") + _draw(2, 3, op="exec"))
    path = save_run(
        tmp_path, recorder, name="layout", conditions={"accel": "tcg", "backend": "diff"}, qemu_version="7.2.0"
    )
    document = load_run(path)
    assert document["version"] == 1
    assert document["conditions"] == {"accel": "tcg", "backend": "diff"}
    assert document["machine_info"]["qemu"] == "7.2.0"
    assert {"cpu", "cores", "memory_mib", "kernel", "python"} <= set(document["machine_info"])
    assert list(document["operations"]) == ["fork", "exec"]
    fork = document["operations"]["fork"]
    assert fork["summary"]["n"] == 4
    assert fork["samples"] == [round(s.ms, 6) for s in recorder.samples()[:4]]
    assert set(fork["summary"]) == {"n", "min", "p50", "p95", "p99", "max", "mean"}
    assert list(document["tests"]) == ["t.py::a"]
    assert list(document["tests"]["t.py::a"]) == ["fork"]
    assert [Sample.from_dict(s) for s in document["samples"]] == recorder.samples()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{oops", "invalid JSON"),
        ("[]", "the top level is not an object"),
        ('{"version": 2, "operations": {}}', "unsupported benchmark run version 2"),
        ('{"version": 1}', "operations: expected an object"),
        ('{"version": 1, "operations": {"fork": {"samples": ["1"]}}}', "operations.fork.samples: expected a list"),
        ('{"version": 1, "operations": {}, "tests": {"t": {"fork": 3}}}', "tests.t.fork.samples: expected a list"),
    ],
)
def test_load_run_rejects_files_that_are_not_runs(tmp_path, content, message):
    path = tmp_path / "run.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=re.escape(message)) as excinfo:
        load_run(path)
    assert str(excinfo.value).startswith(str(path))


def test_load_run_reports_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot read benchmark run .*missing\.json.*No such file"):
        load_run(tmp_path / "missing.json")


def test_find_baseline(tmp_path):
    assert find_baseline(tmp_path) is None
    one = save_run(tmp_path, _draw(1, 1), name="abc1234")
    two = save_run(tmp_path, _draw(1, 1), name="feature")
    three = save_run(tmp_path, _draw(1, 1), name="abc1234")
    assert find_baseline(tmp_path) == three
    assert find_baseline(tmp_path, "0002") == two
    assert find_baseline(tmp_path, "1") == one
    assert find_baseline(tmp_path, "abc1234") == three
    assert find_baseline(tmp_path, "0001_abc1234") == one
    assert find_baseline(tmp_path, str(two)) == two
    assert find_baseline(tmp_path, "0009") is None
    assert find_baseline(tmp_path, "nope") is None


# --- thresholds ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "stat", "amount", "relative", "canonical"),
    [
        ("p95:20%", "p95", 20.0, True, "p95:20%"),
        ("p50:5ms", "p50", 5.0, False, "p50:5ms"),
        ("p50:5", "p50", 5.0, False, "p50:5ms"),
        ("max:0.5", "max", 0.5, False, "max:0.5ms"),
        (" mean : 10 % ", "mean", 10.0, True, "mean:10%"),
    ],
)
def test_parse_compare_fail(expression, stat, amount, relative, canonical):
    threshold = parse_compare_fail(expression)
    assert (threshold.stat, threshold.amount, threshold.relative, str(threshold)) == (stat, amount, relative, canonical)


@pytest.mark.parametrize("expression", ["p95", "p95:", "p95:-5%", "p90:5%", "median:5", "p95:5s", "20%", "p95:x"])
def test_parse_compare_fail_rejects_other_forms(expression):
    with pytest.raises(ConfigError) as excinfo:
        parse_compare_fail(expression)
    message = str(excinfo.value)
    assert message.startswith(f"invalid compare-fail expression {expression!r}: expected STAT:N%")
    assert "p50:5ms" in message and "min, p50, p95, p99, max, mean" in message


def test_threshold_exceeded():
    relative, absolute = parse_compare_fail("p95:20%"), parse_compare_fail("p50:5ms")
    assert not relative.exceeded(100.0, 120.0)
    assert relative.exceeded(100.0, 120.1)
    assert not absolute.exceeded(100.0, 105.0)
    assert absolute.exceeded(100.0, 105.1)
    assert relative.exceeded(0.0, 0.1)


# --- comparing -------------------------------------------------------------------------

P95_20 = parse_compare_fail("p95:20%")


def test_a_run_compared_with_itself_does_not_regress():
    document = _doc(_draw(1, 50), _draw(2, 30, op="exec", test="t::x"))
    thresholds = [parse_compare_fail(e) for e in ("p50:0%", "p95:0ms", "max:0%", "mean:0%")]
    comparison = compare(document, document, thresholds)
    assert comparison.regressions == []
    assert [row.verdict for row in comparison.rows] == ["ok", "ok", "ok"]
    assert comparison.warnings == []


def test_noisy_draws_of_one_distribution_do_not_regress():
    comparison = compare(_doc(_draw(1, 100)), _doc(_draw(2, 100)), [P95_20])
    (finding,) = comparison.rows[0].findings
    assert finding.new != finding.old
    assert comparison.regressions == []


@pytest.mark.slow  # many simulated runs
def test_false_regressions_between_equal_distributions_stay_below_alpha():
    false_alarms = sum(
        bool(compare(_doc(_draw(seed, 50)), _doc(_draw(10_000 + seed, 50)), [P95_20]).regressions)
        for seed in range(200)
    )
    assert false_alarms / 200 <= 0.06  # alpha is 0.05; 9 of these 200 draws are flagged


def _suite(seed: int, scale: float = 1.0) -> list[Sample]:
    rng = random.Random(seed)
    return [
        Sample(op, scale * rng.lognormvariate(5.0, 0.35), test=f"tests/test_s.py::test_{i}")
        for i in range(30)
        for op in ("fork", "exec")
        for _ in range(8)
    ]


def test_many_checks_are_corrected_for_multiple_comparisons():
    comparison = compare(_doc(_suite(0)), _doc(_suite(100)), [P95_20])
    p_values = [f.p_value for row in comparison.rows for f in row.findings if f.p_value is not None]
    assert min(p_values) < 0.05  # an uncorrected test would fail this run by chance
    assert comparison.regressions == []
    assert max(f.p_limit for row in comparison.rows for f in row.findings if f.p_limit) <= 0.05 / 2


@pytest.mark.slow  # thousands of resamples
def test_a_slower_suite_regresses_despite_the_correction():
    comparison = compare(_doc(_suite(0)), _doc(_suite(100, scale=1.5)), [P95_20])
    assert {(r.op, r.test) for r in comparison.regressions} >= {("fork", None), ("exec", None)}


def test_a_doubled_distribution_regresses_and_names_op_and_stat():
    comparison = compare(_doc(_draw(1, 40)), _doc(_draw(2, 40, scale=2.0)), [P95_20])
    (regression,) = comparison.regressions
    assert (regression.op, regression.test, regression.threshold.stat) == ("fork", None, "p95")
    assert regression.p_value < 0.05
    assert regression.delta_pct > 50
    assert str(regression).startswith("whole run: fork p95 ")
    assert "exceeds p95:20% and is significant (p=0.001 < 0.05)" in str(regression)
    assert comparison.rows[0].verdict == "REGRESSION p95:20%"


def test_a_slowdown_within_noise_is_shown_but_does_not_fail():
    old = _doc([Sample("fork", v) for v in (10, 11, 12, 13, 14)])
    new = _doc([Sample("fork", v) for v in (10, 11, 12, 13, 20)])
    comparison = compare(old, new, [P95_20])
    assert comparison.regressions == []
    (finding,) = comparison.rows[0].findings
    assert finding.exceeded and finding.p_value >= 0.05
    assert comparison.rows[0].verdict.startswith("slower, not significant p95:20% p=")


def test_too_few_samples_never_fail():
    comparison = compare(_doc(_draw(1, 4)), _doc(_draw(2, 40, scale=10.0)), [P95_20])
    assert comparison.regressions == []
    assert comparison.rows[0].verdict == "insufficient samples (need 5)"
    assert "insufficient samples" in comparison.format_table()
    assert compare(_doc(_draw(1, 4)), _doc(_draw(2, 40, scale=10.0)), [P95_20], min_samples=3).regressions


def test_tests_in_both_runs_are_compared_per_test():
    old = _doc(_draw(1, 20, test="t::fast"), _draw(2, 20, test="t::gone"))
    new = _doc(_draw(3, 20, test="t::fast", scale=3.0), _draw(4, 20, test="t::added"))
    comparison = compare(old, new, [P95_20])
    assert [(row.op, row.test) for row in comparison.rows] == [("fork", None), ("fork", "t::fast")]
    assert {r.test for r in comparison.regressions} == {None, "t::fast"}


def test_operations_in_only_one_run_are_marked_new_or_missing():
    comparison = compare(_doc(_draw(1, 10, op="restore")), _doc(_draw(1, 10, op="exec")), [P95_20])
    assert {row.op: row.verdict for row in comparison.rows} == {"restore": "missing", "exec": "new"}
    assert comparison.regressions == []


def test_different_conditions_are_warned_about():
    comparison = compare(
        _doc(_draw(1, 10), conditions={"accel": "kvm"}), _doc(_draw(1, 10), conditions={"accel": "tcg"})
    )
    (warning,) = comparison.warnings
    assert "conditions.accel: 'kvm' in the baseline, 'tcg' now" in warning


def test_format_table_shows_both_runs_and_the_delta():
    comparison = compare(
        _doc(_draw(1, 40)), _doc(_draw(2, 40, scale=2.0)), [P95_20], baseline_label="0001_abc", current_label="0002_def"
    )
    table = comparison.format_table()
    lines = table.splitlines()
    assert lines[0] == "0002_def compared with 0001_abc:"
    assert lines[1].split() == [
        "operation",
        "n",
        "old/new",
        "p50",
        "ms",
        "p95",
        "ms",
        "max",
        "ms",
        "delta",
        "p95",
        "verdict",
        "scope",
    ]
    old, new = comparison.rows[0].old, comparison.rows[0].new
    assert lines[2].startswith(f"fork       40/40      {old.p50:.0f} -> {new.p50:.0f}")
    assert "%)" in lines[2] and lines[2].endswith("whole run")
    assert lines[3].startswith("REGRESSION: whole run: fork p95")


def test_compare_with_baseline_warns_and_passes_without_one(tmp_path):
    comparison = compare_with_baseline(tmp_path, _doc(_draw(1, 10)), [P95_20], ref="0004")
    assert comparison.rows == [] and comparison.regressions == []
    (warning,) = comparison.warnings
    assert "no stored run matching '0004'" in warning
    assert str(storage_dir(tmp_path)) in warning


def test_compare_with_baseline_uses_the_latest_stored_run(tmp_path):
    save_run(tmp_path, _draw(1, 40), name="fast")
    comparison = compare_with_baseline(tmp_path, _doc(_draw(2, 40, scale=2.0)), [P95_20])
    assert comparison.baseline_label == "0001_fast"
    assert [r.op for r in comparison.regressions] == ["fork"]


def test_stored_documents_are_plain_json(tmp_path):
    path = save_run(tmp_path, _draw(1, 3))
    assert json.loads(path.read_text())["operations"]["fork"]["summary"]["n"] == 3
