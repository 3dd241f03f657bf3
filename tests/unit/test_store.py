"""The snapshot store: atomic publication, write-once files, dependents, cleanup."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import filelock
import pytest

from pytest_forkd.errors import IncompatibleSnapshot, InvalidArgument, InvalidTagError, SnapshotError, UnknownSnapshot
from pytest_forkd.storage.snapshot import SNAPSHOT_FILE, Snapshot
from pytest_forkd.storage.store import DiskUsage, SnapshotStore

FINGERPRINT = {"qemu_version": "7.2.0", "machine": "abc123", "image": "img-1"}
MEMORY = b"M" * 64 * 1024


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SnapshotStore:
    # The default store must not be this one, so error messages name it with --store.
    monkeypatch.setenv("FORKD_STORE", str(tmp_path / "default-store"))
    return SnapshotStore(tmp_path / "store")


def record(directory: Path, tag: str, **changes: Any) -> Snapshot:
    fields: dict[str, Any] = dict(
        tag=tag,
        path=directory,
        backend="full",
        memory_mib=256,
        vcpus=1,
        image="default",
        fingerprint=FINGERPRINT,
        state_file="state.bin",
        memory_file="memory.ram",
    )
    fields.update(changes)
    return Snapshot(**fields)


def publish(
    store: SnapshotStore, tag: str, memory: bytes = MEMORY, *, replace: bool = False, **changes: Any
) -> Snapshot:
    """Write a snapshot the way a backend does: data files, then publish."""
    with store.begin(tag, replace=replace) as pending:
        (pending.dir / "state.bin").write_bytes(b"device state of " + tag.encode())
        snapshot = record(pending.dir, tag, **changes)
        if snapshot.memory_file and snapshot.status != "writing":
            (pending.dir / snapshot.memory_file).write_bytes(memory)
        if snapshot.diff_file:
            (pending.dir / snapshot.diff_file).write_bytes(b"D" * 4096)
        return pending.publish(snapshot)


def publish_diff(store: SnapshotStore, tag: str, base: str) -> Snapshot:
    return publish(store, tag, backend="diff", memory_file=None, diff_file="memory.diff", base=base, parent=base)


def hidden_entries(store: SnapshotStore) -> list[str]:
    return sorted(name for name in os.listdir(store.root) if name.startswith(".") and name != ".locks")


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


# -- publication -------------------------------------------------------------


def test_publish_moves_the_snapshot_under_its_tag(store: SnapshotStore) -> None:
    published = publish(store, "base")

    assert published.path == store.root / "base"
    assert (store.root / "base" / "memory.ram").read_bytes() == MEMORY
    assert store.get("base") == published
    assert store.exists("base")
    assert hidden_entries(store) == []  # the temporary directory became the snapshot


def test_nothing_is_visible_before_publish(store: SnapshotStore) -> None:
    with store.begin("base") as pending:
        (pending.dir / "state.bin").write_bytes(b"s")
        (pending.dir / "memory.ram").write_bytes(MEMORY)

        assert pending.dir.parent == store.root and pending.dir.name.startswith(".tmp-base-")
        assert not store.exists("base")
        assert store.list() == [] and store.broken() == []
        with pytest.raises(UnknownSnapshot):
            store.get("base")
        pending.publish(record(pending.dir, "base"))
    assert store.exists("base")


def test_a_reader_never_sees_a_half_written_snapshot(store: SnapshotStore) -> None:
    chunk = b"x" * 256 * 1024
    chunks = 16
    observations: list[str] = []
    writer_done = threading.Event()

    def writer() -> None:
        with store.begin("big") as pending:
            (pending.dir / "state.bin").write_bytes(b"s")
            with open(pending.dir / "memory.ram", "wb") as memory:
                for _ in range(chunks):
                    memory.write(chunk)
                    memory.flush()
                    time.sleep(0.005)
            pending.publish(record(pending.dir, "big"))
        writer_done.set()

    def reader() -> None:
        while True:
            finished = writer_done.is_set()
            try:
                snapshot = store.get("big")
            except UnknownSnapshot:
                observations.append("absent")
            except SnapshotError as exc:
                observations.append(f"unreadable: {exc}")
            else:
                size = os.path.getsize(snapshot.memory_path)  # type: ignore[arg-type]
                observations.append("complete" if size == len(chunk) * chunks else f"partial {size}")
            if finished:
                return

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    assert set(observations) <= {"absent", "complete"}, sorted(set(observations))
    assert observations[0] == "absent" and observations[-1] == "complete"


def test_an_exception_inside_begin_removes_the_temporary_directory(store: SnapshotStore) -> None:
    with pytest.raises(RuntimeError, match="capture failed"):
        with store.begin("base") as pending:
            (pending.dir / "memory.ram").write_bytes(MEMORY)
            raise RuntimeError("capture failed")

    assert not pending.dir.exists()
    assert not store.exists("base")
    assert hidden_entries(store) == []


def test_leaving_begin_without_publishing_aborts(store: SnapshotStore) -> None:
    with store.begin("base") as pending:
        (pending.dir / "state.bin").write_bytes(b"s")

    assert not pending.dir.exists() and not store.exists("base")


def test_abort_removes_the_temporary_directory_and_forbids_publishing(store: SnapshotStore) -> None:
    pending = store.begin("base")
    (pending.dir / "state.bin").write_bytes(b"s")
    pending.abort()

    assert not pending.dir.exists()
    with pytest.raises(SnapshotError, match="already published or aborted"):
        pending.publish(record(pending.dir, "base"))


def test_publishing_twice_is_refused(store: SnapshotStore) -> None:
    with store.begin("base") as pending:
        (pending.dir / "state.bin").write_bytes(b"s")
        (pending.dir / "memory.ram").write_bytes(MEMORY)
        pending.publish(record(pending.dir, "base"))
        with pytest.raises(SnapshotError, match="already published"):
            pending.publish(record(pending.dir, "base"))


def test_publish_refuses_a_record_with_another_tag(store: SnapshotStore) -> None:
    with store.begin("base") as pending:
        with pytest.raises(SnapshotError, match="tag 'other' does not match .* 'base'"):
            pending.publish(record(pending.dir, "other"))


def test_publish_refuses_missing_data_files(store: SnapshotStore) -> None:
    with store.begin("base") as pending:
        (pending.dir / "state.bin").write_bytes(b"s")
        with pytest.raises(SnapshotError, match="memory_file 'memory.ram' was not written into"):
            pending.publish(record(pending.dir, "base"))
    assert not store.exists("base")


def test_publish_refuses_a_snapshot_without_any_memory(store: SnapshotStore) -> None:
    with pytest.raises(SnapshotError, match="neither a memory_file nor a base"):
        publish(store, "base", memory_file=None)


def test_publish_refuses_a_diff_against_a_diff(store: SnapshotStore) -> None:
    publish(store, "root")
    publish_diff(store, "cp1", base="root")

    with pytest.raises(SnapshotError, match="its base 'cp1' is itself a diff.*use 'root'"):
        publish_diff(store, "cp2", base="cp1")


def test_a_writing_snapshot_may_lack_its_memory_and_records_its_writer(store: SnapshotStore) -> None:
    published = publish(store, "live", status="writing")

    assert published.status == "writing"
    assert published.writer_pid == os.getpid()
    assert not (published.path / "memory.ram").exists()
    assert store.get("live").writer_pid == os.getpid()


# -- tags, lookup, duplicates ------------------------------------------------------


@pytest.mark.parametrize("bad_tag", ["", "../x", "a/b", ".tmp-x", "x" * 65, "white space"])
def test_invalid_tags_are_refused_everywhere(store: SnapshotStore, bad_tag: str) -> None:
    for operation in (store.begin, store.get, store.exists, store.remove, store.lock, store.dependents):
        with pytest.raises(InvalidTagError, match="use 1-64 characters"):
            operation(bad_tag)


def test_unknown_tag_lists_what_is_available(store: SnapshotStore) -> None:
    publish(store, "alpha")
    publish(store, "beta")

    with pytest.raises(UnknownSnapshot) as caught:
        store.get("gamma")
    message = str(caught.value)
    assert f"unknown snapshot 'gamma' in {store.root}; available: alpha, beta" in message
    assert "--forkd-store" in message


def test_unknown_tag_in_an_empty_store_says_none_yet(store: SnapshotStore) -> None:
    with pytest.raises(UnknownSnapshot, match="available: none yet"):
        store.get("base")


def test_an_existing_tag_is_refused_when_beginning(store: SnapshotStore) -> None:
    publish(store, "base")

    with pytest.raises(SnapshotError, match="already exists") as caught:
        store.begin("base")
    assert f"forkd snapshots rm base --store {store.root}" in str(caught.value)
    assert hidden_entries(store) == []


def test_a_tag_published_meanwhile_is_refused_and_kept(store: SnapshotStore) -> None:
    first = store.begin("base")
    second = store.begin("base")
    for pending, content in ((first, b"first"), (second, b"second")):
        (pending.dir / "state.bin").write_bytes(b"s")
        (pending.dir / "memory.ram").write_bytes(content)

    first.publish(record(first.dir, "base"))
    with second, pytest.raises(SnapshotError, match="'base' already exists"):
        second.publish(record(second.dir, "base"))

    assert (store.root / "base" / "memory.ram").read_bytes() == b"first"
    assert hidden_entries(store) == []


def test_rm_hint_omits_store_for_the_default_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORKD_STORE", str(tmp_path))
    default_store = SnapshotStore.persistent()
    publish(default_store, "base")

    assert default_store.root == tmp_path
    with pytest.raises(SnapshotError, match="remove it with `forkd snapshots rm base` or"):
        default_store.begin("base")


# -- replacing -------------------------------------------------------------------


def test_replace_never_writes_into_the_old_files(store: SnapshotStore) -> None:
    old = publish(store, "base", memory=b"old!" * 4096)
    old_inode = os.stat(old.memory_path).st_ino  # type: ignore[arg-type]

    with open(old.memory_path, "rb") as old_file:  # type: ignore[arg-type]
        # A child maps the old memory copy-on-write, as QEMU does with share=off.
        mapping = mmap.mmap(old_file.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
        try:
            new = publish(store, "base", memory=b"new!" * 4096, replace=True)

            assert mapping[:] == b"old!" * 4096
            assert os.fstat(old_file.fileno()).st_ino == old_inode
            old_file.seek(0)
            assert old_file.read() == b"old!" * 4096
        finally:
            mapping.close()

    assert new.path == store.root / "base"
    assert os.stat(new.memory_path).st_ino != old_inode  # type: ignore[arg-type]
    assert new.memory_path.read_bytes() == b"new!" * 4096  # type: ignore[union-attr]
    assert hidden_entries(store) == []  # the old snapshot's trash directory is gone


def test_replace_of_a_tag_that_does_not_exist_just_publishes(store: SnapshotStore) -> None:
    assert publish(store, "base", replace=True).path == store.root / "base"


def test_replace_is_refused_while_a_diff_applies_to_the_snapshot(store: SnapshotStore) -> None:
    publish(store, "base", memory=b"old")
    publish_diff(store, "cp1", base="base")

    with pytest.raises(SnapshotError, match="cannot replace snapshot 'base'.*cp1 \\(diff against it\\)"):
        publish(store, "base", memory=b"new", replace=True)
    assert store.get("base").memory_path.read_bytes() == b"old"  # type: ignore[union-attr]


def test_replace_is_allowed_when_others_only_descend_from_the_snapshot(store: SnapshotStore) -> None:
    publish(store, "base", memory=b"old")
    publish(store, "later", parent="base")

    replaced = publish(store, "base", memory=b"new", replace=True)

    assert replaced.memory_path.read_bytes() == b"new"  # type: ignore[union-attr]
    assert store.exists("later")


# -- listing ---------------------------------------------------------------------


def test_list_is_sorted_by_creation_and_skips_temporary_directories(store: SnapshotStore) -> None:
    publish(store, "b-second", created="2024-01-02T00:00:00.000+00:00")
    publish(store, "a-third", created="2024-01-03T00:00:00.000+00:00")
    publish(store, "c-first", created="2024-01-01T00:00:00.000+00:00")
    store.begin("unfinished")
    store.lock("c-first")

    assert [snapshot.tag for snapshot in store.list()] == ["c-first", "b-second", "a-third"]


def test_corrupt_entries_are_listed_as_broken(store: SnapshotStore) -> None:
    publish(store, "good")
    (store.root / "no-metadata").mkdir()
    garbled = store.root / "garbled"
    garbled.mkdir()
    (garbled / SNAPSHOT_FILE).write_text("{not json")

    assert [snapshot.tag for snapshot in store.list()] == ["good"]
    broken = {entry.tag: entry for entry in store.broken()}
    assert sorted(broken) == ["garbled", "no-metadata"]
    assert "not valid JSON" in broken["garbled"].problem
    assert broken["garbled"].path == garbled
    assert "does not exist" in broken["no-metadata"].problem


def test_get_of_a_corrupt_snapshot_says_how_to_remove_it(store: SnapshotStore) -> None:
    garbled = store.root / "garbled"
    garbled.mkdir(parents=True)
    (garbled / SNAPSHOT_FILE).write_text("{not json")

    with pytest.raises(SnapshotError, match="not valid JSON") as caught:
        store.get("garbled")
    assert f"remove it with `forkd snapshots rm garbled --store {store.root}`" in str(caught.value)


def test_a_snapshot_renamed_by_hand_is_reported(store: SnapshotStore) -> None:
    publish(store, "original")
    os.rename(store.root / "original", store.root / "renamed")

    with pytest.raises(SnapshotError, match="says tag 'original' but lives in directory 'renamed'"):
        store.get("renamed")
    assert [entry.tag for entry in store.broken()] == ["renamed"]


def test_list_of_a_store_that_does_not_exist_yet_is_empty(tmp_path: Path) -> None:
    missing = SnapshotStore(tmp_path / "nothing-here")

    assert missing.list() == [] and missing.broken() == []
    assert not missing.root.exists()


# -- dependents, chains, removal ------------------------------------------------------


def test_dependents_follow_parents_and_bases_transitively(store: SnapshotStore) -> None:
    publish(store, "root", created="2024-01-01T00:00:00.000+00:00")
    publish(store, "branch", parent="root", created="2024-01-02T00:00:00.000+00:00")
    publish(
        store,
        "cp",
        backend="diff",
        memory_file=None,
        diff_file="memory.diff",
        base="branch",
        parent="branch",
        created="2024-01-03T00:00:00.000+00:00",
    )
    publish(store, "unrelated", created="2024-01-04T00:00:00.000+00:00")

    assert [snapshot.tag for snapshot in store.dependents("root")] == ["branch", "cp"]
    assert [snapshot.tag for snapshot in store.dependents("branch")] == ["cp"]
    assert store.dependents("cp") == []


def test_base_chain_goes_from_the_snapshot_to_its_flat_base(store: SnapshotStore) -> None:
    publish(store, "root")
    publish_diff(store, "cp", base="root")

    assert [snapshot.tag for snapshot in store.base_chain("cp")] == ["cp", "root"]
    assert [snapshot.tag for snapshot in store.base_chain("root")] == ["root"]


def test_base_chain_reports_a_missing_base(store: SnapshotStore) -> None:
    publish(store, "cp", backend="diff", memory_file=None, diff_file="memory.diff", base="elsewhere")

    with pytest.raises(SnapshotError, match="'cp' is a diff against 'elsewhere', which is missing"):
        store.base_chain("cp")


def test_remove_refuses_while_dependents_exist_and_names_them(store: SnapshotStore) -> None:
    publish(store, "root")
    publish_diff(store, "cp", base="root")
    publish(store, "child", parent="root")

    with pytest.raises(SnapshotError) as caught:
        store.remove("root")
    message = str(caught.value)
    assert "cp (diff against it)" in message and "child (descends from it)" in message
    assert f"forkd snapshots rm root --store {store.root} --cascade" in message
    assert store.exists("root") and store.exists("cp") and store.exists("child")


def test_remove_with_cascade_removes_dependents_first(store: SnapshotStore) -> None:
    publish(store, "root", created="2024-01-01T00:00:00.000+00:00")
    publish_diff(store, "cp", base="root")
    publish(store, "keep")

    removed = store.remove("root", cascade=True)

    assert removed == ["cp", "root"]
    assert [snapshot.tag for snapshot in store.list()] == ["keep"]
    assert hidden_entries(store) == []


def test_remove_keeps_files_alive_for_processes_that_map_them(store: SnapshotStore) -> None:
    snapshot = publish(store, "base")
    with open(snapshot.memory_path, "rb") as memory:  # type: ignore[arg-type]
        mapping = mmap.mmap(memory.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
        try:
            store.remove("base")
            assert not store.exists("base")
            assert mapping[:] == MEMORY
        finally:
            mapping.close()


def test_remove_of_an_unknown_tag_lists_available_ones(store: SnapshotStore) -> None:
    publish(store, "base")

    with pytest.raises(UnknownSnapshot, match="available: base"):
        store.remove("nope")


def test_remove_works_on_a_broken_snapshot(store: SnapshotStore) -> None:
    (store.root / "junk").mkdir(parents=True)

    assert store.remove("junk") == ["junk"]
    assert not (store.root / "junk").exists()


# -- compatibility ------------------------------------------------------------------


def test_check_compatible_accepts_the_same_fingerprint(store: SnapshotStore) -> None:
    store.check_compatible(publish(store, "base"), dict(FINGERPRINT))


def test_check_compatible_names_each_difference_and_the_fix(store: SnapshotStore) -> None:
    snapshot = publish(store, "base")
    now = {"qemu_version": "8.0.0", "machine": "abc123", "kernel": "6.1"}

    with pytest.raises(IncompatibleSnapshot) as caught:
        store.check_compatible(snapshot, now)
    message = str(caught.value)
    assert "qemu_version: snapshot has '7.2.0', now '8.0.0'" in message
    assert "image: snapshot has 'img-1', now '<not recorded>'" in message
    assert "kernel: snapshot has '<not recorded>', now '6.1'" in message
    assert "machine" not in message
    assert f"Rebuild it: `forkd snapshots rm base --store {store.root}`, then rerun" in message
    assert "use the QEMU/image it was taken with" in message


# -- background materialisation --------------------------------------------------------


def test_complete_moves_the_memory_in_and_marks_ready(store: SnapshotStore) -> None:
    publish(store, "live", status="writing")
    scratch = store.scratch_dir("live")
    (scratch / "memory.partial").write_bytes(MEMORY)

    ready = store.complete(
        "live",
        scratch / "memory.partial",
        "memory.ram",
        total_ms=812.5,
        bytes_written=len(MEMORY),
        extra={"zero_pages": 3},
    )

    assert ready.status == "ready" and ready.writer_pid is None and ready.error is None
    assert ready.total_ms == 812.5 and ready.extra == {"zero_pages": 3}
    assert ready.memory_path.read_bytes() == MEMORY  # type: ignore[union-attr]
    assert store.get("live") == ready
    assert not scratch.exists()
    assert hidden_entries(store) == []


def test_wait_ready_returns_once_another_thread_completes(store: SnapshotStore) -> None:
    writing = publish(store, "live", status="writing")
    scratch = store.scratch_dir("live")
    (scratch / "memory").write_bytes(MEMORY)
    finisher = threading.Timer(0.1, store.complete, args=("live", scratch / "memory", "memory.ram"))
    finisher.start()
    try:
        ready = writing.wait_ready(timeout=10)
    finally:
        finisher.join()

    assert ready.is_ready and ready.memory_path.read_bytes() == MEMORY  # type: ignore[union-attr]


def test_complete_refuses_a_snapshot_that_is_not_writing(store: SnapshotStore, tmp_path: Path) -> None:
    publish(store, "base")
    (tmp_path / "memory").write_bytes(b"x")

    with pytest.raises(SnapshotError, match="cannot complete snapshot 'base': its status is 'ready'"):
        store.complete("base", tmp_path / "memory", "memory.ram")
    assert store.get("base").memory_path.read_bytes() == MEMORY  # type: ignore[union-attr]


def test_complete_refuses_another_name_than_the_published_one(store: SnapshotStore) -> None:
    publish(store, "live", status="writing")
    scratch = store.scratch_dir("live")
    (scratch / "memory").write_bytes(b"x")

    with pytest.raises(SnapshotError, match="published with memory_file 'memory.ram'"):
        store.complete("live", scratch / "memory", "other.ram")
    assert store.get("live").status == "writing"


@pytest.mark.parametrize("bad_name", ["../memory.ram", "sub/memory.ram", ".hidden", SNAPSHOT_FILE])
def test_adopted_files_must_have_plain_names(store: SnapshotStore, bad_name: str) -> None:
    publish(store, "root")
    publish_diff(store, "cp", base="root")
    scratch = store.scratch_dir("cp")
    (scratch / "flat").write_bytes(b"x")

    with pytest.raises(SnapshotError, match="must be a plain file name"):
        store.attach_memory("cp", scratch / "flat", bad_name)
    assert store.get("cp").memory_file is None


def test_complete_never_overwrites_a_file(store: SnapshotStore) -> None:
    writing = publish(store, "live", status="writing")
    (writing.path / "memory.ram").write_bytes(b"already here")
    scratch = store.scratch_dir("live")
    (scratch / "memory").write_bytes(b"x")

    with pytest.raises(SnapshotError, match="never overwritten"):
        store.complete("live", scratch / "memory", "memory.ram")
    assert (writing.path / "memory.ram").read_bytes() == b"already here"


def test_complete_refuses_fields_it_sets_itself(store: SnapshotStore) -> None:
    publish(store, "live", status="writing")

    with pytest.raises(InvalidArgument, match="complete\\(\\) sets status itself"):
        store.complete("live", "ignored", "memory.ram", status="failed")


def test_fail_records_the_error_for_waiters(store: SnapshotStore) -> None:
    writing = publish(store, "live", status="writing")

    failed = store.fail("live", "loader QEMU died")

    assert failed.status == "failed" and failed.error == "loader QEMU died" and failed.writer_pid is None
    assert store.get("live") == failed
    with pytest.raises(SnapshotError, match="could not be written: loader QEMU died"):
        writing.wait_ready(timeout=5)


def test_fail_refuses_a_snapshot_that_is_not_writing(store: SnapshotStore) -> None:
    publish(store, "base")

    with pytest.raises(SnapshotError, match="cannot mark snapshot 'base' failed: its status is 'ready'"):
        store.fail("base", "late error")
    assert store.get("base").is_ready


def test_attach_memory_flattens_a_diff_and_frees_its_base(store: SnapshotStore) -> None:
    publish(store, "root")
    diff = publish(store, "cp", backend="diff", memory_file=None, diff_file="memory.diff", base="root")
    scratch = store.scratch_dir("cp")
    (scratch / "flat").write_bytes(MEMORY)

    flattened = store.attach_memory("cp", scratch / "flat", "memory.ram", extra={"flattened": True})

    assert flattened.memory_path.read_bytes() == MEMORY  # type: ignore[union-attr]
    assert flattened.base is None
    assert flattened.diff_path == diff.diff_path and diff.diff_path.exists()  # type: ignore[union-attr]
    assert flattened.extra == {"flattened": True}
    assert store.get("cp") == flattened
    assert not scratch.exists()
    assert store.base_chain("cp") == [flattened]
    assert store.remove("root") == ["root"]
    assert store.get("cp").memory_path.read_bytes() == MEMORY  # type: ignore[union-attr]


def test_attach_memory_refuses_a_snapshot_with_flat_memory(store: SnapshotStore, tmp_path: Path) -> None:
    publish(store, "root")
    (tmp_path / "flat").write_bytes(b"x")

    with pytest.raises(SnapshotError, match="only a ready diff snapshot without a memory file"):
        store.attach_memory("root", tmp_path / "flat", "memory.ram")
    assert store.get("root").memory_path.read_bytes() == MEMORY  # type: ignore[union-attr]


# -- housekeeping -------------------------------------------------------------------------


def test_clean_stale_temp_removes_what_dead_writers_left(store: SnapshotStore) -> None:
    published = publish(store, "base")
    dead = dead_pid()
    orphan = store.root / f".tmp-base-{dead}-0123abcd"
    orphan_trash = store.root / f".trash-old-{dead}-0123abcd"
    for directory in (orphan, orphan_trash):
        directory.mkdir()
        (directory / "memory.ram").write_bytes(MEMORY)
    unknown_writer = store.root / ".tmp-no-pid-here"
    unknown_writer.mkdir()
    live = store.begin("in-progress")

    removed = store.clean_stale_temp()

    assert sorted(removed) == sorted([orphan, orphan_trash])
    assert live.dir.exists() and unknown_writer.exists()
    assert store.get("base") == published
    live.abort()


def test_clean_stale_temp_removes_old_directories_even_with_a_live_pid(store: SnapshotStore) -> None:
    old = store.begin("ancient")
    old_unknown_writer = store.root / ".tmp-no-pid-here"
    old_unknown_writer.mkdir()
    recent = store.begin("recent")
    an_hour_ago = time.time() - 3600
    for directory in (old.dir, old_unknown_writer):
        os.utime(directory, (an_hour_ago, an_hour_ago))

    removed = store.clean_stale_temp(max_age_s=600)

    assert sorted(removed) == sorted([old.dir, old_unknown_writer])
    assert recent.dir.exists()
    recent.abort()


def test_clean_stale_temp_on_a_missing_store_does_nothing(tmp_path: Path) -> None:
    assert SnapshotStore(tmp_path / "absent").clean_stale_temp() == []


def test_disk_usage_counts_apparent_and_allocated_bytes(store: SnapshotStore) -> None:
    with store.begin("sparse") as pending:
        (pending.dir / "state.bin").write_bytes(b"s" * 100)
        with open(pending.dir / "memory.diff", "wb") as diff:
            diff.truncate(64 * 1024 * 1024)
            diff.write(b"d" * 4096)
        snapshot = pending.publish(
            record(pending.dir, "sparse", memory_file=None, diff_file="memory.diff", base="elsewhere")
        )

    usage = store.disk_usage("sparse")

    json_size = os.path.getsize(snapshot.path / SNAPSHOT_FILE)
    assert isinstance(usage, DiskUsage)
    assert usage.apparent_bytes == 64 * 1024 * 1024 + 100 + json_size
    assert 4096 <= usage.allocated_bytes < 1024 * 1024


def test_disk_usage_of_an_unknown_tag(store: SnapshotStore) -> None:
    with pytest.raises(UnknownSnapshot):
        store.disk_usage("nope")


def test_lock_excludes_other_processes(store: SnapshotStore) -> None:
    lock = store.lock("base")
    assert isinstance(lock, filelock.FileLock)
    assert Path(lock.lock_file) == store.root / ".locks" / "base.lock"
    script = (
        "import sys, filelock\n"
        "try:\n"
        "    filelock.FileLock(sys.argv[1], timeout=0.05).acquire()\n"
        "except filelock.Timeout:\n"
        "    sys.exit(3)\n"
    )
    with lock:
        contended = subprocess.run([sys.executable, "-c", script, lock.lock_file])
    free = subprocess.run([sys.executable, "-c", script, lock.lock_file])

    assert contended.returncode == 3
    assert free.returncode == 0


def test_persistent_store_honours_forkd_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORKD_STORE", str(tmp_path / "shared"))

    assert SnapshotStore.persistent().root == tmp_path / "shared"


def test_published_metadata_is_plain_json(store: SnapshotStore) -> None:
    snapshot = publish(store, "base", extra={"recipe": "sha256:abc"})

    data = json.loads((snapshot.path / SNAPSHOT_FILE).read_text())

    assert data["tag"] == "base" and data["extra"] == {"recipe": "sha256:abc"}
    assert data["fingerprint"] == FINGERPRINT
