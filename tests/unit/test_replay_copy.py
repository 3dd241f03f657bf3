"""copy_in entries of a transcript replay (bisect, trajectories) from the host path as it is now."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_forkd.analysis.replay import _op
from pytest_forkd.analysis.transcript import REPLAYABLE, format_entry
from pytest_forkd.errors import TranscriptError


class RecordingVM:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def copy_in(self, local: str, path: str, *, exclude: tuple = ()) -> None:
        self.calls.append((local, path, tuple(exclude)))


def test_a_copy_in_entry_replays_as_a_copy_in(tmp_path: Path) -> None:
    entry = {"seq": 3, "kind": "copy_in", "local": str(tmp_path), "path": "/srv/app", "exclude": ["*.pyc"]}
    notes: list[str] = []
    op = _op(entry, {}, notes, "vm")
    vm = RecordingVM()
    op(vm)  # type: ignore[arg-type]

    assert "copy_in" in REPLAYABLE
    assert vm.calls == [(str(tmp_path), "/srv/app", ("*.pyc",))]
    assert op.label == f"copy {tmp_path} into /srv/app"
    assert "as it is now" in notes[0]
    assert f"{tmp_path} -> /srv/app" in format_entry({**entry, "files": 2, "bytes": 10, "duration_ms": 1.0})


def test_a_copy_in_from_a_host_path_that_is_gone_cannot_be_replayed(tmp_path: Path) -> None:
    entry = {"seq": 4, "kind": "copy_in", "local": str(tmp_path / "gone"), "path": "/srv/app"}
    with pytest.raises(TranscriptError, match="no longer exists"):
        _op(entry, {}, [], "vm")
