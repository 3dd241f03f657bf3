"""Transcripts: entries, lineage through snapshots, JSON Lines files, replay plans."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from pytest_forkd.analysis.replay import plan_replay
from pytest_forkd.analysis.transcript import HEAD_BYTES, Transcript, format_entry, read_jsonl, write_jsonl
from pytest_forkd.errors import TranscriptError
from pytest_forkd.guest.exec_result import ExecResult


@dataclass
class Snap:
    tag: str
    path: Path
    backend: str = "diff"


def _exec(transcript: Transcript, command, result: ExecResult, **kwargs) -> dict:
    entry = transcript.begin_exec(
        command, cwd=kwargs.get("cwd"), env=kwargs.get("env"), stdin=kwargs.get("stdin"), timeout=None
    )
    Transcript.finish(entry, 0.0, result=result)
    return entry


def test_exec_entries_keep_env_names_heads_tails_and_outcome() -> None:
    transcript = Transcript("vm1")
    long = b"a" * HEAD_BYTES + b"middle" + b"z" * 2000
    entry = _exec(
        transcript,
        ["sh", "-c", "x"],
        ExecResult(("sh", "-c", "x"), -9, long, b"err\n", 5.0),
        cwd="/srv",
        env={"TOKEN": "secret"},
        stdin="input",
    )
    assert entry["env_keys"] == ["TOKEN"] and "secret" not in json.dumps(entry)
    assert entry["signal"] == "SIGKILL" and entry["exit_code"] == -9 and entry["truncated"] is False
    assert entry["stdout"]["bytes"] == len(long) and entry["stdout"]["head"] == "a" * HEAD_BYTES
    assert entry["stdout"]["tail"].endswith("z") and "middle" not in entry["stdout"]["tail"]
    assert entry["stdin"]["text"] == "input" and entry["cwd"] == "/srv"
    assert "SIGKILL" in format_entry(entry) and "[env TOKEN] (cd /srv) sh -c x" in format_entry(entry)


def test_fields_of_a_newer_exec_result_are_recorded_when_present() -> None:
    @dataclass
    class Newer:
        exit_code: int = 0
        stdout_bytes: bytes = b"x"
        stderr_bytes: bytes = b""
        duration_ms: float = 1.0
        truncated: bool = True
        oom_killed: bool = True
        signal: int = 9

    entry = _exec(Transcript("vm"), "cmd", Newer())
    assert entry["truncated"] and entry["oom_killed"] and entry["signal"] == "SIGKILL"
    assert "[truncated, oom_killed]" in format_entry(entry)


def test_lineage_flows_through_snapshots_and_restores(tmp_path: Path) -> None:
    base = Snap("base", tmp_path / "store" / "base")
    parent = Transcript("parent", base)
    _exec(parent, "setup", ExecResult("setup", 0, b"", b"", 1.0))
    branch = Snap("parent-g1", tmp_path / "run" / "parent-g1")
    parent.branched(branch)
    child = Transcript("child", branch)
    assert child.descends_from(branch) and child.descends_from(base)
    assert child.start.root == {"tag": "base", "store": str(tmp_path / "store")}
    assert [entry["command"] for entry in child.lineage().entries] == ["setup"]
    _exec(child, "step", ExecResult("step", 0, b"", b"", 1.0))
    other = Snap("other", tmp_path / "run" / "other")
    child.restored(other)
    assert not child.descends_from(branch) and child.lineage().entries == ()
    path = write_jsonl(tmp_path / "t.jsonl", [child], test="t::x", outcome="failed")
    read = read_jsonl(path)
    assert read.header["test"] == "t::x" and read.vm()["root"]["tag"] == "base"
    assert [entry["command"] for entry in read.inherited_entries("child")] == ["setup"]
    plan = plan_replay(read)
    assert [op.label for op in plan.setup] == ["setup"]
    assert [step.label for step in plan.steps] == ["step"]
    assert any("restored 1 times" in note for note in plan.notes)


def test_replay_plan_groups_trajectory_steps_and_notes_missing_env(tmp_path: Path) -> None:
    transcript = Transcript("vm", Snap("base", tmp_path / "base"))
    for step, command in ((1, "a"), (1, "b"), (2, "c")):
        transcript.step = step
        _exec(transcript, command, ExecResult(command, 0, b"", b"", 1.0), env={"KEY": "v"} if step == 2 else None)
    transcript.step = None
    transcript.write_file("/f", b"\x00\x01", 0o600)
    read = read_jsonl(write_jsonl(tmp_path / "t.jsonl", [transcript]))
    plan = plan_replay(read)
    assert [step.label for step in plan.steps] == ["recorded step 1: a; b", "recorded step 2: c", "write /f"]
    assert any("without the values of KEY" in note for note in plan.notes)
    assert plan_replay(read, env={"KEY": "v"}).notes == []


def test_bad_transcript_files(tmp_path: Path) -> None:
    with pytest.raises(TranscriptError, match="cannot read"):
        read_jsonl(tmp_path / "missing.jsonl")
    (tmp_path / "x.jsonl").write_text('{"hello": 1}\n')
    with pytest.raises(TranscriptError, match="not a pytest-forkd transcript"):
        read_jsonl(tmp_path / "x.jsonl")
    (tmp_path / "v.jsonl").write_text('{"format": "pytest-forkd-transcript", "version": 99}\n')
    with pytest.raises(TranscriptError, match="version 99 transcript.*reads version 1"):
        read_jsonl(tmp_path / "v.jsonl")
    (tmp_path / "j.jsonl").write_text("not json\n")
    with pytest.raises(TranscriptError, match="is not JSON"):
        read_jsonl(tmp_path / "j.jsonl")
    empty = read_jsonl(write_jsonl(tmp_path / "e.jsonl", [Transcript("vm", Snap("b", tmp_path / "b"))]))
    with pytest.raises(TranscriptError, match="nothing to bisect"):
        plan_replay(empty)
    with pytest.raises(TranscriptError, match="no VM 'nope'"):
        plan_replay(empty, "nope")


def test_written_data_is_kept_within_a_budget(monkeypatch) -> None:
    monkeypatch.setattr("pytest_forkd.analysis.transcript.REPLAY_DATA_BUDGET", 10)
    transcript = Transcript("vm")
    kept = transcript.write_file("/a", b"12345678", None)
    dropped = transcript.write_file("/b", b"12345678", None)
    assert kept["data"]["text"] == "12345678"
    assert "text" not in dropped["data"] and dropped["data"]["bytes"] == 8 and len(dropped["data"]["sha256"]) == 64
