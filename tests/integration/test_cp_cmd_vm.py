"""``forkd cp`` against real guests: into a new snapshot and back out, the old snapshot unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
from trees import differences, listing, make_tree

from pytest_forkd.cli import main
from pytest_forkd.project.snapshot_builder import publish_copy
from pytest_forkd.storage.snapshot import Snapshot
from pytest_forkd.storage.store import SnapshotStore


def test_copy_into_a_new_snapshot_and_back_out(
    base_snapshot: Snapshot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # outside any project: snapshots go to the store root
    store = SnapshotStore(tmp_path / "store")
    publish_copy(base_snapshot, store, "cpbase")
    make_tree(tmp_path / "src", files=50, total_bytes=1 << 20)
    (tmp_path / "src" / "junk.pyc").write_bytes(b"left out")

    assert (
        main(
            [
                "cp",
                "--store",
                str(store.root),
                "--exclude",
                "*.pyc",
                str(tmp_path / "src"),
                "cpbase:/srv/app",
                "--save",
                "cpbase-app",
            ]
        )
        == 0
    )
    assert "saved snapshot 'cpbase-app'" in capsys.readouterr().err
    assert main(["cp", "--store", str(store.root), "cpbase-app:/srv/app", str(tmp_path / "out")]) == 0

    expected = listing(tmp_path / "src")
    del expected["junk.pyc"]
    assert differences(expected, listing(tmp_path / "out")) == []
    assert store.get("cpbase-app").extra["copied_into"] == "/srv/app"
    capsys.readouterr()
    assert main(["cp", "--store", str(store.root), "cpbase:/srv/app", str(tmp_path / "out2")]) == 1
    assert "/srv/app" in capsys.readouterr().err  # the snapshot copied from never changed
    assert not (tmp_path / "out2").exists()
