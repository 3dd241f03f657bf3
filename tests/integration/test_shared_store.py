"""A snapshot store shared between hosts: used read-only, never written, built once and reused.

The read-only case runs in a private mount namespace (``unshare -m``) with a
read-only bind mount of a store, as a runner would see an NFS export or a CI
cache mounted read-only; it needs root.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_forkd.core.factory import VMFactory
from pytest_forkd.project.snapshot_builder import publish_copy
from pytest_forkd.storage.snapshot import Snapshot
from pytest_forkd.storage.store import SnapshotStore

INSIDE = r"""
import json, sys
from pytest_forkd import import_snapshot
from pytest_forkd.errors import ForkdError
from pytest_forkd.core.factory import VMFactory
from pytest_forkd.project.config import EMPTY_PROJECT
from pytest_forkd.project.snapshot_builder import SnapshotBuilder
from pytest_forkd.storage.store import SnapshotStore

store, tag, archive, accel = SnapshotStore(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
out = {"read_only": store.read_only_reason()}
factory = VMFactory(accel=accel)
try:
    children = factory.fork_snapshot(store.get(tag), 2)
    out["markers"] = [child.read_file("/root/marker").decode() for child in children]
    for child in children:
        child.close()
    for name, action in [
        ("import", lambda: import_snapshot(archive, store=store, name="another")),
        ("build", lambda: SnapshotBuilder(factory, store, EMPTY_PROJECT).get("base")),
        ("remove", lambda: store.remove(tag)),
    ]:
        try:
            action()
            out[name] = "no error"
        except ForkdError as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
finally:
    factory.close()
print(json.dumps(out))
"""


def listing(root: Path) -> list[tuple[str, int, float]]:
    return sorted((str(path.relative_to(root)), path.stat().st_size, path.stat().st_mtime) for path in root.rglob("*"))


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare(1) for a read-only bind mount"
)
def test_a_read_only_store_is_restored_from_and_never_written(
    factory: VMFactory, base_snapshot: Snapshot, tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    snapshot = publish_copy(base_snapshot, SnapshotStore(shared), "shared-base")
    archive = tmp_path / "shared-base.forkd.tar.zst"
    snapshot.with_owner(factory).export(archive)
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    before = listing(shared)
    accel = factory.accel_verdict(factory._image_of(snapshot)).accel
    script = (
        f"mount --bind {shared} {mountpoint} && mount -o remount,bind,ro {mountpoint} && "
        f'exec {sys.executable} -c "$0" {mountpoint} shared-base {archive} {accel}'
    )

    result = subprocess.run(["unshare", "-m", "sh", "-c", script, INSIDE], capture_output=True, text=True, timeout=300)

    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.splitlines()[-1])
    assert "read-only filesystem" in out["read_only"]
    assert out["markers"] == ["from-base\n", "from-base\n"]  # restored from the read-only store
    assert out["import"].startswith("SnapshotError") and "read-only" in out["import"] and "\n" not in out["import"]
    assert (
        out["build"].startswith("SnapshotError")
        and "'base'" in out["build"]
        and "missing from the read-only" in out["build"]
    )
    assert out["remove"].startswith("SnapshotError") and "read-only" in out["remove"]
    assert listing(shared) == before  # nothing written: no lock file, no temporary directory


def test_a_build_on_one_host_is_reused_by_another(
    factory: VMFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another host of the same kind differs in its measured TSC frequency: the shared build still fits it."""
    import pytest_forkd.engine.qemu.machine as qemu_module
    from pytest_forkd.project.config import EMPTY_PROJECT
    from pytest_forkd.project.snapshot_builder import SnapshotBuilder

    shared = SnapshotStore(tmp_path / "shared")
    built = SnapshotBuilder(factory, shared, EMPTY_PROJECT)
    first = built.get("base")
    monkeypatch.setattr(qemu_module, "tsc_khz", lambda: 1_999_999)  # "the other host"
    other_factory = VMFactory(accel=factory.requested_accel)
    try:
        reused = SnapshotBuilder(other_factory, shared, EMPTY_PROJECT)
        second = reused.get("base")
        child = other_factory.fork_snapshot(second, 1)[0]
        try:
            assert child.exec("true").ok
        finally:
            child.close()
    finally:
        other_factory.close()

    assert [event.action for event in built.events] == ["built"]
    assert [event.action for event in reused.events] == ["cached"]
    assert second.path == first.path and second.extra["recipe_hash"] == first.extra["recipe_hash"]
