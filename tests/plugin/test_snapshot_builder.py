"""Publishing built snapshots and naming unknown ones (no VM)."""

from __future__ import annotations

import os

import pytest

from pytest_forkd.errors import ConfigError, SnapshotError
from pytest_forkd.project.config import parse_project
from pytest_forkd.project.snapshot_builder import publish_copy, unknown_snapshot_error
from pytest_forkd.storage.snapshot import Snapshot
from pytest_forkd.storage.store import SnapshotStore

MIB = 1 << 20


def flat_snapshot(store: SnapshotStore, tag: str, marker: bytes) -> Snapshot:
    """A published snapshot with a sparse 8 MiB memory file holding ``marker`` at 4 MiB."""
    with store.begin(tag) as pending:
        (pending.dir / "state.bin").write_bytes(b"device state " + marker)
        with open(pending.dir / "memory.ram", "wb") as memory:
            memory.truncate(8 * MIB)
            memory.seek(4 * MIB)
            memory.write(marker)
        return pending.publish(
            Snapshot(
                tag=tag,
                path=pending.dir,
                backend="full",
                memory_mib=8,
                vcpus=1,
                image="default",
                fingerprint={"qemu": "7.2"},
                state_file="state.bin",
                memory_file="memory.ram",
                extra={"kept": 1},
            )
        )


def test_publish_copy_replaces_and_keeps_holes(tmp_path):
    staging, persistent = SnapshotStore(tmp_path / "staging"), SnapshotStore(tmp_path / "persistent")
    old = publish_copy(flat_snapshot(staging, "old", b"first"), persistent, "tools")
    old_memory = open(old.memory_path, "rb")  # a child mapping the old snapshot keeps its files

    published = publish_copy(
        flat_snapshot(staging, "new", b"second"), persistent, "tools", extra={"recipe_hash": "abc"}
    )

    assert published.tag == "tools" and published.path == persistent.root / "tools"
    assert dict(persistent.get("tools").extra) == {"kept": 1, "recipe_hash": "abc"}
    memory = published.memory_path.read_bytes()
    assert len(memory) == 8 * MIB and memory[4 * MIB : 4 * MIB + 6] == b"second"
    assert os.stat(published.memory_path).st_blocks * 512 < MIB  # holes stayed holes
    assert published.state_path.read_bytes() == b"device state second"
    old_memory.seek(4 * MIB)
    assert old_memory.read(5) == b"first"
    old_memory.close()


def test_publish_copy_refuses_diffs(tmp_path):
    diff = Snapshot(
        tag="d",
        path=tmp_path,
        backend="diff",
        memory_mib=8,
        vcpus=1,
        image="default",
        fingerprint={},
        state_file="state.bin",
        base="base",
        diff_file="memory.diff",
    )
    with pytest.raises(SnapshotError, match="is a diff against 'base'; only a flat snapshot"):
        publish_copy(diff, SnapshotStore(tmp_path / "store"), "copy")


def test_unknown_snapshot_lists_declared_and_stored(tmp_path):
    store = SnapshotStore(tmp_path / "store")
    flat_snapshot(store, "failed-test_x", b"x")
    project = parse_project({"snapshots": {"tools": {}}}, path=tmp_path / "forkd.yaml")
    error = unknown_snapshot_error("nope", project, store)
    assert isinstance(error, ConfigError)
    assert str(error).startswith(
        f"unknown snapshot 'nope': declared snapshots: base, tools; other snapshots in {store.root}: failed-test_x. "
        f"Declare 'nope' under `snapshots:` in {tmp_path / 'forkd.yaml'}"
    )
