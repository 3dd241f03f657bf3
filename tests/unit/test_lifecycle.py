"""Snapshot lifecycle without VMs: project namespaces, expiry of kept failures, the size cap, ``forkd snapshots gc``."""

from __future__ import annotations

import os
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from pytest_forkd import cli
from pytest_forkd.errors import ConfigError
from pytest_forkd.project import lifecycle
from pytest_forkd.storage.snapshot import Snapshot
from pytest_forkd.storage.store import SnapshotStore

MIB = 1 << 20


@pytest.fixture(autouse=True)
def only_the_snapshots_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("snapshots",))
    monkeypatch.chdir(tmp_path)  # no forkd.yaml above the working directory


def publish(
    store: SnapshotStore,
    tag: str,
    *,
    mib: int = 1,
    hours_old: float = 0.0,
    used_hours_ago: float | None = None,
    **extra: Any,
) -> Snapshot:
    created = (datetime.now(timezone.utc) - timedelta(hours=hours_old)).isoformat(timespec="milliseconds")
    with store.begin(tag) as pending:
        (pending.dir / "state.bin").write_bytes(b"s" * 100)
        (pending.dir / "memory.ram").write_bytes(os.urandom(mib * MIB))
        snapshot = pending.publish(
            Snapshot(
                tag=tag,
                path=pending.dir,
                backend="full",
                memory_mib=256,
                vcpus=1,
                image="default",
                fingerprint={},
                state_file="state.bin",
                memory_file="memory.ram",
                created=created,
                extra=extra,
            )
        )
    used = time.time() - 3600 * (hours_old if used_hours_ago is None else used_hours_ago)
    os.utime(snapshot.path, (used, used))
    return snapshot


def failed(store: SnapshotStore, name: str, hours_old: float) -> Snapshot:
    return publish(store, f"failed-{name}", hours_old=hours_old, failed_test=f"test_x.py::{name}")


def tags(store: SnapshotStore) -> list[str]:
    return sorted(snapshot.tag for snapshot in store.list())


def test_project_ids_follow_the_real_path(tmp_path: Path) -> None:
    (tmp_path / "proj").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "proj")
    (tmp_path / "other" / "proj").mkdir(parents=True)

    assert lifecycle.project_id(tmp_path / "link") == lifecycle.project_id(tmp_path / "proj")
    assert lifecycle.project_id(tmp_path / "other" / "proj") != lifecycle.project_id(tmp_path / "proj")
    assert lifecycle.project_id(tmp_path / "proj").startswith("proj-")
    store = lifecycle.project_store(tmp_path / "store", tmp_path / "proj")
    assert store.root == tmp_path / "store" / ".projects" / lifecycle.project_id(tmp_path / "proj")


def test_namespaces_are_invisible_to_the_store_root(tmp_path: Path) -> None:
    root = SnapshotStore(tmp_path / "store")
    publish(root, "base", recipe_hash="r0")
    publish(lifecycle.project_store(root, tmp_path), "base", recipe_hash="r1")

    assert tags(root) == ["base"] and root.broken() == []
    assert [(project is None, tags(store)) for project, store in lifecycle.namespaces(root)] == [
        (True, ["base"]),
        (False, ["base"]),
    ]


def test_failures_expire_by_count_and_age(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "store")
    for index, hours in enumerate([1, 2, 3, 4, 200]):
        failed(store, f"t{index}", hours)
    publish(store, "failed-by-hand", hours_old=500)  # tagged by a user, not by --forkd-keep-failed

    removed = lifecycle.expire_failed(store, keep=3, max_age_s=7 * 86400)

    assert sorted(removal.tag for removal in removed) == ["failed-t3", "failed-t4"]
    assert tags(store) == ["failed-by-hand", "failed-t0", "failed-t1", "failed-t2"]
    assert "keep_failed_count" in next(r.reason for r in removed if r.tag == "failed-t3")

    removed = lifecycle.expire_failed(store, keep=10, max_age_s=1.5 * 3600)
    assert sorted(removal.tag for removal in removed) == ["failed-t1", "failed-t2"]
    assert "keep_failed_age" in removed[0].reason


def test_the_cap_evicts_least_recently_used_recipe_snapshots_only(tmp_path: Path) -> None:
    root = SnapshotStore(tmp_path / "store")
    project = lifecycle.project_store(root, tmp_path)
    publish(root, "base", mib=2, recipe_hash="b", used_hours_ago=1)
    publish(project, "old-recipe", mib=2, recipe_hash="o", used_hours_ago=50)
    publish(project, "older-recipe", mib=2, recipe_hash="p", used_hours_ago=90)
    publish(project, "my-tag", mib=2, hours_old=100)  # no recipe: a user's, never evicted
    failed(project, "boom", 100)

    removed = lifecycle.evict(root, 6 * MIB)  # 9 MiB stored, 4 of them evictable

    assert [removal.tag for removal in removed] == ["older-recipe", "old-recipe"]
    assert tags(project) == ["failed-boom", "my-tag"] and tags(root) == ["base"]
    # Even far over the cap, what remains is the user's or in use.
    assert [removal.tag for removal in lifecycle.evict(root, 1, keep=[root.get("base").path])] == []


