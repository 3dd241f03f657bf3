"""Snapshot archives without a VM: format, packing of guest memory, and every kind of bad input.

A fake image and a fake snapshot stand in for real ones (tests/integration/test_archive.py
forks from real imports); QEMU's version is faked where the host check needs it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import tarfile
from pathlib import Path

import pytest

from pytest_forkd import import_snapshot, zstdio
from pytest_forkd.archives import archive
from pytest_forkd.cli import main
from pytest_forkd.engine.qemu.host import Qemu
from pytest_forkd.engine.qemu.machine import MachineSpec
from pytest_forkd.errors import ArchiveError, HostNotReady, IncompatibleSnapshot, SnapshotError
from pytest_forkd.storage.snapshot import Snapshot
from pytest_forkd.storage.store import SnapshotStore

QEMU = Qemu("/usr/bin/qemu-system-x86_64", "7.2.0")
KEY = "0123456789abcdef"
PAGE = 4096
MEMORY = 4 << 20


def use_cache(directory: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A forkd cache at ``directory`` holding the image ``KEY`` (the same bytes in every cache), in use."""
    monkeypatch.setenv("FORKD_CACHE_DIR", str(directory))
    monkeypatch.delenv("FORKD_STORE", raising=False)
    monkeypatch.setattr(archive, "find_qemu", lambda: QEMU)
    image = directory / "images" / KEY
    image.mkdir(parents=True)
    (image / "manifest.json").write_text(json.dumps({"key": KEY, "kernel_args": ["x=1"], "env": {}}))
    for name, size in (("vmlinuz", 300_000), ("initrd.cpio", 200_000), ("vmlinuz.stub", 65536), ("initrd.stub", 4096)):
        (image / name).write_bytes(random.Random(name).randbytes(size))  # incompressible, one image's bytes
    return directory


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return use_cache(tmp_path / "cache", monkeypatch)


