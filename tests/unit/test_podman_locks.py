"""The suite leaves podman's shared-memory locks as it found them (tests/support.py, used by conftest.py)."""

from __future__ import annotations

from pathlib import Path

from support import podman_locks, remove_podman_locks_made_since


def test_a_lock_the_run_made_is_removed_once_no_podman_runs(tmp_path: Path) -> None:
    (lock,) = podman_locks(tmp_path)
    lock.write_bytes(b"\0" * 64)
    assert remove_podman_locks_made_since(set(), tmp_path, running=lambda: False) == [lock]
    assert not lock.exists()


def test_a_lock_that_was_there_before_or_is_in_use_stays(tmp_path: Path) -> None:
    (lock,) = podman_locks(tmp_path)
    lock.write_bytes(b"\0" * 64)
    assert remove_podman_locks_made_since({lock}, tmp_path, running=lambda: False) == []
    assert remove_podman_locks_made_since(set(), tmp_path, running=lambda: True) == []
    assert lock.exists()
    assert remove_podman_locks_made_since(set(), tmp_path / "empty", running=lambda: False) == []
