"""A store shared between hosts: read-only detection, and cleanup that spares other hosts' writers."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from pytest_forkd.errors import SnapshotError
from pytest_forkd.storage import leftovers
from pytest_forkd.storage.store import SnapshotStore


def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_temporary_directories_of_another_host_are_left_to_it(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    pid = dead_pid()
    ours = tmp_path / f".tmp-snap-{pid}-{leftovers.HOST_TOKEN}deadbeef"
    theirs = tmp_path / f".tmp-snap-{pid}-{'f' * 8 if leftovers.HOST_TOKEN != 'f' * 8 else 'e' * 8}deadbeef"
    legacy = tmp_path / f".tmp-snap-{pid}-deadbeef"  # written before names carried a host token
    for directory in (ours, theirs, legacy):
        directory.mkdir()

    removed = store.clean_stale_temp()

    assert sorted(removed) == sorted([ours, legacy])
    assert theirs.is_dir()
    assert store.clean_stale_temp(max_age_s=-1) == [theirs]  # old enough: gone whoever wrote it


def test_new_temporary_directories_carry_this_hosts_token(tmp_path: Path) -> None:
    pending = SnapshotStore(tmp_path).begin("snap")
    try:
        assert pending.dir.name.rsplit("-", 1)[1].startswith(leftovers.HOST_TOKEN)
        assert leftovers.made_on_this_host(pending.dir.name)
    finally:
        pending.abort()


def test_a_store_that_is_not_writable_refuses_writes_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = SnapshotStore(tmp_path / "shared")
    monkeypatch.setattr(os, "access", lambda path, mode: not mode & os.W_OK)

    reason = store.read_only_reason()
    with pytest.raises(SnapshotError) as caught:
        store.begin("snap")
    with pytest.raises(SnapshotError, match="lock snapshot 'snap' for building"):
        store.lock("snap")

    assert reason == f"{tmp_path} is not writable by this user"
    message = str(caught.value)
    assert "\n" not in message and "write snapshot 'snap'" in message and "--forkd-store" in message
    assert not (tmp_path / "shared").exists()


def test_a_writable_store_has_no_read_only_reason(tmp_path: Path) -> None:
    assert SnapshotStore(tmp_path / "not-yet-created").read_only_reason() is None


def test_a_store_made_read_only_with_chmod_is_read_only_even_for_root(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o555)
    try:
        store = SnapshotStore(shared)
        with pytest.raises(SnapshotError, match=r"read-only \(mode 0555\)"):
            store.begin("snap")
    finally:
        shared.chmod(0o755)
    assert [entry.name for entry in shared.iterdir()] == []


def test_a_kvm_snapshot_is_bound_to_the_cpu_and_another_cpu_is_named_on_restore(tmp_path: Path) -> None:
    """-cpu host under KVM: the fingerprint carries the CPU, so a shared store refuses it on another CPU."""
    from pytest_forkd.core.factory import VMFactory
    from pytest_forkd.engine.cpu import host_cpu_id
    from pytest_forkd.engine.qemu.host import Qemu
    from pytest_forkd.engine.qemu.machine import MachineSpec
    from pytest_forkd.errors import IncompatibleSnapshot
    from pytest_forkd.storage.snapshot import Snapshot

    class FakeImage:
        key = "0123456789abcdef"

    factory = VMFactory(accel="tcg")
    qemu = Qemu("/usr/bin/qemu-system-x86_64", "7.2.0")
    kvm = factory.fingerprint(FakeImage(), MachineSpec(qemu=qemu, accel="kvm"))  # type: ignore[arg-type]
    tcg = factory.fingerprint(FakeImage(), MachineSpec(qemu=qemu, accel="tcg"))  # type: ignore[arg-type]
    elsewhere = Snapshot(
        tag="kvm-snap",
        path=tmp_path,
        backend="full",
        memory_mib=256,
        vcpus=1,
        image="default",
        fingerprint={**kvm, "host_cpu": "Imaginary CPU 9000 (flags 0000000000000000)"},
        state_file="state.bin",
        memory_file="memory.ram",
    )

    assert kvm["host_cpu"] == host_cpu_id() and "host_cpu" not in tcg  # TCG snapshots move between CPUs
    with pytest.raises(IncompatibleSnapshot, match="host_cpu: snapshot has 'Imaginary CPU 9000"):
        SnapshotStore(tmp_path).check_compatible(elsewhere, kvm)
