"""``forkd snapshots ls|info|rm`` through the real command-line entry point."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pytest_forkd import cli
from pytest_forkd.storage.snapshot import Snapshot
from pytest_forkd.storage.store import SnapshotStore


@pytest.fixture(autouse=True)
def only_the_snapshots_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """Build the parser with this command alone, so these tests need nothing else importable."""
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("snapshots",))


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SnapshotStore:
    monkeypatch.setenv("FORKD_STORE", str(tmp_path / "default-store"))
    return SnapshotStore(tmp_path / "store")


def publish(store: SnapshotStore, tag: str, **changes: Any) -> Snapshot:
    fields: dict[str, Any] = dict(
        backend="full",
        memory_mib=256,
        vcpus=1,
        image="default",
        fingerprint={"qemu_version": "7.2.0", "image": "img-1"},
        state_file="state.bin",
        memory_file="memory.ram",
    )
    fields.update(changes)
    with store.begin(tag) as pending:
        (pending.dir / "state.bin").write_bytes(b"s" * 9000)
        for name in (fields.get("memory_file"), fields.get("diff_file")):
            if name:
                (pending.dir / name).write_bytes(b"m" * 3 * 1024 * 1024)
        return pending.publish(Snapshot(tag=tag, path=pending.dir, **fields))


def run(*argv: str) -> int:
    return cli.main(list(argv))


def test_ls_of_an_empty_store(store: SnapshotStore, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("snapshots", "ls", "--store", str(store.root)) == 0

    assert capsys.readouterr().out == f"no snapshots in {store.root}\n"


def test_ls_prints_a_table_oldest_first(store: SnapshotStore, capsys: pytest.CaptureFixture[str]) -> None:
    publish(store, "root", created="2024-05-01T10:00:00.000+00:00")
    publish(
        store,
        "cp1",
        backend="diff",
        memory_file=None,
        diff_file="memory.diff",
        base="root",
        created="2024-05-01T11:30:15.250+00:00",
    )
    publish(store, "live", backend="uffd", status="writing", memory_mib=1024, created="2024-05-01T12:00:00.000+00:00")

    assert run("snapshots", "ls", "--store", str(store.root)) == 0

    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "TAG",
        "BACKEND",
        "STATUS",
        "MEMORY",
        "ON",
        "DISK",
        "BASE",
        "CREATED",
        "(UTC)",
        "AGE",
        "LAST",
        "USED",
        "PROJECT",
    ]
    assert lines[1].split()[:10] == ["root", "full", "ready", "256", "MiB", "3.0", "MiB", "-", "2024-05-01", "10:00:00"]
    assert lines[1].split()[-1] == "shared"
    assert lines[2].split()[:10] == [
        "cp1",
        "diff",
        "ready",
        "256",
        "MiB",
        "3.0",
        "MiB",
        "root",
        "2024-05-01",
        "11:30:15",
    ]
    assert lines[3].split()[:5] == ["live", "uffd", "writing", "1024", "MiB"]
    assert len(lines) == 4


def test_ls_shows_broken_entries_with_their_problem(store: SnapshotStore, capsys: pytest.CaptureFixture[str]) -> None:
    publish(store, "good")
    (store.root / "junk").mkdir()

    assert run("snapshots", "ls", "--store", str(store.root)) == 0

    out = capsys.readouterr().out
    assert [line.split()[:3] for line in out.splitlines()[1:3]] == [["good", "full", "ready"], ["junk", "-", "broken"]]
    assert f"junk: cannot read snapshot {store.root / 'junk' / 'snapshot.json'}" in out
    assert f"forkd snapshots rm junk --store {store.root}" in out


def test_ls_uses_forkd_store_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FORKD_STORE", str(tmp_path / "from-env"))
    publish(SnapshotStore(tmp_path / "from-env"), "env-snapshot")

    assert run("snapshots", "ls") == 0

    assert "env-snapshot" in capsys.readouterr().out


def test_info_shows_metadata_sizes_chain_and_dependents(
    store: SnapshotStore, capsys: pytest.CaptureFixture[str]
) -> None:
    publish(store, "root", pause_ms=4.5, extra={"pagemap": {"present": 12}})
    publish(store, "cp1", backend="diff", memory_file=None, diff_file="memory.diff", base="root", parent="root")

    assert run("snapshots", "info", "root", "--store", str(store.root)) == 0
    root_info = capsys.readouterr().out
    assert run("snapshots", "info", "cp1", "--store", str(store.root)) == 0
    cp1_info = capsys.readouterr().out

    assert "tag:           root\n" in root_info
    assert f"path:          {store.root / 'root'}\n" in root_info
    assert "memory file:   memory.ram\n" in root_info
    assert "pause:         4.5 ms\n" in root_info
    assert "size on disk:  3.0 MiB allocated, 3.0 MiB apparent\n" in root_info
    assert "dependents:    cp1\n" in root_info
    assert "fingerprint:\n  qemu_version: 7.2.0\n  image: img-1\n" in root_info
    assert 'extra:\n  pagemap: {"present": 12}\n' in root_info
    assert "error:" not in root_info  # empty fields are left out
    assert "base chain:    cp1 -> root\n" in cp1_info
    assert "dependents:    none\n" in cp1_info
    assert "diff file:     memory.diff\n" in cp1_info


def test_info_of_an_unknown_tag_exits_1_and_lists_available(
    store: SnapshotStore, capsys: pytest.CaptureFixture[str]
) -> None:
    publish(store, "root")

    assert run("snapshots", "info", "nope", "--store", str(store.root)) == 1

    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("forkd: error: unknown snapshot 'nope'")
    assert "available: root" in captured.err


def test_info_of_an_invalid_tag_exits_4(store: SnapshotStore, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("snapshots", "info", "../etc", "--store", str(store.root)) == 4

    assert "invalid snapshot name '../etc'" in capsys.readouterr().err


def test_rm_removes_a_snapshot(store: SnapshotStore, capsys: pytest.CaptureFixture[str]) -> None:
    publish(store, "root")
    publish(store, "other")

    assert run("snapshots", "rm", "root", "--store", str(store.root)) == 0

    assert capsys.readouterr().out == "removed root\n"
    assert [snapshot.tag for snapshot in store.list()] == ["other"]


def test_rm_with_dependents_needs_cascade(store: SnapshotStore, capsys: pytest.CaptureFixture[str]) -> None:
    publish(store, "root")
    publish(store, "cp1", backend="diff", memory_file=None, diff_file="memory.diff", base="root")

    assert run("snapshots", "rm", "root", "--store", str(store.root)) == 1
    refused = capsys.readouterr()
    assert "cp1 (diff against it)" in refused.err and "--cascade" in refused.err
    assert store.exists("root") and store.exists("cp1")

    assert run("snapshots", "rm", "root", "--cascade", "--store", str(store.root)) == 0
    assert capsys.readouterr().out == "removed cp1\nremoved root\n"
    assert store.list() == []


def test_rm_of_an_unknown_tag_exits_1(store: SnapshotStore, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("snapshots", "rm", "nope", "--store", str(store.root)) == 1

    assert "available: none yet" in capsys.readouterr().err


@pytest.mark.parametrize(
    "words",
    [
        ("snapshots",),
        ("snapshots", "list"),
        ("snapshots", "--store", "STORE"),
        ("snapshots", "list", "--store", "STORE"),
    ],
)
def test_no_action_or_list_lists_as_ls_does(
    store: SnapshotStore, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, words: tuple[str, ...]
) -> None:
    monkeypatch.setenv("FORKD_STORE", str(store.root))
    publish(store, "root")
    assert run("snapshots", "ls", "--store", str(store.root)) == 0
    listed = capsys.readouterr().out

    assert run(*(str(store.root) if word == "STORE" else word for word in words)) == 0

    assert capsys.readouterr().out == listed
    assert "root" in listed


def test_a_misspelt_action_is_refused_with_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        run("snapshots", "lst")

    assert exited.value.code != 0
    err = capsys.readouterr().err
    assert "invalid choice: 'lst'" in err and "'ls', 'list'" in err


def test_help_names_the_default_action_and_its_alias(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        run("snapshots", "--help")

    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "ls (list)" in out and "(the default)" in out
