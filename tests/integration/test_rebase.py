"""Re-based diffs and live branches of children against real VMs.

A VM that keeps branching with the diff backend is re-based once it changed
more than the threshold since its base: the branch's snapshot becomes a flat
file and the VM maps it. These tests check what that must never break: the
contents of every snapshot's children, the VM itself, and the files children
map, which are never written once written. The uffd backend's live branch of
a child (only its changed pages protected) is checked the same way.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterator

import pytest

from pytest_forkd.core.factory import VMFactory
from pytest_forkd.core.vm import VM
from pytest_forkd.storage.snapshot import Snapshot

STEP = (
    "import os, hashlib; d = os.urandom(1 << 20); open('/root/step-{i}', 'wb').write(d); "
    "print(hashlib.sha256(d).hexdigest())"
)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@pytest.fixture
def eager_rebase(factory: VMFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """The factory's diff backend re-bases past 1 MiB (every branch of a VM that ran a command re-bases)."""
    monkeypatch.setattr(factory.runtime.backends.get("diff"), "rebase_mib", 1)
    yield 1


def step(vm: VM, index: int) -> str:
    return vm.exec(["python3", "-c", STEP.format(i=index)], check=True).stdout.strip()


def guest_sha(vm: VM, path: str) -> str:
    return vm.exec(["sha256sum", path], check=True).stdout.split()[0]


def test_rebased_diffs_keep_every_snapshot_and_the_vm_correct(vm: VM, eager_rebase: int) -> None:
    base_file = vm.memory_base.memory_path
    base_sum = sha256_of(base_file)
    sums: dict[int, str] = {}
    snapshots: list[Snapshot] = []
    for index in range(6):
        sums[index] = step(vm, index)
        snapshots.append(vm.branch(backend="diff"))
        if index % 2:
            snapshots.append(vm.branch(backend="diff"))  # nothing changed since: a plain diff of the new base

    rebased = [s for s in snapshots if s.extra.get("rebased")]
    assert len(rebased) >= 3 and all(s.memory_file and s.base is None for s in rebased)
    assert any(s.diff_file for s in snapshots)  # some branches stayed diffs, against a re-based file
    assert vm.memory_base.path == rebased[-1].path  # the VM now maps its last re-based snapshot
    mapped = {s.tag: sha256_of(s.memory_path) for s in rebased}

    # The VM itself went on with the same memory: all its files are intact and it keeps working.
    assert all(guest_sha(vm, f"/root/step-{i}") == sums[i] for i in sums)
    sums[6] = step(vm, 6)

    # Every snapshot's child sees exactly the steps taken before it, nothing after.
    for snapshot, last in _steps_of(snapshots):
        child = snapshot.fork(1)[0]
        try:
            for index in range(last + 1):
                assert guest_sha(child, f"/root/step-{index}") == sums[index]
            assert child.exec(["test", "-e", f"/root/step-{last + 1}"]).exit_code != 0
            assert child.read_file("/root/marker") == b"from-base\n"
        finally:
            child.close()

    # Files that children map were never written: the base and every re-based memory file.
    assert sha256_of(base_file) == base_sum
    assert {s.tag: sha256_of(s.memory_path) for s in rebased} == mapped


def _steps_of(snapshots: list[Snapshot]) -> list[tuple[Snapshot, int]]:
    """Each snapshot of the loop above with the index of the last step it includes."""
    result, index = [], 0
    position = 0
    while position < len(snapshots):
        result.append((snapshots[position], index))
        if index % 2:
            result.append((snapshots[position + 1], index))
            position += 1
        position += 1
        index += 1
    return result


def test_rebased_vm_restores_and_forks_from_its_original_base(vm: VM, eager_rebase: int) -> None:
    origin = vm.origin
    sums = {0: step(vm, 0)}
    rebased = vm.branch(backend="diff")
    assert rebased.extra.get("rebased")
    sums[1] = step(vm, 1)
    later = vm.branch(backend="diff")
    assert guest_sha(vm, "/root/step-1") == sums[1]

    vm.restore(origin)  # back to the untouched base: nothing of the steps
    assert vm.exec(["test", "-e", "/root/step-0"]).exit_code != 0
    vm.restore(later)
    assert guest_sha(vm, "/root/step-0") == sums[0] and guest_sha(vm, "/root/step-1") == sums[1]


def test_live_branch_of_a_child_running_a_server_forks_working_children(vm: VM) -> None:
    """A uffd branch of a child whose guest runs a background process captures the instant of its
    pause while the guest rewrites the same pages right after; its children boot and answer, and the
    base file its siblings map is not written."""
    reason = vm.factory.runtime.backends.get("uffd").unavailable_reason()
    if reason:
        pytest.skip(f"uffd is unavailable here: {reason}")
    base_file = vm.memory_base.memory_path
    base_sum = sha256_of(base_file)
    vm.exec("cd /tmp && python3 -m http.server 8000 >/dev/null 2>&1 &", check=True)
    vm.exec("sleep 2")
    before = step(vm, 0)
    snapshot = vm.branch(backend="uffd").wait_ready(timeout=300)
    after = step(vm, 0)  # rewrites the file (and the pages) the branch must have captured as they were
    for child in snapshot.fork(2):
        try:
            assert guest_sha(child, "/root/step-0") == before != after
            assert child.exec("python3 -c 'print(6*7)'", timeout=60).stdout == "42\n"
            assert child.exec("grep -c ':1F40 ' /proc/net/tcp").stdout.strip() == "1"  # the server listens
        finally:
            child.close()
    assert guest_sha(vm, "/root/step-0") == after
    assert sha256_of(base_file) == base_sum
