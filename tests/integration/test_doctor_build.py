"""``forkd doctor`` with an empty cache: ready, the first run's work named; ``--build`` does that work now.

Runs the real ``forkd`` command: the build reads the Debian packages already
downloaded into the user cache (its images are kept apart), and the
accelerator probe starts QEMU with the image just built.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_forkd import paths

pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="needs qemu-system-x86_64"),
    pytest.mark.skipif(
        shutil.which("gpgv") is None and shutil.which("sqv") is None,
        reason="checking Debian's signatures needs gpgv or sqv",
    ),
]

FORKD = str(Path(sys.executable).parent / "forkd")


@pytest.fixture
def fresh_cache(tmp_path: Path) -> Iterator[dict[str, str]]:
    """The environment of a user with an empty cache, but for the Debian packages already downloaded."""
    shared_debs = paths.debs_dir()
    cache = tmp_path / "cache"
    cache.mkdir()
    if shared_debs.is_dir():
        (cache / "debs").symlink_to(shared_debs)
    run_root = Path(tempfile.mkdtemp(prefix="forkd-itest-doctor-", dir="/dev/shm"))
    env = {**os.environ, "FORKD_CACHE_DIR": str(cache), "FORKD_SHM_DIR": str(run_root)}
    for name in [name for name in env if name.startswith("PYTEST_FORKD_")] + ["FORKD_DEBUG", "FORKD_STORE"]:
        env.pop(name, None)
    yield env
    shutil.rmtree(run_root, ignore_errors=True)


def forkd(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([FORKD, *args], capture_output=True, text=True, timeout=600, env=env)


def test_doctor_on_an_empty_cache_is_ready_then_build_builds_and_probes(fresh_cache: dict[str, str]) -> None:
    result = forkd("doctor", env=fresh_cache)

    assert result.returncode == 0, result.stdout + result.stderr
    assert "[FAIL]" not in result.stdout
    assert "[next] image            not built yet: the first run builds the default image" in result.stdout
    assert result.stdout.rstrip().endswith(
        "ready: nothing is wrong; the first run builds the default image (forkd doctor --build does it now)"
    )
    assert not (Path(fresh_cache["FORKD_CACHE_DIR"]) / "images").exists()

    built = forkd("doctor", "--build", env=fresh_cache)

    assert built.returncode == 0, built.stdout + built.stderr
    assert "[next]" not in built.stdout and "[FAIL]" not in built.stdout
    image_line = next(line for line in built.stdout.splitlines() if line.startswith("[ok  ] image "))
    assert "built now at " + str(Path(fresh_cache["FORKD_CACHE_DIR"]) / "images") in image_line
    snapshot_line = next(line for line in built.stdout.splitlines() if " snapshot " in line)
    store = Path(fresh_cache["FORKD_CACHE_DIR"]) / "snapshots"
    assert snapshot_line.startswith("[ok  ] snapshot ") and f"base stored now in {store}" in snapshot_line
    assert built.stdout.splitlines()[-1] == "ready"
    listed = forkd("snapshots", "ls", env=fresh_cache)  # what --build said it stored is there, for every run
    assert listed.returncode == 0 and any(line.split()[:1] == ["base"] for line in listed.stdout.splitlines())

    document = json.loads(forkd("doctor", "--json", env=fresh_cache).stdout)
    assert document["ready"] is True and document["first_run"] == []
    assert document["accel"] in ("kvm", "tcg")
    run_root = Path(fresh_cache["FORKD_SHM_DIR"])  # the probe's VM and its run directory are gone
    assert not run_root.exists() or not os.listdir(run_root)
