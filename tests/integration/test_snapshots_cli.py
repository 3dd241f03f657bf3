"""``forkd snapshots ls|info|rm`` on snapshots of real VMs: a full one and a diff on top of it."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from pytest_forkd.core.branching import branch
from pytest_forkd.core.vm import VM
from pytest_forkd.storage.snapshot import Snapshot
from pytest_forkd.storage.store import SnapshotStore

FORKD = [sys.executable, "-m", "pytest_forkd.cli"]


@pytest.fixture
def store() -> Iterator[SnapshotStore]:
    """A snapshot store on /dev/shm (full snapshots are hundreds of MiB), removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix="forkd-itest-store-", dir="/dev/shm"))
    yield SnapshotStore(root)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def full_and_diff(vm: VM, store: SnapshotStore) -> Iterator[tuple[Snapshot, Snapshot]]:
    """``cli-full``, a full snapshot of a child, and ``cli-diff``, a diff of a child of ``cli-full``."""
    vm.write_file("/root/level", "full")
    full = branch(vm, "cli-full", backend="full", store=store)
    child = full.fork(1)[0]
    try:
        child.write_file("/root/level", "diff")
        diff = branch(child, "cli-diff", backend="diff", store=store)
        yield full, diff
    finally:
        child.close()


def forkd_snapshots(*args: str, store: SnapshotStore) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*FORKD, "snapshots", *args, "--store", str(store.root)], capture_output=True, text=True, timeout=60
    )


def info_fields(output: str) -> dict[str, str]:
    """The ``name: value`` lines of ``forkd snapshots info``."""
    return {match[1]: match[2] for match in re.finditer(r"^(\w[\w ]*):\s+(.*)$", output, re.M)}


def test_ls_lists_both_snapshots_with_backend_base_and_size(
    full_and_diff: tuple[Snapshot, Snapshot], store: SnapshotStore
) -> None:
    result = forkd_snapshots("ls", store=store)

    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[1:]}
    assert set(rows) == {"cli-full", "cli-diff"}
    # TAG BACKEND STATUS MEMORY(2 words) ON-DISK(2 words) BASE CREATED...
    assert rows["cli-full"][1:5] == ["full", "ready", "256", "MiB"]
    assert rows["cli-diff"][1:5] == ["diff", "ready", "256", "MiB"]
    assert rows["cli-full"][7] == "-" and rows["cli-diff"][7] == "cli-full"
    assert rows["cli-full"][6] in ("MiB", "GiB") and float(rows["cli-full"][5]) > 0


def test_info_shows_the_base_chain_dependents_and_size(
    full_and_diff: tuple[Snapshot, Snapshot], store: SnapshotStore
) -> None:
    full, diff = full_and_diff

    diff_info = info_fields(forkd_snapshots("info", "cli-diff", store=store).stdout)
    full_info = info_fields(forkd_snapshots("info", "cli-full", store=store).stdout)

    assert diff_info["backend"] == "diff" and diff_info["base"] == "cli-full" and diff_info["parent"] == "cli-full"
    assert diff_info["base chain"] == "cli-diff -> cli-full"
    assert diff_info["dependents"] == "none"
    assert diff_info["diff file"] == "memory.diff"
    assert full_info["backend"] == "full" and full_info["memory file"] == "memory.ram"
    assert full_info["dependents"] == "cli-diff"
    assert full_info["base chain"] == "cli-full"
    # The diff is a sparse file as large as guest memory holding only the dirty pages.
    allocated = re.fullmatch(r"([\d.]+) (KiB|MiB) allocated, 256\.0 MiB apparent", diff_info["size on disk"])
    assert allocated is not None, diff_info["size on disk"]
    assert allocated[2] == "KiB" or float(allocated[1]) < 64
    assert int(diff_info["dirty bytes"]) == diff.dirty_bytes
    assert full_info["size on disk"].endswith(", 256.0 MiB apparent")
    assert full_info["pause"] == f"{full.pause_ms:.1f} ms"


def test_rm_refuses_to_orphan_dependents_unless_cascading(
    full_and_diff: tuple[Snapshot, Snapshot], store: SnapshotStore
) -> None:
    refused = forkd_snapshots("rm", "cli-full", store=store)

    assert refused.returncode == 1
    assert "cli-diff (diff against it)" in refused.stderr and "--cascade" in refused.stderr
    assert store.exists("cli-full") and store.exists("cli-diff")

    removed = forkd_snapshots("rm", "cli-full", "--cascade", store=store)

    assert removed.returncode == 0, removed.stderr
    assert removed.stdout.splitlines() == ["removed cli-diff", "removed cli-full"]
    assert store.list() == [] and store.broken() == []


def test_a_diff_removed_alone_leaves_its_base_usable(
    full_and_diff: tuple[Snapshot, Snapshot], store: SnapshotStore
) -> None:
    full, diff = full_and_diff
    child_of_diff = diff.fork(1)[0]
    try:
        assert child_of_diff.read_file("/root/level") == b"diff"
    finally:
        child_of_diff.close()

    result = forkd_snapshots("rm", "cli-diff", store=store)

    assert result.returncode == 0 and result.stdout == "removed cli-diff\n"
    assert [snapshot.tag for snapshot in store.list()] == ["cli-full"]
    child_of_full = full.fork(1)[0]
    try:
        assert child_of_full.read_file("/root/level") == b"full"
    finally:
        child_of_full.close()
