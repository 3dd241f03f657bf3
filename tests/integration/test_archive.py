"""Portable snapshots against real QEMU: export, wipe the cache, import, fork.

The round trip runs through a fresh cache directory (images, store, host
verdicts), as on another runner: the child of the imported snapshot must see
exactly the files the original VM had.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Iterator

import pytest

import pytest_forkd
from pytest_forkd.archives import archive
from pytest_forkd.core.factory import VMFactory
from pytest_forkd.core.vm import VM
from pytest_forkd.engine.qemu.host import find_qemu
from pytest_forkd.errors import ArchiveError, IncompatibleSnapshot, SnapshotError
from pytest_forkd.storage import zstdio
from pytest_forkd.storage.snapshot import Snapshot
from pytest_forkd.storage.store import SnapshotStore

FILES = ["/root/data/random.bin", "/root/data/notes.txt", "/root/marker"]


def guest_hashes(vm: VM) -> dict[str, str]:
    result = vm.exec(["sha256sum", *FILES], check=True)
    return {line.split()[1]: line.split()[0] for line in result.stdout.splitlines()}


@pytest.fixture(scope="module")
def exported(
    factory: VMFactory, base_snapshot: Snapshot, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, str], str]:
    """A child of the base with new files, branched with the diff backend and exported.

    Returns the archive, the files' hashes in the original VM, and the accelerator it ran with.
    """
    vm = base_snapshot.fork(1)[0]
    try:
        vm.exec("mkdir -p /root/data && head -c 3000000 /dev/urandom > /root/data/random.bin", check=True)
        vm.write_file("/root/data/notes.txt", b"exported from the original parent\n")
        hashes = guest_hashes(vm)
        snapshot = vm.branch("itest-export", backend="diff")
    finally:
        vm.close()
    path = tmp_path_factory.mktemp("archives") / "itest.forkd.tar.zst"
    assert snapshot.export(path) == path
    return path, hashes, vm.machine.spec.accel


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty pytest-forkd cache, as on a runner that never built anything."""
    cache = tmp_path / "fresh-cache"
    monkeypatch.setenv("FORKD_CACHE_DIR", str(cache))
    monkeypatch.delenv("FORKD_STORE", raising=False)
    return cache


@pytest.fixture
def fresh_factory(fresh_cache: Path, exported: tuple[Path, dict[str, str], str]) -> Iterator[VMFactory]:
    factory = VMFactory(accel=exported[2])
    yield factory
    factory.close()


def test_export_wipe_import_fork_gives_the_parents_files(
    exported: tuple[Path, dict[str, str], str], fresh_cache: Path, fresh_factory: VMFactory
) -> None:
    path, hashes, _accel = exported

    imported = pytest_forkd.import_snapshot(path)
    child = fresh_factory.fork_snapshot(imported, 1)[0]
    try:
        assert guest_hashes(child) == hashes
    finally:
        child.close()
    assert imported.path.parent == fresh_cache / "snapshots"
    assert imported.memory_file and imported.diff_file is None and imported.base is None  # flattened
    assert (fresh_cache / "images" / imported.fingerprint["image"] / "vmlinuz").is_file()


