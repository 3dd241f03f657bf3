"""The snapshot record: serialisation, validation, ownership and waiting for readiness."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pytest_forkd.errors import InvalidTagError, SnapshotError
from pytest_forkd.storage.snapshot import SNAPSHOT_FILE, Snapshot, process_is_alive


def make_snapshot(directory: Path, **changes: Any) -> Snapshot:
    fields: dict[str, Any] = dict(
        tag="base",
        path=directory,
        backend="full",
        memory_mib=256,
        vcpus=1,
        image="default",
        fingerprint={"qemu_version": "7.2.0", "machine": "abc123", "image": "img-1"},
        state_file="state.bin",
        memory_file="memory.ram",
        created="2024-01-02T03:04:05.678+00:00",
        pause_ms=4.5,
        bytes_written=1024,
        extra={"pagemap": {"present_pages": 12}},
    )
    fields.update(changes)
    return Snapshot(**fields)


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def write_json(directory: Path, data: dict[str, Any]) -> None:
    (directory / SNAPSHOT_FILE).write_text(json.dumps(data))


def saved_json(tmp_path: Path) -> dict[str, Any]:
    make_snapshot(tmp_path).save_to(tmp_path)
    return json.loads((tmp_path / SNAPSHOT_FILE).read_text())


class RecordingOwner:
    def __init__(self) -> None:
        self.calls: list[tuple[Snapshot, int]] = []
        self.network: list[Any] = []
        self.exports: list[tuple[Snapshot, Path | str]] = []

    def fork_snapshot(self, snapshot: Snapshot, n: int = 1, *, network: Any = None) -> list[Any]:
        self.calls.append((snapshot, n))
        self.network.append(network)
        return [f"vm{i}" for i in range(n)]

    def export_snapshot(self, snapshot: Snapshot, destination: Path | str) -> Path:
        self.exports.append((snapshot, destination))
        return Path(destination)


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    original = make_snapshot(tmp_path / "elsewhere", parent="root-vm", dirty_bytes=4096)
    written = original.save_to(tmp_path)

    loaded = Snapshot.load_from(tmp_path)

    assert written == tmp_path / SNAPSHOT_FILE
    assert loaded == original.replace(path=tmp_path)
    assert loaded.path == tmp_path
    assert loaded.extra["pagemap"] == {"present_pages": 12}


def test_saved_json_has_format_and_no_location_or_owner(tmp_path: Path) -> None:
    make_snapshot(tmp_path, owner=RecordingOwner()).save_to(tmp_path)

    data = json.loads((tmp_path / SNAPSHOT_FILE).read_text())

    assert data["format"] == 2
    assert data["tag"] == "base"
    assert "path" not in data and "owner" not in data
    assert sorted(os.listdir(tmp_path)) == [SNAPSHOT_FILE]  # no temporary file left behind


def test_save_replaces_the_file_instead_of_rewriting_it(tmp_path: Path) -> None:
    make_snapshot(tmp_path).save_to(tmp_path)
    with open(tmp_path / SNAPSHOT_FILE) as old_reader:
        make_snapshot(tmp_path, status="failed", error="boom").save_to(tmp_path)
        old_data = json.loads(old_reader.read())

    assert old_data["status"] == "ready"  # a reader holding the old file still sees a whole record
    assert Snapshot.load_from(tmp_path).status == "failed"


def test_load_of_a_missing_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError, match="does not exist") as caught:
        Snapshot.load_from(tmp_path)
    assert str(tmp_path / SNAPSHOT_FILE) in str(caught.value)


def test_load_of_garbled_json_says_so_and_gives_the_remedy(tmp_path: Path) -> None:
    (tmp_path / SNAPSHOT_FILE).write_text('{"tag": "base", ')

    with pytest.raises(SnapshotError, match="not valid JSON") as caught:
        Snapshot.load_from(tmp_path, remedy="delete it, please")
    assert str(caught.value).endswith("delete it, please")


def test_load_of_a_json_list_is_refused(tmp_path: Path) -> None:
    (tmp_path / SNAPSHOT_FILE).write_text("[]")

    with pytest.raises(SnapshotError, match="expected a JSON object, found list"):
        Snapshot.load_from(tmp_path)


@pytest.mark.parametrize(
    ("field", "bad_value", "expected"),
    [
        ("memory_mib", "256", "field 'memory_mib' must be an integer, found '256'"),
        ("memory_mib", True, "field 'memory_mib' must be an integer, found True"),
        ("status", "done", "field 'status' must be one of 'writing', 'ready', 'failed'"),
        ("fingerprint", {"qemu_version": 7}, "field 'fingerprint' must be an object"),
        ("pause_ms", "fast", "field 'pause_ms' must be a number or null"),
        ("base", 3, "field 'base' must be a string or null"),
        ("tag", "has space", "invalid snapshot name 'has space'"),
    ],
)
def test_load_names_the_bad_field(tmp_path: Path, field: str, bad_value: Any, expected: str) -> None:
    data = saved_json(tmp_path)
    data[field] = bad_value
    write_json(tmp_path, data)

    with pytest.raises(SnapshotError) as caught:
        Snapshot.load_from(tmp_path)
    assert expected in str(caught.value)


def test_load_names_a_missing_required_field(tmp_path: Path) -> None:
    data = saved_json(tmp_path)
    del data["backend"]
    write_json(tmp_path, data)

    with pytest.raises(SnapshotError, match="field 'backend' is missing"):
        Snapshot.load_from(tmp_path)


def test_load_fills_in_optional_fields_that_are_absent(tmp_path: Path) -> None:
    data = saved_json(tmp_path)
    del data["extra"], data["writer_pid"], data["pause_ms"]
    write_json(tmp_path, data)

    loaded = Snapshot.load_from(tmp_path)

    assert loaded.extra == {} and loaded.writer_pid is None and loaded.pause_ms is None


def test_load_accepts_an_integer_where_a_number_is_expected(tmp_path: Path) -> None:
    data = saved_json(tmp_path)
    data["pause_ms"] = 5
    write_json(tmp_path, data)

    assert Snapshot.load_from(tmp_path).pause_ms == 5


def test_load_refuses_unknown_fields(tmp_path: Path) -> None:
    data = saved_json(tmp_path)
    data["colour"] = "blue"
    write_json(tmp_path, data)

    with pytest.raises(SnapshotError, match="unknown field\\(s\\) 'colour'"):
        Snapshot.load_from(tmp_path)


def test_load_refuses_another_format_version(tmp_path: Path) -> None:
    data = saved_json(tmp_path)
    data["format"] = 3
    write_json(tmp_path, data)

    with pytest.raises(SnapshotError, match="'format' is 3, this pytest-forkd reads format 1 and 2"):
        Snapshot.load_from(tmp_path)


def test_invalid_tag_is_refused_on_construction(tmp_path: Path) -> None:
    with pytest.raises(InvalidTagError, match="'../escape'"):
        make_snapshot(tmp_path, tag="../escape")


def test_invalid_status_is_refused_on_construction(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError, match="status 'done' is not one of writing, ready, failed"):
        make_snapshot(tmp_path, status="done")


def test_record_is_immutable_including_its_mappings(tmp_path: Path) -> None:
    fingerprint = {"qemu_version": "7.2.0"}
    snapshot = make_snapshot(tmp_path, fingerprint=fingerprint)
    fingerprint["qemu_version"] = "changed afterwards"

    with pytest.raises(dataclasses.FrozenInstanceError):
        snapshot.tag = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        snapshot.fingerprint["qemu_version"] = "8.0"  # type: ignore[index]
    assert snapshot.fingerprint["qemu_version"] == "7.2.0"


def test_records_are_hashable_and_the_owner_does_not_count(tmp_path: Path) -> None:
    detached = make_snapshot(tmp_path)
    attached = detached.with_owner(RecordingOwner())

    assert attached == detached
    assert hash(attached) == hash(detached)
    assert detached.replace(memory_mib=512) != detached


def test_paths_are_absolute_and_absent_files_are_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    flat = make_snapshot(Path("snap"))
    diff = make_snapshot(Path("snap"), memory_file=None, diff_file="memory.diff", base="root")

    assert flat.state_path == tmp_path / "snap" / "state.bin"
    assert flat.memory_path == tmp_path / "snap" / "memory.ram"
    assert flat.diff_path is None
    assert diff.memory_path is None
    assert diff.diff_path == tmp_path / "snap" / "memory.diff"


def test_is_ready_follows_status(tmp_path: Path) -> None:
    assert make_snapshot(tmp_path).is_ready
    assert not make_snapshot(tmp_path, status="writing").is_ready
    assert not make_snapshot(tmp_path, status="failed", error="x").is_ready


def test_replace_keeps_the_owner(tmp_path: Path) -> None:
    owner = RecordingOwner()
    snapshot = make_snapshot(tmp_path).with_owner(owner)

    assert snapshot.replace(memory_mib=512).owner is owner


def test_fork_without_owner_explains_how_to_attach(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError, match="not attached to a session") as caught:
        make_snapshot(tmp_path).fork()
    assert "with_owner" in str(caught.value)


def test_fork_delegates_to_the_owner(tmp_path: Path) -> None:
    owner = RecordingOwner()
    snapshot = make_snapshot(tmp_path).with_owner(owner)

    children = snapshot.fork(3)

    assert children == ["vm0", "vm1", "vm2"]
    assert owner.calls == [(snapshot, 3)]
    assert owner.network == [None]


def test_fork_passes_the_network_policy_to_the_owner(tmp_path: Path) -> None:
    owner = RecordingOwner()
    snapshot = make_snapshot(tmp_path).with_owner(owner)

    snapshot.fork(1, network="outbound")

    assert owner.network == ["outbound"]


def test_export_is_the_owners_job(tmp_path: Path) -> None:
    owner = RecordingOwner()
    snapshot = make_snapshot(tmp_path).with_owner(owner)

    assert snapshot.export(tmp_path / "a.forkd.tar.zst") == tmp_path / "a.forkd.tar.zst"
    assert owner.exports == [(snapshot, tmp_path / "a.forkd.tar.zst")]


def test_export_without_owner_names_the_function_for_detached_records(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError, match="cannot write an archive.*export_snapshot") as caught:
        make_snapshot(tmp_path).export(tmp_path / "a.forkd.tar.zst")
    assert "with_owner" in str(caught.value)


def test_unserialisable_extra_is_reported_with_a_fix(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError, match="not JSON-serialisable.*keep `extra`"):
        make_snapshot(tmp_path, extra={"when": object()}).save_to(tmp_path)
    assert not (tmp_path / SNAPSHOT_FILE).exists()


def test_wait_ready_returns_a_ready_record_without_reading(tmp_path: Path) -> None:
    snapshot = make_snapshot(tmp_path / "never-written")

    assert snapshot.wait_ready(timeout=0) is snapshot


def test_wait_ready_returns_the_refreshed_record_once_ready(tmp_path: Path) -> None:
    owner = RecordingOwner()
    writing = make_snapshot(tmp_path, status="writing", writer_pid=os.getpid()).with_owner(owner)
    writing.save_to(tmp_path)
    finisher = threading.Timer(
        0.05, lambda: writing.replace(status="ready", writer_pid=None, total_ms=150.0).save_to(tmp_path)
    )
    finisher.start()
    try:
        ready = writing.wait_ready(timeout=10)
    finally:
        finisher.join()

    # "ready" and the writer's figure: it waited for the writer instead of returning the record being written
    assert ready.status == "ready" and ready.total_ms == 150.0
    assert ready.owner is owner


def test_wait_ready_raises_the_recorded_error_when_failed(tmp_path: Path) -> None:
    writing = make_snapshot(tmp_path, status="writing")
    writing.replace(status="failed", error="loader QEMU exited with status 1").save_to(tmp_path)

    with pytest.raises(SnapshotError, match="could not be written: loader QEMU exited with status 1"):
        writing.wait_ready(timeout=5)


def test_wait_ready_times_out_with_a_clear_message(tmp_path: Path) -> None:
    writing = make_snapshot(tmp_path, status="writing", writer_pid=os.getpid())
    writing.save_to(tmp_path)

    started = time.monotonic()
    with pytest.raises(SnapshotError, match="still being written after 0.1 s"):
        writing.wait_ready(timeout=0.1)
    assert time.monotonic() - started < 3


def test_wait_ready_gives_up_when_the_writer_is_gone(tmp_path: Path) -> None:
    pid = dead_pid()
    writing = make_snapshot(tmp_path, status="writing", writer_pid=pid)
    writing.save_to(tmp_path)

    with pytest.raises(SnapshotError, match=f"writer process {pid} is gone"):
        writing.wait_ready()


def test_process_is_alive() -> None:
    assert process_is_alive(os.getpid())
    assert not process_is_alive(dead_pid())
