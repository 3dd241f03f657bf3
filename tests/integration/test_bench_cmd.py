"""`forkd bench` against real VMs: the JSON it prints and the sweep's PNG."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

FORKD = str(Path(sys.executable).parent / "forkd")
FIGURE_KEYS = {"n", "min", "p50", "p95", "max"}


def run_forkd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([FORKD, *args], capture_output=True, text=True, timeout=600)


def assert_figure(figure: dict, n: int) -> None:
    assert set(figure) == FIGURE_KEYS
    assert figure["n"] == n
    assert 0 < figure["min"] <= figure["p50"] <= figure["p95"] <= figure["max"]


def test_bench_prints_every_figure_as_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = run_forkd("bench", "--memory", "256", "--backends", "full,diff", "--dirty", "0,8",
                       "--repeats", "2", "--boots", "1", "--json", str(out))
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    assert json.loads(out.read_text()) == printed
    assert_figure(printed["cold_boot_ms"], 1)
    for name in ("fork_ms", "fork_pooled_ms", "fixture_overhead_ms"):
        assert_figure(printed[name], 2)
    assert_figure(printed["exec_rtt_ms"], 10)
    assert_figure(printed["copy_reference_mib_s"], 2)
    assert printed["conditions"]["accel"] in ("kvm", "tcg")
    rows = {(row["backend"], row["memory_mib"], row["dirty_mib"]): row for row in printed["branch"]}
    assert set(rows) == {("full", 256, 0), ("full", 256, 8), ("diff", 256, 0), ("diff", 256, 8)}
    for row in rows.values():
        assert_figure(row["pause_ms"], 2)
        assert_figure(row["total_ms"], 2)
        assert row["pause_ms"]["min"] <= row["total_ms"]["max"]


def test_sweep_writes_json_and_a_png_of_the_three_backends(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    plot = tmp_path / "sweep.png"
    result = run_forkd("bench", "--sweep", "--memory", "256", "--repeats", "1", "--plot", str(plot))
    assert result.returncode == 0, result.stderr
    document = json.loads(plot.with_suffix(".json").read_text())
    assert {row["backend"] for row in document["branch"]} == {"full", "diff", "uffd"}
    assert [row["memory_mib"] for row in document["fork"]] == [256]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot.stat().st_size > 10_000
