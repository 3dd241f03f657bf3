"""Merging the runs of CI shards into one baseline, and gating on the merge."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from pytest_forkd.cli import main
from pytest_forkd.errors import ConfigError
from pytest_forkd.latency.compare import compare
from pytest_forkd.latency.runs import build_run, list_runs, load_run
from pytest_forkd.latency.shards import load_runs, merge_runs
from pytest_forkd.latency.timings import Sample

RECIPES = {"base": "e45e67955304ef0a5c31c484"}


def shard_run(
    tests: list[str],
    *,
    exec_ms: float = 5.0,
    seed: int = 0,
    node: str = "runner-1",
    recipes: dict[str, str] | None = None,
    conditions: dict | None = None,
    per_test: int = 8,
) -> dict:
    rng = random.Random(seed)
    samples = []
    for test in tests:
        for _ in range(per_test):
            samples.append(Sample("exec", exec_ms * rng.uniform(0.95, 1.05), test=test))
            samples.append(Sample("fork", 150 * rng.uniform(0.95, 1.05), test=test))
    document = build_run(
        samples,
        conditions=conditions or {"accel": "tcg", "backend": "diff", "snapshot": "base", "pool": 1},
        qemu_version="7.2.22",
        snapshots=RECIPES if recipes is None else recipes,
    )
    document["machine_info"]["node"] = node
    return document


def write(path: Path, document: dict) -> Path:
    path.write_text(json.dumps(document))
    return path


def test_merged_sample_counts_are_the_sum_of_the_shards() -> None:
    one = shard_run(["t.py::a", "t.py::b"], node="runner-1")
    two = shard_run(["t.py::c"], node="runner-2", seed=1)

    merged = merge_runs([("shard-1.json", one), ("shard-2.json", two)])

    assert len(merged["operations"]["exec"]["samples"]) == 16 + 8
    assert merged["operations"]["exec"]["summary"]["n"] == 24
    assert set(merged["tests"]) == {"t.py::a", "t.py::b", "t.py::c"}
    assert len(merged["samples"]) == len(one["samples"]) + len(two["samples"])
    assert {sample["shard"] for sample in merged["samples"]} == {"shard-1.json", "shard-2.json"}
    # each shard's machine travels with the merged run
    assert [shard["machine_info"]["node"] for shard in merged["shards"]] == ["runner-1", "runner-2"]
    assert [shard["sample_count"] for shard in merged["shards"]] == [32, 16]
    assert merged["machine_info"]["node"] == ["runner-1", "runner-2"]
    assert merged["machine_info"]["qemu"] == "7.2.22"
    assert merged["snapshots"] == RECIPES


def test_a_merged_run_is_a_valid_run_and_merges_again(tmp_path: Path) -> None:
    merged = merge_runs([("1", shard_run(["a"])), ("2", shard_run(["b"]))])
    path = write(tmp_path / "merged.json", merged)

    again = load_runs([path, write(tmp_path / "3.json", shard_run(["c"]))])

    assert load_run(path)["operations"]["exec"]["summary"]["n"] == 16
    assert again["operations"]["exec"]["summary"]["n"] == 24


def test_shards_with_different_recipe_hashes_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"snapshot 'base': recipe e45e\w+ in shard-1, 0123 in shard-2") as caught:
        merge_runs([("shard-1", shard_run(["a"])), ("shard-2", shard_run(["b"], recipes={"base": "0123"}))])
    assert "\n" not in str(caught.value) and "import the same archive" in str(caught.value)


def test_shards_with_different_conditions_are_refused() -> None:
    kvm = {"accel": "kvm", "backend": "diff", "snapshot": "base", "pool": 1}
    with pytest.raises(ConfigError, match="accel is 'tcg' in shard-1 and 'kvm' in shard-2"):
        merge_runs([("shard-1", shard_run(["a"])), ("shard-2", shard_run(["b"], conditions=kvm))])


def test_the_gate_fires_on_a_regression_in_one_shard_only() -> None:
    baseline = merge_runs([("b1", shard_run(["a", "b"], seed=1)), ("b2", shard_run(["c", "d"], seed=2))])
    fast = shard_run(["a", "b"], seed=3)
    slow = shard_run(["c", "d"], seed=4, exec_ms=9.0)
    current = merge_runs([("s1", fast), ("s2", slow)])
    from pytest_forkd.latency.compare import parse_compare_fail

    comparison = compare(baseline, current, [parse_compare_fail("p95:20%")])

    regressed = {(finding.op, finding.test) for finding in comparison.regressions}
    assert ("exec", None) in regressed and ("exec", "c") in regressed and ("exec", "d") in regressed
    assert not any(test in ("a", "b") for _op, test in regressed)


def test_forkd_compare_merges_several_current_runs_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    baseline = write(
        tmp_path / "baseline.json",
        merge_runs([("b1", shard_run(["a", "b"], seed=1)), ("b2", shard_run(["c", "d"], seed=2))]),
    )
    shards = tmp_path / "shards"
    shards.mkdir()
    write(shards / "shard-1.json", shard_run(["a", "b"], seed=3))
    write(shards / "shard-2.json", shard_run(["c", "d"], seed=4, exec_ms=9.0))

    by_files = main(
        ["compare", str(baseline), str(shards / "shard-1.json"), str(shards / "shard-2.json"), "--fail", "p95:20%"]
    )
    out = capsys.readouterr().out
    by_directory = main(["compare", str(baseline), str(shards), "--fail", "p95:20%"])
    only_fast_shard = main(["compare", str(baseline), str(shards / "shard-1.json"), "--fail", "p95:20%"])

    assert by_files == 1 and by_directory == 1 and only_fast_shard == 0
    assert "2 shard runs merged" in out and "REGRESSION" in out
    assert "32/32" in out  # exec: n old/new, both sides merged from two shards


def test_forkd_merge_writes_and_saves_the_merged_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one = write(tmp_path / "shard-1.json", shard_run(["a"]))
    two = write(tmp_path / "shard-2.json", shard_run(["b", "c"]))
    output = tmp_path / "merged.json"

    status = main(["merge", str(one), str(two), "-o", str(output), "--save", "main", "--root", str(tmp_path)])

    assert status == 0
    assert load_run(output)["operations"]["exec"]["summary"]["n"] == 24
    stored = list_runs(tmp_path)
    assert [path.name for path in stored] == ["0001_main.json"]
    assert "exec 24" in capsys.readouterr().out


def test_forkd_merge_refuses_mismatched_shards_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one = write(tmp_path / "shard-1.json", shard_run(["a"]))
    two = write(tmp_path / "shard-2.json", shard_run(["b"], recipes={"base": "ffff"}))

    status = main(["merge", str(one), str(two), "-o", str(tmp_path / "m.json")])

    err = capsys.readouterr().err
    assert status == 4 and err.count("\n") == 1 and "different builds of snapshot 'base'" in err
    assert not (tmp_path / "m.json").exists()


def test_forkd_merge_needs_a_destination(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one = write(tmp_path / "shard-1.json", shard_run(["a"]))

    assert main(["merge", str(one)]) == 4
    assert "-o FILE, --save" in capsys.readouterr().err


def test_comparing_runs_of_other_snapshot_builds_warns() -> None:
    baseline = shard_run(["a"], recipes={"base": "old"})
    current = shard_run(["a"], recipes={"base": "new", "tools": "t"})

    comparison = compare(baseline, current)

    assert (
        len(comparison.warnings) == 1 and "snapshots.base: 'old' in the baseline, 'new' now" in comparison.warnings[0]
    )
    assert "tools" not in comparison.warnings[0]  # used by one run only: nothing to compare


def test_forkd_compare_merges_baseline_shards_given_with_baseline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    b1 = write(tmp_path / "b1.json", shard_run(["a", "b"], seed=1))
    b2 = write(tmp_path / "b2.json", shard_run(["c", "d"], seed=2))
    c1 = write(tmp_path / "c1.json", shard_run(["a", "b"], seed=3))
    c2 = write(tmp_path / "c2.json", shard_run(["c", "d"], seed=4, exec_ms=9.0))

    status = main(["compare", "--baseline", str(b1), "--baseline", str(b2), str(c1), str(c2), "--fail", "p95:20%"])

    out = capsys.readouterr().out
    assert status == 1 and "2 shard runs merged compared with 2 shard runs merged" in out
    assert "32/32" in out


def test_forkd_compare_needs_a_current_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    only = write(tmp_path / "b1.json", shard_run(["a"]))

    assert main(["compare", str(only)]) == 4
    assert "at least one current run" in capsys.readouterr().err


def test_the_plugin_gate_takes_a_directory_of_baseline_shards(tmp_path: Path) -> None:
    from pytest_forkd.latency.compare import compare_with_baseline, parse_compare_fail

    shards = tmp_path / "baseline-shards"
    shards.mkdir()
    write(shards / "shard-1.json", shard_run(["a", "b"], seed=1))
    write(shards / "shard-2.json", shard_run(["c", "d"], seed=2))
    current = merge_runs([("s1", shard_run(["a", "b"], seed=3)), ("s2", shard_run(["c", "d"], seed=4, exec_ms=9.0))])

    comparison = compare_with_baseline(tmp_path, current, [parse_compare_fail("p95:20%")], ref=str(shards))

    assert comparison.regressions and comparison.baseline_label == f"shard runs in {shards}"
    exec_row = next(row for row in comparison.rows if row.op == "exec" and row.test is None)
    assert exec_row.old is not None and exec_row.old.n == 32
