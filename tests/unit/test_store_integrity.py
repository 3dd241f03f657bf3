"""Checked and private snapshots: recorded sizes and checksums, damage detection, modes, interrupted writes."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from pytest_forkd import private
from pytest_forkd.errors import DamagedSnapshot, ForkdError, InvalidTagError, SnapshotError
from pytest_forkd.storage import integrity
from pytest_forkd.storage.snapshot import SNAPSHOT_FILE, Snapshot
from pytest_forkd.storage.store import SnapshotStore

MIB = 1 << 20
MEMORY_MIB = 4


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SnapshotStore:
    monkeypatch.setenv("FORKD_STORE", str(tmp_path / "default-store"))
    return SnapshotStore(tmp_path / "store")


def record(directory: Path, tag: str, **changes: Any) -> Snapshot:
    fields: dict[str, Any] = dict(
        tag=tag,
        path=directory,
        backend="full",
        memory_mib=MEMORY_MIB,
        vcpus=1,
        image="default",
        fingerprint={"image": "img"},
        state_file="state.bin",
        memory_file="memory.ram",
    )
    fields.update(changes)
    return Snapshot(**fields)


def write_memory(path: Path, *, sparse: bool = True, seed: int = 7) -> None:
    """Guest memory the way tmpfs keeps it: a few written pages in a sparse file of MEMORY_MIB."""
    content = bytearray(MEMORY_MIB * MIB)
    content[0:6000] = b"kernel" * 1000
    content[2 * MIB - 4096 : 3 * MIB] = random.Random(seed).randbytes(MIB + 4096)
    fd = private.create_file(path)
    try:
        if sparse:
            os.ftruncate(fd, len(content))
            os.pwrite(fd, content[:8192], 0)
            os.pwrite(fd, content[2 * MIB - 4096 : 3 * MIB], 2 * MIB - 4096)
        else:  # the same content, every block allocated
            os.pwrite(fd, content, 0)
    finally:
        os.close(fd)


def publish(store: SnapshotStore, tag: str, **changes: Any) -> Snapshot:
    with store.begin(tag) as pending:
        private.write_bytes(pending.dir / "state.bin", b"device state of " + tag.encode())
        snapshot = record(pending.dir, tag, **changes)
        if snapshot.memory_file and snapshot.status != "writing":
            write_memory(pending.dir / snapshot.memory_file)
        return pending.publish(snapshot)


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


# -- what is recorded -------------------------------------------------------------------------


def test_publish_records_size_and_checksum_of_every_data_file(store: SnapshotStore) -> None:
    snapshot = publish(store, "base")

    assert set(snapshot.files) == {"state.bin", "memory.ram"}
    memory = snapshot.files["memory.ram"]
    assert memory["size"] == MEMORY_MIB * MIB
    assert memory["checksum"] == integrity.checksum(snapshot.memory_path)
    assert memory["checksum"].startswith(f"{integrity.ALGORITHM}:")
    stored = json.loads((snapshot.path / SNAPSHOT_FILE).read_text())
    assert stored["files"]["state.bin"]["size"] == len(b"device state of base")
    assert store.get("base").files == snapshot.files


def test_checksum_depends_on_content_not_on_holes(tmp_path: Path) -> None:
    write_memory(tmp_path / "sparse")
    write_memory(tmp_path / "dense", sparse=False)
    assert os.stat(tmp_path / "sparse").st_blocks < os.stat(tmp_path / "dense").st_blocks

    assert integrity.checksum(tmp_path / "sparse") == integrity.checksum(tmp_path / "dense")


def test_checksum_changes_with_one_byte_and_with_the_size(tmp_path: Path) -> None:
    write_memory(tmp_path / "a")
    before = integrity.checksum(tmp_path / "a")
    with open(tmp_path / "a", "r+b") as stream:
        stream.seek(3 * MIB + 17)  # inside a hole: the block is read as zeros before, data after
        stream.write(b"\1")
    changed = integrity.checksum(tmp_path / "a")
    os.truncate(tmp_path / "a", MEMORY_MIB * MIB + 1)

    assert len({before, changed, integrity.checksum(tmp_path / "a")}) == 3


def test_complete_records_the_memory_that_arrives_later(store: SnapshotStore) -> None:
    writing = publish(store, "live", status="writing")
    assert "memory.ram" not in writing.files
    scratch = store.scratch_dir("live")
    write_memory(scratch / "memory.ram")

    ready = store.complete("live", scratch / "memory.ram", "memory.ram")

    assert ready.files["memory.ram"]["size"] == MEMORY_MIB * MIB
    assert ready.writer_host is None and ready.writer_pid is None
    store.verify("live")


def test_attach_memory_records_the_flattened_file(store: SnapshotStore) -> None:
    publish(store, "root")
    with store.begin("cp") as pending:
        private.write_bytes(pending.dir / "state.bin", b"s")
        write_memory(pending.dir / "memory.diff")
        pending.publish(record(pending.dir, "cp", memory_file=None, diff_file="memory.diff", base="root"))
    scratch = store.scratch_dir("cp")
    write_memory(scratch / "memory.ram")

    flattened = store.attach_memory("cp", scratch / "memory.ram", "memory.ram")

    assert set(flattened.files) == {"state.bin", "memory.diff", "memory.ram"}
    store.verify("cp")


def test_a_copy_that_differs_from_its_source_record_is_refused(store: SnapshotStore) -> None:
    source = publish(store, "source")
    with store.begin("copy") as pending:
        private.write_bytes(pending.dir / "state.bin", b"device state of source")
        write_memory(pending.dir / "memory.ram", seed=8)  # other content: not the source's memory
        with pytest.raises(DamagedSnapshot, match="memory.ram .* differ"):
            pending.publish(source.replace(tag="copy", path=pending.dir))
    assert not store.exists("copy")


# -- checking ---------------------------------------------------------------------------------


def test_an_intact_snapshot_passes_both_checks(store: SnapshotStore) -> None:
    snapshot = publish(store, "ok")

    store.check_restorable(snapshot)
    assert store.verify("ok").tag == "ok"


def test_a_truncated_memory_file_is_refused_naming_the_snapshot_and_the_fix(store: SnapshotStore) -> None:
    snapshot = publish(store, "base")
    os.truncate(snapshot.memory_path, MIB)

    with pytest.raises(DamagedSnapshot) as caught:
        store.check_restorable(store.get("base"))

    message = str(caught.value)
    assert "'base'" in message and "memory.ram is 1048576 bytes" in message and "truncated" in message
    assert f"forkd snapshots rm base --store {store.root}" in message
    assert caught.value.tag == "base" and len(caught.value.problems) == 1
    assert isinstance(caught.value, SnapshotError)


def test_a_missing_file_is_named(store: SnapshotStore) -> None:
    snapshot = publish(store, "base")
    snapshot.state_path.unlink()

    with pytest.raises(DamagedSnapshot, match="state.bin is missing"):
        store.check_restorable(snapshot)


def test_a_record_without_checksums_still_gets_its_memory_size_checked(store: SnapshotStore) -> None:
    snapshot = publish(store, "legacy")
    legacy = snapshot.replace(files={})
    legacy.save_to(snapshot.path)
    os.truncate(snapshot.memory_path, MIB)

    with pytest.raises(DamagedSnapshot, match=f"less than the {MEMORY_MIB} MiB of guest memory"):
        store.check_restorable(store.get("legacy"))


def test_content_changed_in_place_is_caught_on_restore_because_its_mtime_moved(store: SnapshotStore) -> None:
    snapshot = publish(store, "base")
    with open(snapshot.memory_path, "r+b") as stream:
        stream.seek(100)
        stream.write(b"corrupted")

    with pytest.raises(DamagedSnapshot, match="changed after it was stored"):
        store.check_restorable(store.get("base"))


def test_content_changed_behind_an_unchanged_mtime_is_caught_by_verify(store: SnapshotStore) -> None:
    snapshot = publish(store, "base")
    status = os.stat(snapshot.memory_path)
    with open(snapshot.memory_path, "r+b") as stream:
        stream.seek(100)
        stream.write(b"bit rot")
    os.utime(snapshot.memory_path, ns=(status.st_atime_ns, status.st_mtime_ns))

    store.check_restorable(store.get("base"))  # the cheap check trusts size and mtime
    with pytest.raises(DamagedSnapshot, match="memory.ram has checksum"):
        store.verify("base")


def test_a_damaged_base_is_reported_for_a_diff_that_needs_it(store: SnapshotStore) -> None:
    base = publish(store, "root")
    with store.begin("cp") as pending:
        private.write_bytes(pending.dir / "state.bin", b"s")
        write_memory(pending.dir / "memory.diff")
        diff = pending.publish(record(pending.dir, "cp", memory_file=None, diff_file="memory.diff", base="root"))
    os.truncate(base.memory_path, 0)

    with pytest.raises(DamagedSnapshot, match="'root'.*--cascade: snapshot 'cp' is a diff against it"):
        store.check_restorable(diff)


# -- private files ------------------------------------------------------------------------------


def test_store_directories_and_files_are_private_even_under_a_permissive_umask(store: SnapshotStore) -> None:
    old = os.umask(0)
    try:
        publish(store, "base")
        with store.lock("base"):
            pass
        store.scratch_dir("other")
    finally:
        os.umask(old)

    assert private.exposed(store.root) == []
    assert os.stat(store.root).st_mode & 0o777 == 0o700
    assert os.stat(store.root / "base" / "memory.ram").st_mode & 0o777 == 0o600


def test_files_a_backend_left_readable_are_narrowed_before_publication(store: SnapshotStore) -> None:
    with store.begin("third") as pending:
        (pending.dir / "state.bin").write_bytes(b"s")
        os.chmod(pending.dir / "state.bin", 0o644)
        write_memory(pending.dir / "memory.ram")
        assert os.stat(pending.dir).st_mode & 0o777 == 0o700  # nobody else could open them meanwhile
        pending.publish(record(pending.dir, "third"))

    assert private.exposed(store.root) == []


def test_private_umask_nests_and_restores() -> None:
    old = os.umask(0o022)
    try:
        with private.private_umask():
            with private.private_umask():
                assert os.umask(0o077) == 0o077
            assert os.umask(0o077) == 0o077
        assert os.umask(0o022) == 0o022
    finally:
        os.umask(old)


def test_exposed_lists_what_others_can_read(tmp_path: Path) -> None:
    private.make_dir(tmp_path / "d")
    (tmp_path / "d" / "open").write_text("x")
    os.chmod(tmp_path / "d" / "open", 0o644)
    private.write_bytes(tmp_path / "d" / "closed", b"x")

    assert [(path.name, mode) for path, mode in private.exposed(tmp_path / "d")] == [("open", "0o644")]


# -- interrupted writes -------------------------------------------------------------------------


def test_opening_a_store_removes_a_snapshot_whose_writer_is_gone(store: SnapshotStore) -> None:
    publish(store, "live", status="writing", writer_pid=dead_pid())
    publish(store, "mine", status="writing")  # this process: alive
    publish(store, "elsewhere", status="writing", writer_pid=dead_pid(), writer_host="another-host")

    reopened = SnapshotStore(store.root)

    assert not reopened.exists("live")
    assert {snapshot.tag for snapshot in reopened.list()} == {"mine", "elsewhere"}


def test_an_interrupted_snapshot_others_depend_on_is_marked_failed(store: SnapshotStore) -> None:
    publish(store, "live", status="writing", writer_pid=dead_pid())
    publish(store, "child", parent="live")

    assert SnapshotStore(store.root, clean=False).clean_interrupted() == ["live"]

    failed = store.get("live")
    assert failed.status == "failed" and "ended before the memory was written" in failed.error


def test_a_writer_killed_mid_write_leaves_nothing_once_the_store_is_opened(tmp_path: Path) -> None:
    """A process publishes a live snapshot (status 'writing') and is SIGKILLed before completing it."""
    root = tmp_path / "store"
    script = textwrap.dedent(f"""
        import os, signal, sys
        from pytest_forkd import private
        from pytest_forkd.storage.snapshot import Snapshot
        from pytest_forkd.storage.store import SnapshotStore
        store = SnapshotStore({str(root)!r})
        with store.begin("live") as pending:
            private.write_bytes(pending.dir / "state.bin", b"s")
            pending.publish(Snapshot(tag="live", path=pending.dir, backend="uffd", memory_mib=4, vcpus=1,
                                     image="default", fingerprint={{}}, state_file="state.bin",
                                     memory_file="memory.ram", status="writing"))
        store.scratch_dir("live")  # where the memory was being materialised
        sys.stdout.write("published\\n"); sys.stdout.flush()
        signal.pause()
    """)
    writer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "published\n"
        assert Snapshot.load_from(root / "live").status == "writing"
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        writer.stdout.close()

    store = SnapshotStore(root)
    store.clean_stale_temp()

    assert not store.exists("live") and os.listdir(root) == []


# -- tags ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("tag", ["", "a b", "x" * 65, "ok\n", "../up"])
def test_bad_tags_are_refused_before_anything_is_written(store: SnapshotStore, tag: str) -> None:
    with pytest.raises(InvalidTagError) as caught:
        store.begin(tag)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, ForkdError)
    assert "use 1-64 characters" in str(caught.value)
    assert not store.root.exists()


def test_empty_tag_message_says_it_is_empty(store: SnapshotStore) -> None:
    with pytest.raises(InvalidTagError, match=r"invalid snapshot name '' \(it is empty\)"):
        store.begin("")