def make_snapshot(store: SnapshotStore, tag: str = "snap") -> Snapshot:
    """A 4 MiB guest: holes, explicit zero pages and a few pages of data."""
    spec = MachineSpec(qemu=QEMU, accel="tcg", memory_mib=4, vcpus=1, kernel_args=("x=1",))
    with store.begin(tag) as pending:
        (pending.dir / "state.bin").write_bytes(os.urandom(9000))
        with open(pending.dir / "memory.ram", "wb") as memory:
            memory.truncate(MEMORY)
            memory.seek(PAGE)
            memory.write(b"\x01" * PAGE)  # data
            memory.write(bytes(8 * PAGE))  # allocated, but zero
            memory.write(os.urandom(2 * PAGE))  # data
            memory.seek(MEMORY - PAGE)
            memory.write(b"tail" * (PAGE // 4))
        record = Snapshot(
            tag=tag,
            path=pending.dir,
            backend="full",
            memory_mib=4,
            vcpus=1,
            image="default",
            fingerprint={"qemu": QEMU.version, "machine": spec.fingerprint(), "image": KEY},
            state_file="state.bin",
            memory_file="memory.ram",
            extra={"recipe_hash": "r" * 24},
        )
        return pending.publish(record)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def one_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[Snapshot, Path]:
    """A snapshot and its archive, made once: the tests given them only read them."""
    root = tmp_path_factory.mktemp("export")
    with pytest.MonkeyPatch.context() as monkeypatch:
        use_cache(root / "cache", monkeypatch)
        snapshot = make_snapshot(SnapshotStore(root / "origin"))
        path = root / "snap.forkd.tar.zst"
        archive.export_snapshot(snapshot, path)
    return snapshot, path


@pytest.fixture
def exported(one_export: tuple[Snapshot, Path], cache: Path) -> tuple[Snapshot, Path]:
    """The shared archive, imported into this test's own cache (which has the archive's image)."""
    return one_export


def rewrite(source: Path, target: Path, change_manifest=None, drop: str | None = None) -> None:
    with (
        zstdio.decompressing(source) as raw,
        tarfile.open(fileobj=raw, mode="r|") as tar_in,
        zstdio.compressing(target) as out,
        tarfile.open(fileobj=out, mode="w|") as tar_out,
    ):
        for member in tar_in:
            data = tar_in.extractfile(member).read()
            if member.name == drop:
                continue
            if member.name == archive.MANIFEST_NAME and change_manifest is not None:
                manifest = json.loads(data)
                change_manifest(manifest)
                data = json.dumps(manifest).encode()
                member.size = len(data)
            tar_out.addfile(member, io.BytesIO(data))


def test_round_trip_keeps_every_byte_and_the_holes(exported: tuple[Snapshot, Path], tmp_path: Path) -> None:
    original, path = exported
    target = SnapshotStore(tmp_path / "target")

    imported = import_snapshot(path, store=target)

    assert sha256(imported.memory_path) == sha256(original.memory_path)
    assert sha256(imported.state_path) == sha256(original.state_path)
    assert os.stat(imported.memory_path).st_blocks * 512 <= 4 * PAGE + 3 * PAGE  # zero pages became holes
    assert imported.fingerprint == original.fingerprint and imported.extra["recipe_hash"] == "r" * 24
    assert imported.extra["imported"]["archive"] == path.name


def test_the_manifest_names_what_a_restore_depends_on(exported: tuple[Snapshot, Path]) -> None:
    _original, path = exported
    assert path.stat().st_mode & 0o777 == 0o600  # guest memory inside: private like the store

    manifest = archive.read_archive_manifest(path)

    assert manifest["format"] == archive.ARCHIVE_FORMAT and manifest["format_version"] == archive.ARCHIVE_VERSION
    assert manifest["qemu_version"] == "7.2.0" and manifest["accel"] == "tcg" and manifest["machine"] == "microvm"
    assert manifest["cpu_model"] and manifest["memory_mib"] == 4 and manifest["recipe_hash"] == "r" * 24
    assert manifest["image"]["key"] == KEY
    memory = next(entry for entry in manifest["files"] if entry["path"] == "snapshot/memory.ram")
    assert memory["size"] == MEMORY and memory["stored"] == 4 * PAGE  # 1 + 2 + 1 non-zero pages
    assert memory["extents"] == [[PAGE, PAGE], [10 * PAGE, 2 * PAGE], [MEMORY - PAGE, PAGE]]
    assert all(entry["checksum"].startswith("crc32-1MiB:") for entry in manifest["files"])
    # the snapshot's data files carry the checksums the store recorded: nothing was checksummed twice
    assert memory["checksum"] == _original.files["memory.ram"]["checksum"]


def test_the_machine_a_snapshot_recorded_is_what_the_archive_says(cache: Path, tmp_path: Path) -> None:
    legacy = make_snapshot(SnapshotStore(tmp_path / "origin"), "legacy")
    spec = MachineSpec(qemu=QEMU, accel="tcg", memory_mib=4, vcpus=1, kernel_args=("x=1",))
    assert legacy.machine is None  # written before records kept their machine: derived from its hash
    derived = archive._machine_of(legacy, ("x=1",))
    assert derived["machine_args"] == spec.machine_args() and derived["accel"] == "tcg"

    # A record that keeps its machine is exported as recorded, without rebuilding command lines.
    recorded = {**spec.record(), "machine_args": [*spec.machine_args(), "-recorded"]}
    store = SnapshotStore(tmp_path / "recorded")
    with store.begin("kept") as pending:
        (pending.dir / "state.bin").write_bytes(b"s" * 100)
        (pending.dir / "memory.ram").write_bytes(bytes(MEMORY))
        kept = pending.publish(legacy.replace(tag="kept", path=pending.dir, machine=recorded, files={}))
    assert Snapshot.load_from(kept.path).machine == recorded  # survives snapshot.json
    path = tmp_path / "kept.forkd.tar.zst"

    archive.export_snapshot(kept, path)

    manifest = archive.read_archive_manifest(path)
    assert manifest["machine_args"] == recorded["machine_args"]
    assert manifest["qemu_version"] == "7.2.0" and manifest["cpu_model"] == recorded["cpu_model"]


def test_the_image_travels_and_gets_its_name(
    exported: tuple[Snapshot, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _original, path = exported
    fresh = tmp_path / "fresh-cache"
    monkeypatch.setenv("FORKD_CACHE_DIR", str(fresh))

    import_snapshot(path)

    assert sha256(fresh / "images" / KEY / "vmlinuz") == sha256(tmp_path / "cache" / "images" / KEY / "vmlinuz")
    assert (fresh / "images" / "names" / "default").read_text().strip() == KEY
    assert (fresh / "snapshots" / "snap" / "snapshot.json").is_file()


def test_an_existing_name_is_refused_unless_replaced(exported: tuple[Snapshot, Path], tmp_path: Path) -> None:
    _original, path = exported
    target = SnapshotStore(tmp_path / "target")
    first = import_snapshot(path, store=target)

    with pytest.raises(SnapshotError, match="already exists.*--replace") as caught:
        import_snapshot(path, store=target)
    replaced = import_snapshot(path, store=target, replace=True)

    assert "\n" not in str(caught.value)
    assert replaced.path == first.path and replaced.created == first.created
    assert [snapshot.tag for snapshot in target.list()] == ["snap"]


def test_an_archive_of_a_newer_format_is_refused(exported: tuple[Snapshot, Path], tmp_path: Path) -> None:
    _original, path = exported
    newer = tmp_path / "newer.forkd.tar.zst"
    rewrite(
        path, newer, lambda manifest: manifest.update(format_version=archive.ARCHIVE_VERSION + 1, pytest_forkd="9.0")
    )

    with pytest.raises(ArchiveError, match=r"archive format 2, newer than this pytest-forkd reads \(1\).*9\.0"):
        import_snapshot(newer, store=tmp_path / "target")


def test_another_qemu_version_is_refused_naming_both(exported: tuple[Snapshot, Path], tmp_path: Path) -> None:
    _original, path = exported
    other = tmp_path / "other.forkd.tar.zst"
    rewrite(path, other, lambda manifest: manifest.update(qemu_version="10.0.2"))

    with pytest.raises(IncompatibleSnapshot, match="made with QEMU 10.0.2 and this host runs QEMU 7.2.0"):
        import_snapshot(other, store=tmp_path / "target")
    assert not (tmp_path / "target" / "snap").exists()


def test_other_machine_arguments_are_refused(exported: tuple[Snapshot, Path], tmp_path: Path) -> None:
    _original, path = exported
    other = tmp_path / "other.forkd.tar.zst"
    rewrite(path, other, lambda manifest: manifest.update(machine_fingerprint="f" * 16))

    with pytest.raises(IncompatibleSnapshot, match="other machine arguments"):
        import_snapshot(other, store=tmp_path / "target")


@pytest.mark.parametrize(
    "damage", ["truncated", "missing member", "bit flip", "compressed bit flip", "not zstd", "not an archive"]
)
def test_a_damaged_archive_leaves_nothing_behind(
    exported: tuple[Snapshot, Path], tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    _original, path = exported
    broken = tmp_path / "broken.forkd.tar.zst"
    if damage == "truncated":
        broken.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "missing member":
        rewrite(path, broken, drop="snapshot/state.bin")
    elif damage == "bit flip":
        with zstdio.decompressing(path) as raw:
            plain = bytearray(raw.read())
        header = next(
            offset for offset in range(0, len(plain), 512) if plain[offset : offset + 19] == b"snapshot/memory.ram"
        )
        plain[header + 512 + 7] ^= 0x40
        with zstdio.compressing(broken) as out:
            out.write(bytes(plain))
    elif damage == "compressed bit flip":
        data = bytearray(path.read_bytes())
        data[len(data) // 3] ^= 0x10
        broken.write_bytes(bytes(data))
    elif damage == "not zstd":
        broken.write_bytes(b"hello, this is not an archive\n" * 10)
    else:
        with zstdio.compressing(broken) as out, tarfile.open(fileobj=out, mode="w|") as tar:
            info = tarfile.TarInfo("README")
            info.size = 2
            tar.addfile(info, io.BytesIO(b"hi"))
    fresh = tmp_path / "fresh-cache"
    monkeypatch.setenv("FORKD_CACHE_DIR", str(fresh))

    with pytest.raises(ArchiveError) as caught:
        import_snapshot(broken)

    assert "\n" not in str(caught.value) and str(broken) in str(caught.value)
    snapshots = fresh / "snapshots"
    assert not snapshots.exists() or [entry.name for entry in snapshots.iterdir() if entry.name != ".locks"] == []
    images = fresh / "images"
    assert not images.exists() or [entry.name for entry in images.iterdir()] == []


def test_the_cli_reports_bad_input_in_one_line(
    exported: tuple[Snapshot, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _original, path = exported
    store = tmp_path / "target"

    assert main(["snapshots", "import", str(path), "--store", str(store)]) == 0
    assert main(["snapshots", "import", str(path), "--store", str(store)]) == 1
    assert main(["snapshots", "import", str(tmp_path / "nope.tar.zst")]) == 1
    assert main(["snapshots", "export", "nope", "-o", str(tmp_path / "x.tar.zst"), "--store", str(store)]) == 1
    assert main(["snapshots", "import", str(path), "--store", str(store), "--name", "snap-2"]) == 0

    captured = capsys.readouterr()
    errors = captured.err.splitlines()
    assert len(errors) == 3 and all(line.startswith("forkd: error: ") for line in errors)
    assert "already exists" in errors[0] and "no snapshot archive" in errors[1] and "unknown snapshot" in errors[2]
    assert "imported 'snap-2'" in captured.out
    assert not (tmp_path / "x.tar.zst").exists()


def test_a_diff_snapshot_is_exported_flat(cache: Path, tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "origin")
    base = make_snapshot(store, "base")
    with store.begin("child") as pending:
        (pending.dir / "state.bin").write_bytes(b"state")
        with open(pending.dir / "memory.diff", "wb") as diff:
            diff.truncate(MEMORY)
            diff.seek(PAGE)
            diff.write(b"\x02" * PAGE)  # overwrites the base's first data page
        child = pending.publish(
            base.replace(
                tag="child",
                path=pending.dir,
                memory_file=None,
                files={},
                diff_file="memory.diff",
                base="base",
                backend="diff",
            )
        )
    path = tmp_path / "child.forkd.tar.zst"

    archive.export_snapshot(child, path)
    imported = import_snapshot(path, store=tmp_path / "target")

    data = imported.memory_path.read_bytes()
    assert imported.base is None and imported.diff_file is None
    assert (
        data[PAGE : 2 * PAGE] == b"\x02" * PAGE
        and data[10 * PAGE : 12 * PAGE] == base.memory_path.read_bytes()[10 * PAGE : 12 * PAGE]
    )


def test_an_export_needs_the_snapshots_image(cache: Path, tmp_path: Path) -> None:
    snapshot = make_snapshot(SnapshotStore(tmp_path / "origin"))
    for entry in (cache / "images" / KEY).iterdir():
        entry.unlink()
    (cache / "images" / KEY).rmdir()

    with pytest.raises(ArchiveError, match=f"needs image {KEY}, which is not in"):
        archive.export_snapshot(snapshot, tmp_path / "x.forkd.tar.zst")
    assert not list(tmp_path.glob("*x.forkd.tar.zst*"))


def test_without_zstd_the_error_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(zstdio.shutil, "which", lambda name: None)
    monkeypatch.setattr(zstdio, "_zstandard", lambda: None)

    with pytest.raises(HostNotReady, match=r"apt-get install zstd.*pytest-forkd\[archive\]"):
        zstdio.implementation()


def test_the_zstandard_module_reads_what_the_tool_wrote(
    exported: tuple[Snapshot, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("zstandard")
    _original, path = exported
    monkeypatch.setenv(zstdio.ENV_IMPLEMENTATION, "module")

    imported = import_snapshot(path, store=tmp_path / "target")
    again = tmp_path / "again.forkd.tar.zst"
    imported.export(again)
    monkeypatch.setenv(zstdio.ENV_IMPLEMENTATION, "binary")

    assert archive.read_archive_manifest(again)["snapshot"] == "snap"


@pytest.mark.parametrize("qemu", [None, "10.0.2"])
def test_an_archive_repacked_with_tar_and_zstd_is_read(
    exported: tuple[Snapshot, Path], tmp_path: Path, qemu: str | None
) -> None:
    """Unpacked with `zstd -dc | tar -x`, edited, repacked with `tar -C DIR -c . | zstd`: member order and
    names change (./manifest.json, directories), and import still finds and checks the manifest."""
    import subprocess

    _original, path = exported
    unpacked = tmp_path / "unpacked"
    unpacked.mkdir()
    subprocess.run(f"zstd -dc {path} | tar -x -C {unpacked}", shell=True, check=True)
    manifest = json.loads((unpacked / "manifest.json").read_text())
    if qemu is not None:
        manifest["qemu_version"] = qemu
    (unpacked / "manifest.json").write_text(json.dumps(manifest))
    repacked = tmp_path / "repacked.forkd.tar.zst"
    subprocess.run(f"tar -C {unpacked} --sort=name -c . | zstd -q -o {repacked}", shell=True, check=True)

    if qemu is None:
        imported = import_snapshot(repacked, store=tmp_path / "target")
        assert sha256(imported.memory_path) == sha256(_original.memory_path)
    else:
        with pytest.raises(IncompatibleSnapshot, match="QEMU 10.0.2"):
            import_snapshot(repacked, store=tmp_path / "target")


def test_an_import_that_does_not_fit_the_run_is_rebuilt_with_the_reason(
    exported: tuple[Snapshot, Path], tmp_path: Path
) -> None:
    from pytest_forkd.project.config import EMPTY_PROJECT
    from pytest_forkd.project.snapshot_builder import SnapshotBuilder

    _original, path = exported
    store = SnapshotStore(tmp_path / "target")
    import_snapshot(path, store=store)
    lines: list[str] = []

    SnapshotBuilder(None, store, EMPTY_PROJECT, progress=lines.append)._explain_rebuilding_an_import(  # type: ignore[arg-type]
        "snap", "wanted-hash", store
    )

    assert lines == [
        f"forkd: snapshot 'snap' imported from {path.name} was built from recipe {'r' * 24}, this run "
        "needs wanted-hash (another QEMU, accelerator, image or forkd.yaml recipe?); rebuilding it here"
    ]


def test_a_kvm_host_cpu_snapshot_from_another_cpu_is_refused(exported: tuple[Snapshot, Path], tmp_path: Path) -> None:
    _original, path = exported
    other = tmp_path / "kvm.forkd.tar.zst"
    rewrite(
        path,
        other,
        lambda manifest: manifest.update(
            accel="kvm", cpu_model="host", host_cpu="Imaginary CPU 9000 (flags 0000000000000000)"
        ),
    )

    with pytest.raises(IncompatibleSnapshot, match=r"-cpu host on 'Imaginary CPU 9000 \(flags 0+\)' and this host's"):
        import_snapshot(other, store=tmp_path / "target")


def test_a_projects_snapshot_is_imported_into_the_importing_projects_namespace(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pytest_forkd.project import lifecycle

    origin_project, target_project = tmp_path / "origin-project", tmp_path / "target-project"
    for folder in (origin_project, target_project):
        folder.mkdir()
        (folder / "forkd.yaml").write_text("snapshots: {}\n")
    own = make_snapshot(lifecycle.project_store(tmp_path / "origin-store", origin_project), "tools")
    shared = make_snapshot(SnapshotStore(tmp_path / "origin-store"), "base")
    own_archive, shared_archive = tmp_path / "tools.forkd.tar.zst", tmp_path / "base.forkd.tar.zst"
    archive.export_snapshot(own, own_archive)
    archive.export_snapshot(shared, shared_archive)
    root = tmp_path / "target-store"

    monkeypatch.chdir(target_project)  # run from the project, as the matrix example does
    imported_own = import_snapshot(own_archive, store=root)
    imported_shared = import_snapshot(shared_archive, store=root)
    monkeypatch.chdir(tmp_path)  # no forkd.yaml around: the store itself
    elsewhere = import_snapshot(own_archive, store=tmp_path / "plain-store")

    assert archive.read_archive_manifest(own_archive)["scope"] == "project"
    assert archive.read_archive_manifest(shared_archive)["scope"] == "shared"
    assert imported_own.path.parent == lifecycle.project_store(root, target_project).root
    assert imported_shared.path.parent == root
    assert elsewhere.path.parent == tmp_path / "plain-store"
    assert lifecycle.find_snapshot(SnapshotStore(root), "tools", target_project).path == imported_own.path
