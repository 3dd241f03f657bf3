"""A sharded CI run with real VMs: build and export once, import per shard, merge, gate.

Mirrors examples/ci/forkd-matrix.yml on one machine: a build job fills a
store and exports ``base``; each shard starts from an empty cache, imports
the archive and runs its part of the suite (pytest's own node ids; one shard
with pytest-xdist); the last job merges the shards' timings into one
baseline and gates a later run whose regression is in one shard only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SUITE = """
import os

import pytest

COMMAND = "sleep 1.5" if os.environ.get("SHARD_TEST_SLOW") == "1" else "true"


@pytest.mark.parametrize("round", range(2))
def test_first_half(forkd_vm, round):
    for _ in range(6):
        assert forkd_vm.exec("true").ok


@pytest.mark.parametrize("round", range(2))
def test_second_half(forkd_vm, round):
    for _ in range(6):
        assert forkd_vm.exec(COMMAND).ok
"""

SHARDS = {
    "shard-1": ["test_suite.py::test_first_half"],
    "shard-2": ["test_suite.py::test_second_half", "-p", "xdist", "-n", "2"],
}


def forkd_cli(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FORKD_CACHE_DIR": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "pytest_forkd.cli", *args], capture_output=True, text=True, env=env, timeout=600
    )


@pytest.mark.vm  # boots QEMU in the inner pytest run
def test_shards_import_one_build_merge_into_one_baseline_and_gate(
    pytester: pytest.Pytester, shm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from support import USER_CACHE, assert_nothing_left

    pytester.makepyfile(test_suite=SUITE)
    # -- build job: fill a store, export base ----------------------------------------------------------------
    build_store = tmp_path / "build-store"
    built = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        f"--forkd-store={build_store}",
        "--forkd-accel=tcg",
        "test_suite.py::test_first_half",
        timeout=300,
    )
    built.assert_outcomes(passed=2)
    archive = tmp_path / "base.forkd.tar.zst"
    exported = forkd_cli(
        "snapshots", "export", "base", "-o", str(archive), "--store", str(build_store), cache=USER_CACHE
    )
    assert exported.returncode == 0, exported.stderr

    # -- shard jobs: empty cache, import, run the shard (baseline, then a run slower in shard 2) --------------
    runs: dict[str, dict[str, Path]] = {"baseline": {}, "current": {}}
    for shard, selection in SHARDS.items():
        cache = tmp_path / f"cache-{shard}"
        imported = forkd_cli("snapshots", "import", str(archive), cache=cache)
        assert imported.returncode == 0, imported.stderr
        monkeypatch.setenv("FORKD_CACHE_DIR", str(cache))
        for kind in runs:
            monkeypatch.setenv("SHARD_TEST_SLOW", "1" if kind == "current" and shard == "shard-2" else "0")
            report = tmp_path / kind / f"{shard}.json"
            report.parent.mkdir(exist_ok=True)
            result = pytester.runpytest_subprocess(
                "-p",
                "no:cacheprovider",
                f"--forkd-store={cache / 'snapshots'}",
                "--forkd-accel=tcg",
                f"--forkd-json={report}",
                *selection,
                timeout=300,
            )
            result.assert_outcomes(passed=2)
            assert_nothing_left(shm_dir)
            # restored from the import, never built
            assert not [line for line in result.outlines if "built in" in line and "snapshot" in line]
            assert any("snapshot 'base': cached" in line for line in result.outlines)
            runs[kind][shard] = report
        assert not (cache / "images" / "names").exists() or (cache / "images" / "names" / "default").is_file()
        assert not list((cache / "debs").glob("*")) if (cache / "debs").exists() else True  # nothing downloaded

    # -- last job: merge the baseline shards, gate the current shards --------------------------------------
    baseline = tmp_path / "baseline.json"
    merged = forkd_cli("merge", *map(str, runs["baseline"].values()), "-o", str(baseline), cache=USER_CACHE)
    assert merged.returncode == 0, merged.stderr
    document = json.loads(baseline.read_text())
    shard_counts = [
        json.loads(path.read_text())["operations"]["exec"]["summary"]["n"] for path in runs["baseline"].values()
    ]
    assert shard_counts == [12, 12]
    assert document["operations"]["exec"]["summary"]["n"] == sum(shard_counts)
    assert len(document["shards"]) == 2 and all(shard["machine_info"]["cpu"] for shard in document["shards"])

    gate = forkd_cli(
        "compare", str(baseline), *map(str, runs["current"].values()), "--fail", "p95:20%", cache=USER_CACHE
    )
    assert gate.returncode == 1, gate.stdout + gate.stderr
    regressions = [line for line in gate.stdout.splitlines() if line.startswith("REGRESSION")]
    # the slow shard's tests are named (whether the unchanged shard also drifted depends on the machine's load)
    assert any("test_second_half" in line for line in regressions)
    assert "2 shard runs merged" in gate.stdout and "24/24" in gate.stdout  # exec samples of both shards


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare(1) for a read-only bind mount"
)
@pytest.mark.vm  # boots QEMU in the inner pytest run
def test_a_suite_runs_from_a_read_only_shared_store(
    pytester: pytest.Pytester, run_forkd, shm_dir: Path, shared_store: Path, tmp_path: Path
) -> None:
    from support import assert_nothing_left

    pytester.makepyfile(test_suite=SUITE)
    run_forkd("test_suite.py::test_first_half").assert_outcomes(passed=2)  # base is in the shared store now
    before = sorted(str(path) for path in shared_store.rglob("*"))
    mountpoint = tmp_path / "ro-store"
    mountpoint.mkdir()
    script = (
        f"mount --bind {shared_store} {mountpoint} && mount -o remount,bind,ro {mountpoint} && "
        f"exec {sys.executable} -m pytest -p no:cacheprovider --forkd-store={mountpoint} "
        "-p xdist -n 2 test_suite.py"
    )

    result = subprocess.run(
        ["unshare", "-m", "sh", "-c", script], cwd=pytester.path, capture_output=True, text=True, timeout=300
    )

    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "4 passed" in result.stdout and "snapshot 'base': cached" in result.stdout
    assert "(read-only: restored from copies, never written)" in result.stdout
    assert sorted(str(path) for path in shared_store.rglob("*")) == before
    assert_nothing_left(shm_dir)
