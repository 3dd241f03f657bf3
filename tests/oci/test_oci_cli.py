"""`forkd image pull / ls / prune` on container images, against the real registry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from oci_images import LayerTar, WrittenImage, push, write_layout
from registry import Registry, needs_registry

from pytest_forkd.cli import main
from pytest_forkd.image.catalog import MANIFEST_FILE
from pytest_forkd.image.oci import list_pulled, store
from pytest_forkd.storage.snapshot import Snapshot

pytestmark = [pytest.mark.slow, needs_registry]


def one_layer_image(layout: Path, text: str) -> WrittenImage:
    return write_layout(layout, [(LayerTar().file("f.txt", text * 500), "gzip")], tag="1")


def test_pull_then_ls_shows_reference_digest_size_and_snapshots(
    registry: Registry, image_store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reference = registry.reference("cli/listed:1")
    written = one_layer_image(tmp_path / "layout", "listed")
    push(written, reference)
    assert main(["image", "pull", reference]) == 0
    captured = capsys.readouterr()
    [image] = list_pulled()
    assert image.digest in captured.out and reference in captured.out
    assert f"pulling {reference}" in captured.err  # progress goes to stderr

    # A guest image made from it (as the container image code publishes them) and a snapshot taken on it.
    guest_image = image_store.parent / "images" / "c0ffee"
    guest_image.mkdir(parents=True)
    (guest_image / MANIFEST_FILE).write_text(
        json.dumps({"key": "c0ffee", "container": {"reference": reference, "digest": image.digest}})
    )
    snapshots = tmp_path / "snapshots"
    (snapshots / "on-image").mkdir(parents=True)
    Snapshot(
        tag="on-image",
        path=snapshots / "on-image",
        backend="full",
        memory_mib=256,
        vcpus=1,
        image="listed",
        fingerprint={"image": "c0ffee"},
        state_file="state.bin",
        memory_file="memory.ram",
    ).save_to(snapshots / "on-image")

    assert main(["image", "ls", "--store", str(snapshots)]) == 0
    listing = capsys.readouterr().out
    row = next(line for line in listing.splitlines() if line.startswith(reference))
    assert image.digest[:19] in row and "MiB" in row and row.rstrip().endswith("on-image")


def test_usage_errors_exit_4_and_failures_exit_1_in_one_line(
    registry: Registry, image_store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["image", "pull", "UPPER/case"]) == 4
    error = capsys.readouterr().err
    assert error.startswith("forkd: error: invalid image reference") and error.count("\n") == 1
    assert "Traceback" not in error

    assert main(["image", "pull", registry.reference("cli/missing:1")]) == 1
    error = capsys.readouterr().err
    assert "no such repository or tag" in error and error.count("forkd: error:") == 1 and "Traceback" not in error

    assert main(["image", "pull", registry.reference("cli/missing:1"), "--policy", "never"]) == 1
    assert "pull policy is 'never'" in capsys.readouterr().err


def test_prune_removes_layers_and_disks_no_pulled_image_has(
    registry: Registry, image_store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reference = registry.reference("cli/moving:1")
    first = one_layer_image(tmp_path / "first", "first")
    push(first, reference)
    assert main(["image", "pull", reference]) == 0
    old = list_pulled()[0]
    second = one_layer_image(tmp_path / "second", "second")
    push(second, reference)
    assert main(["image", "pull", reference]) == 0  # `forkd image pull` asks the registry again
    new = list_pulled()[0]
    assert new.digest != old.digest

    disks = image_store / "disks"
    disks.mkdir()
    old_disk = disks / f"{old.digest.split(':')[1]}.ext4"
    new_disk = disks / f"{new.digest.split(':')[1]}.ext4"
    kept_by_a_guest_image = disks / f"{'e' * 64}.ext4"
    for disk in (old_disk, new_disk, kept_by_a_guest_image):
        disk.write_bytes(b"\0" * 4096)
    guest_image = image_store.parent / "images" / "feed"
    guest_image.mkdir(parents=True)
    (guest_image / MANIFEST_FILE).write_text(json.dumps({"key": "feed", "container": {"digest": f"sha256:{'e' * 64}"}}))
    from pytest_forkd.image.catalog import point_name

    point_name("kept", "feed")
    capsys.readouterr()

    assert main(["image", "prune", "--store", str(tmp_path / "snapshots"), "--dry-run"]) == 0
    assert "would remove" in capsys.readouterr().out
    assert store.blob_path(old.layers[0].digest).exists() and old_disk.exists()

    assert main(["image", "prune", "--store", str(tmp_path / "snapshots")]) == 0
    output = capsys.readouterr().out
    assert "unused layer blob(s), 1 unused disk(s)" in output
    assert not store.blob_path(old.layers[0].digest).exists()
    assert not store.blob_path(old.digest).exists()
    assert not old_disk.exists()
    assert new_disk.exists() and kept_by_a_guest_image.exists()
    assert all(layer.path.exists() for layer in new.layers)
    assert [image.digest for image in list_pulled()] == [new.digest]
    layout_index = json.loads((image_store / "layout" / "index.json").read_text())
    assert [entry["digest"] for entry in layout_index["manifests"]] == [new.digest]