def test_an_import_forks_on_its_own(
    exported: tuple[Path, dict[str, str], str], fresh_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``import_snapshot(path).fork()``: no factory to set up (the one behind pytest_forkd.boot is used)."""
    path, hashes, accel = exported
    import pytest_forkd.core.factory as factory_module

    monkeypatch.setattr(factory_module, "_default_factories", {})
    imported = pytest_forkd.import_snapshot(path)
    try:
        child = imported.fork(1)[0]
        try:
            assert guest_hashes(child) == hashes
        finally:
            child.close()
    finally:
        for factory in factory_module._default_factories.values():
            factory.close()


def test_the_archive_is_compressed_and_its_manifest_says_what_restore_needs(
    exported: tuple[Path, dict[str, str], str], fresh_cache: Path
) -> None:
    path, _hashes, accel = exported

    manifest = archive.read_archive_manifest(path)

    assert manifest["format_version"] == archive.ARCHIVE_VERSION and manifest["accel"] == accel
    assert manifest["memory_mib"] == 256 and manifest["machine"] == "microvm" and manifest["cpu_model"]
    assert manifest["qemu_version"] == find_qemu().version and manifest["machine_args"]
    memory_entry = next(entry for entry in manifest["files"] if entry.get("extents") is not None)
    assert memory_entry["size"] == 256 << 20 and memory_entry["stored"] < memory_entry["size"]
    assert {entry["path"] for entry in manifest["files"]} >= {
        "snapshot/snapshot.json",
        "snapshot/state.bin",
        "image/vmlinuz",
        "image/initrd.cpio",
    }


def test_import_imports_the_image_once_and_refuses_an_existing_name(
    exported: tuple[Path, dict[str, str], str], fresh_cache: Path, fresh_factory: VMFactory
) -> None:
    path, hashes, _accel = exported
    first = pytest_forkd.import_snapshot(path)

    with pytest.raises(SnapshotError, match="already exists.*--replace"):
        pytest_forkd.import_snapshot(path)
    again = pytest_forkd.import_snapshot(path, replace=True)
    renamed = pytest_forkd.import_snapshot(path, name="itest-renamed")

    assert again.path == first.path and renamed.tag == "itest-renamed"
    child = fresh_factory.fork_snapshot(renamed, 1)[0]
    try:
        assert guest_hashes(child) == hashes
    finally:
        child.close()
    assert sorted(name for name in os.listdir(fresh_cache / "snapshots") if not name.startswith(".")) == [
        "itest-export",
        "itest-renamed",
    ]


def _rewrite(source: Path, target: Path, change) -> None:
    """Copy an archive, letting ``change(manifest)`` edit its manifest."""
    with (
        zstdio.decompressing(source) as raw,
        tarfile.open(fileobj=raw, mode="r|") as tar_in,
        zstdio.compressing(target) as out,
        tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar_out,
    ):
        for member in tar_in:
            data = tar_in.extractfile(member).read()
            if member.name == archive.MANIFEST_NAME:
                manifest = json.loads(data)
                change(manifest)
                data = json.dumps(manifest).encode()
                member.size = len(data)
            tar_out.addfile(member, io.BytesIO(data))


def test_a_manifest_naming_another_qemu_version_is_refused(
    exported: tuple[Path, dict[str, str], str], fresh_cache: Path, tmp_path: Path
) -> None:
    path, _hashes, _accel = exported
    other = tmp_path / "qemu10.forkd.tar.zst"
    _rewrite(path, other, lambda manifest: manifest.update(qemu_version="10.0.2"))

    with pytest.raises(IncompatibleSnapshot, match=r"QEMU 10\.0\.2 and this host runs QEMU 7\.2"):
        pytest_forkd.import_snapshot(other)
    result = subprocess.run(
        [sys.executable, "-m", "pytest_forkd.cli", "snapshots", "import", str(other)],
        capture_output=True,
        text=True,
        env={**os.environ},
    )
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and "QEMU 10.0.2" in result.stderr
    assert not (fresh_cache / "snapshots" / "itest-export").exists()
    assert not any((fresh_cache / "images").glob("*/vmlinuz")) if (fresh_cache / "images").exists() else True


def test_a_kvm_host_cpu_snapshot_from_another_cpu_is_refused(
    exported: tuple[Path, dict[str, str], str], fresh_cache: Path, tmp_path: Path
) -> None:
    path, _hashes, _accel = exported
    other = tmp_path / "kvm.forkd.tar.zst"

    def from_another_cpu(manifest: dict) -> None:
        manifest.update(accel="kvm", cpu_model="host")
        manifest["host"]["cpu"] = {"model": "Imaginary CPU 9000", "flags_sha256": "0" * 16}

    _rewrite(path, other, from_another_cpu)

    with pytest.raises(IncompatibleSnapshot, match="-cpu host on 'Imaginary CPU 9000 \\(flags 0+\\)'"):
        pytest_forkd.import_snapshot(other)


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_damaged_archive_is_refused_and_leaves_nothing(
    exported: tuple[Path, dict[str, str], str], fresh_cache: Path, tmp_path: Path, damage: str
) -> None:
    path, _hashes, _accel = exported
    broken = tmp_path / f"{damage}.forkd.tar.zst"
    if damage == "truncated":
        broken.write_bytes(path.read_bytes()[: path.stat().st_size * 2 // 3])
    else:
        # Re-pack with one byte of the device state changed: a valid zstd stream whose content is wrong.
        with zstdio.decompressing(path) as raw:
            plain = bytearray(raw.read())
        header = next(
            offset for offset in range(0, len(plain), 512) if plain[offset : offset + 18] == b"snapshot/state.bin"
        )
        plain[header + 512 + 100] ^= 0xFF  # inside the member's data, right after its header
        with zstdio.compressing(broken) as out:
            out.write(bytes(plain))

    with pytest.raises(ArchiveError) as caught:
        pytest_forkd.import_snapshot(broken)

    assert "\n" not in str(caught.value)
    assert ("truncated" in str(caught.value)) if damage == "truncated" else ("corrupt" in str(caught.value))
    store = SnapshotStore(fresh_cache / "snapshots")
    assert store.list() == [] and store.broken() == []
    leftovers = [p for p in (fresh_cache / "snapshots").glob(".tmp-*")] if (fresh_cache / "snapshots").exists() else []
    assert leftovers == []
    images = fresh_cache / "images"
    assert not images.exists() or not [p for p in images.iterdir() if p.name.startswith(".import-")]


def test_the_cli_exports_and_imports(
    exported: tuple[Path, dict[str, str], str], fresh_cache: Path, tmp_path: Path
) -> None:
    path, _hashes, _accel = exported
    store = tmp_path / "cli-store"
    forkd = [sys.executable, "-m", "pytest_forkd.cli", "snapshots"]

    imported = subprocess.run([*forkd, "import", str(path), "--store", str(store)], capture_output=True, text=True)
    again = subprocess.run([*forkd, "import", str(path), "--store", str(store)], capture_output=True, text=True)
    out = tmp_path / "again.forkd.tar.zst"
    exported_again = subprocess.run(
        [*forkd, "export", "itest-export", "-o", str(out), "--store", str(store)], capture_output=True, text=True
    )

    assert imported.returncode == 0, imported.stderr
    assert again.returncode == 1 and "already exists" in again.stderr and "--replace" in again.stderr
    assert exported_again.returncode == 0, exported_again.stderr
    assert "exported 'itest-export'" in exported_again.stdout

    def checksums(manifest: dict) -> dict[str, str]:
        return {
            entry["path"]: entry["checksum"] for entry in manifest["files"] if entry["path"] != "snapshot/snapshot.json"
        }

    assert checksums(archive.read_archive_manifest(out)) == checksums(archive.read_archive_manifest(path))
    shutil.rmtree(store)


def test_forkd_bench_archive_reports_times_and_sizes(tmp_path: Path) -> None:
    report = tmp_path / "archive.json"
    result = subprocess.run(
        [sys.executable, "-m", "pytest_forkd.cli", "bench", "--archive", "--repeats", "1", "--json", str(report)],
        capture_output=True,
        text=True,
        timeout=600,
    )

    assert result.returncode == 0, result.stderr
    figures = json.loads(report.read_text())
    assert figures["export_s"]["n"] == 1 and figures["import_s"]["n"] == 1
    assert figures["memory_mib"] == 256.0
    assert 0 < figures["memory_non_zero_mib"] <= figures["memory_allocated_mib"] <= 256
    assert 0 < figures["archive_mib"] < figures["memory_non_zero_mib"] + figures["image_mib"]
    assert figures["conditions"]["zstd"] in ("binary", "module")
    assert not Path(figures["conditions"]["scratch"]).exists()
