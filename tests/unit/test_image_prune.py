"""`forkd image prune`: superseded images go, named ones and those snapshots use stay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_forkd.cli import main
from pytest_forkd.image.catalog import MANIFEST_FILE, point_name
from pytest_forkd.storage.snapshot import Snapshot


def fake_image(images: Path, key: str) -> Path:
    directory = images / key
    directory.mkdir(parents=True)
    (directory / MANIFEST_FILE).write_text(json.dumps({"key": key}))
    (directory / "initrd.cpio").write_bytes(b"x" * 1024)
    return directory


def test_prune_keeps_named_and_snapshot_images(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FORKD_CACHE_DIR", str(tmp_path / "cache"))
    images = tmp_path / "cache" / "images"
    named, used, old = (fake_image(images, key) for key in ("aaaa", "bbbb", "cccc"))
    point_name("default", "aaaa")
    store = tmp_path / "store"
    (store / "base").mkdir(parents=True)
    Snapshot(
        tag="base",
        path=store / "base",
        backend="full",
        memory_mib=256,
        vcpus=1,
        image="default",
        fingerprint={"image": "bbbb"},
        state_file="state.bin",
        memory_file="memory.ram",
    ).save_to(store / "base")

    assert main(["image", "prune", "--store", str(store), "--dry-run"]) == 0
    assert "would remove cccc" in capsys.readouterr().out
    assert old.is_dir()

    assert main(["image", "prune", "--store", str(store)]) == 0
    output = capsys.readouterr().out
    assert "removed cccc" in output and "1 unused image(s)" in output
    assert not old.exists() and named.is_dir() and used.is_dir()


def test_prune_keeps_images_that_a_project_snapshot_uses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pytest_forkd.project.lifecycle import project_store

    monkeypatch.setenv("FORKD_CACHE_DIR", str(tmp_path / "cache"))
    images = tmp_path / "cache" / "images"
    used, old = (fake_image(images, key) for key in ("dddd", "eeee"))
    namespace = project_store(tmp_path / "store", tmp_path).root
    (namespace / "web").mkdir(parents=True)
    Snapshot(
        tag="web",
        path=namespace / "web",
        backend="full",
        memory_mib=256,
        vcpus=1,
        image="tools",
        fingerprint={"image": "dddd"},
        state_file="state.bin",
        memory_file="memory.ram",
    ).save_to(namespace / "web")

    assert main(["image", "prune", "--store", str(tmp_path / "store")]) == 0
    assert "removed eeee" in capsys.readouterr().out
    assert used.is_dir() and not old.exists()