def test_evicting_keeps_snapshots_others_depend_on(tmp_path: Path) -> None:
    root = SnapshotStore(tmp_path / "store")
    publish(root, "base", recipe_hash="b", used_hours_ago=100)
    publish(root, "child", recipe_hash="c", used_hours_ago=1, parent=None)
    child = root.get("child")
    child.replace(parent="base").save_to(child.path)

    assert [removal.tag for removal in lifecycle.evict(root, 1)] == ["child"]
    assert tags(root) == ["base"]


def test_gc_command_dry_run_then_removal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = SnapshotStore(tmp_path / "store")
    project = lifecycle.project_store(root, tmp_path / "proj")
    for index in range(4):
        failed(project, f"t{index}", index + 1)
    publish(root, "base", mib=3, recipe_hash="b", used_hours_ago=10)

    assert (
        cli.main(
            [
                "snapshots",
                "gc",
                "--store",
                str(root.root),
                "--keep-failed-count",
                "2",
                "--max-size",
                "2MiB",
                "--dry-run",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "would remove failed-t2 (project proj-" in out and "would remove base," in out
    assert "least recently used recipe snapshot" in out
    assert len(tags(project)) == 4

    assert cli.main(["snapshots", "gc", "--store", str(root.root), "--keep-failed-count", "2"]) == 0
    assert tags(project) == ["failed-t0", "failed-t1"] and tags(root) == ["base"]
    assert "2 snapshot(s)" in capsys.readouterr().out


def test_gc_reads_its_limits_from_forkd_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "proj"
    folder.mkdir()
    (folder / "forkd.yaml").write_text("settings:\n  keep_failed_count: 1\n  keep_failed_age: 2h\n")
    root = SnapshotStore(tmp_path / "store")
    project = lifecycle.project_store(root, folder)
    failed(project, "new", 0.5)
    failed(project, "newer", 0.1)

    assert cli.main(["snapshots", "gc", "--store", str(root.root), "--project", str(folder)]) == 0
    assert tags(project) == ["failed-newer"]

    assert cli.main(["snapshots", "ls", "--store", str(root.root), "--project", str(folder)]) == 0
    lines = capsys.readouterr().out.splitlines()
    row = next(line for line in lines if line.startswith("failed-newer"))
    assert row.split()[-1] == lifecycle.project_id(folder)
    assert "ago" in row


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("7d", 7 * 86400),
        ("12h", 43200),
        ("30m", 1800),
        ("90s", 90),
        ("2w", 14 * 86400),
        (3, 3 * 86400),
        ("1.5", 1.5 * 86400),
    ],
)
def test_ages(text: object, seconds: float) -> None:
    assert lifecycle.parse_age(text, "x") == seconds


@pytest.mark.parametrize(
    ("text", "size"),
    [("20GiB", 20 << 30), ("500M", 500 << 20), ("1t", 1 << 40), (4096, 4096), ("none", None), ("0", None)],
)
def test_sizes(text: object, size: int | None) -> None:
    assert lifecycle.parse_size(text, "x") == size


@pytest.mark.parametrize(
    ("parse", "value", "message"),
    [
        (lifecycle.parse_age, "soon", "x: expected an age such as 7d"),
        (lifecycle.parse_age, True, "x: expected an age"),
        (lifecycle.parse_size, "lots", "x: expected a size such as 20GiB"),
        (lifecycle.parse_count, -1, "x: expected a whole number >= 0"),
    ],
)
def test_bad_values_name_the_key(parse: Any, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(value, "x")


def test_evicting_spares_a_snapshot_whose_memory_a_process_maps(tmp_path: Path) -> None:
    import mmap

    root = SnapshotStore(tmp_path / "store")
    in_use = publish(root, "in-use", recipe_hash="a", used_hours_ago=100)
    publish(root, "idle", recipe_hash="b", used_hours_ago=1)

    with open(in_use.memory_path, "rb") as memory, mmap.mmap(memory.fileno(), 0, prot=mmap.PROT_READ):
        assert str(in_use.memory_path.resolve()) in lifecycle.mapped_files()
        assert [removal.tag for removal in lifecycle.evict(root, 1)] == ["idle"]
    assert tags(root) == ["in-use"]
