"""The KVM probe and the KVM path against real QEMU.

The probe runs on every host: its verdict must say KVM or TCG with a reason,
be cached per kernel and QEMU, and be reused. The KVM path's tests run where
the probe found KVM usable and are skipped with the probe's reason elsewhere
(a host without /dev/kvm, or a nested one whose KVM cannot run a guest), so
a KVM host runs them with no change.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from pytest_forkd.cli.bench.cpu import measure_child_cpu, tcg_work
from pytest_forkd.core.factory import VMFactory
from pytest_forkd.engine.qemu import accel as accel_module
from pytest_forkd.engine.qemu.host import kernel_release
from pytest_forkd.engine.qemu.machine import KVM_CPU
from pytest_forkd.image import ensure_image
from pytest_forkd.storage.snapshot import Snapshot
from pytest_forkd.storage.store import SnapshotStore


def test_the_probe_gives_a_verdict_with_its_reason_caches_it_and_reuses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real probe (no cached verdict): KVM if a guest booted under it, else TCG saying why KVM is unusable."""
    cache = tmp_path / "accel.json"
    monkeypatch.setattr(accel_module, "_cache_path", lambda: cache)
    image = ensure_image("default")
    factory = VMFactory(accel="auto")
    try:
        verdict = factory.accel_verdict(image)
    finally:
        factory.close()
    assert not verdict.cached
    if verdict.accel == "kvm":
        assert verdict.reason == "KVM probe booted a guest"
    else:
        assert verdict.accel == "tcg" and verdict.reason.startswith("KVM unusable: "), verdict.reason
    entry = json.loads(cache.read_text())[f"{kernel_release()}|{factory.engine.describe()['version']}"]
    assert (entry["accel"], entry["reason"]) == (verdict.accel, verdict.reason)
    again = VMFactory(accel="auto")
    try:
        reused = again.accel_verdict(image)
    finally:
        again.close()
    assert reused.cached and (reused.accel, reused.reason) == (verdict.accel, verdict.reason)


@pytest.fixture(scope="module")
def kvm_factory(factory: VMFactory) -> Iterator[VMFactory]:
    """A factory that runs its VMs under KVM, where the probe (cached per host) found KVM usable."""
    verdict = factory.accel_verdict(ensure_image("default"))
    if verdict.accel != "kvm":
        pytest.skip(f"KVM path not testable on this host: {verdict.reason}")
    kvm = VMFactory(accel="kvm")
    yield kvm
    kvm.close()


@pytest.fixture(scope="module")
def kvm_base(kvm_factory: VMFactory) -> Iterator[Snapshot]:
    root = kvm_factory.boot()
    root.write_file("/root/marker", b"from-kvm-base\n")
    base = root.freeze("itest-kvm-base", keep_running=False)
    yield base
    SnapshotStore(base.path.parent).remove(base.tag, cascade=True)


def _kvm_state(vm: Any) -> dict[str, Any]:
    return dict(vm.machine.qmp.execute("query-kvm"))


def test_kvm_children_run_under_kvm_with_the_host_cpu(kvm_base: Snapshot) -> None:
    child = kvm_base.fork(1)[0]
    try:
        assert _kvm_state(child) == {"enabled": True, "present": True}
        argv = Path(f"/proc/{child.machine.pid}/cmdline").read_bytes().split(b"\0")
        assert argv[argv.index(b"-cpu") + 1].decode() == KVM_CPU
        assert child.read_file("/root/marker") == b"from-kvm-base\n"
        assert child.exec(["uname", "-m"], check=True).stdout == b"x86_64\n"
    finally:
        child.close()


def test_kvm_siblings_are_isolated_and_branches_fork(kvm_base: Snapshot) -> None:
    first, second = kvm_base.fork(2)
    taken: list[Snapshot] = []
    try:
        first.write_file("/root/only-first", b"1\n")
        assert second.exec(["test", "-e", "/root/only-first"]).exit_code == 1
        branch = first.branch(backend="diff")
        taken.append(branch)
        (grandchild,) = branch.fork(1)
        try:
            assert _kvm_state(grandchild)["enabled"] is True
            assert grandchild.read_file("/root/only-first") == b"1\n"
            grandchild.write_file("/root/only-grandchild", b"g\n")
            assert first.exec(["test", "-e", "/root/only-grandchild"]).exit_code == 1
        finally:
            grandchild.close()
    finally:
        first.close()
        second.close()
        for snapshot in taken:
            SnapshotStore(snapshot.path.parent).remove(snapshot.tag, cascade=True)


def test_kvm_cpu_per_child_is_measured_and_has_no_translation(kvm_factory: VMFactory, kvm_base: Snapshot) -> None:
    """The bench's CPU part under KVM: every phase measured, and no TCG translation state."""
    result = measure_child_cpu(kvm_factory, kvm_base, lambda line: None, children=3, tax_children=1)
    per_phase = result["cpu_per_child_ms"]
    for name in ("qemu_start", "device_state", "first_reply", "first_command", "to_first_true"):
        assert per_phase[name]["n"] == 3 and per_phase[name]["min"] >= 0
    assert per_phase["to_first_true"]["min"] > 0
    assert "tcg_translation" not in result
    child = kvm_base.fork(1)[0]
    try:
        assert tcg_work(child) == {}
    finally:
        child.close()
