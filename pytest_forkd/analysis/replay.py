"""Replaying a recorded transcript: the steps of ``forkd bisect``.

A transcript file (``--forkd-transcript``) holds, per VM, the snapshot its
history starts at (its *root*, such as ``base``), the operations inherited
from the VM it was forked from (setup), and its own operations. Replaying
means: start a child of the root, run the setup, then run the VM's own
operations as trajectory steps, entries of one trajectory step together.
Commands, working directories, stdin and written files are replayed as
recorded; environment variable values were never recorded (only their names)
and come from ``--env KEY=VALUE``. Only the operations before the VM's first
restore are replayed: a restore means the recorded run went back in time.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pytest_forkd.analysis.transcript import REPLAYABLE, TranscriptFile, payload_bytes
from pytest_forkd.errors import TranscriptError

if TYPE_CHECKING:
    from pytest_forkd.core.vm import VM


@dataclass(frozen=True)
class ReplayOp:
    """One recorded operation, ready to run again."""

    entry: Mapping[str, Any]
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        entry = self.entry
        if entry["kind"] == "write_file":
            return f"write {entry['path']}"
        if entry["kind"] == "copy_in":
            return f"copy {entry['local']} into {entry['path']}"
        command = entry["command"]
        return command if isinstance(command, str) else " ".join(command)

    def __call__(self, vm: VM) -> Any:
        entry = self.entry
        if entry["kind"] == "write_file":
            return vm.write_file(
                entry["path"], payload_bytes(entry["data"]) or b"", mode=entry.get("mode"), user=entry.get("user")
            )
        if entry["kind"] == "copy_in":  # from the host path as it is now, which may have changed since
            return vm.copy_in(entry["local"], entry["path"], exclude=entry.get("exclude") or ())
        command = entry["command"]
        return vm.exec(
            command if isinstance(command, str) else list(command),
            cwd=entry.get("cwd"),
            env=dict(self.env) or None,
            stdin=payload_bytes(entry.get("stdin")),
            timeout=entry.get("timeout"),
        )


@dataclass(frozen=True)
class ReplayStep:
    """The operations of one step (one recorded trajectory step, or one operation)."""

    ops: tuple[ReplayOp, ...]
    recorded_step: int | None

    @property
    def label(self) -> str:
        """The name a Trajectory shows for this step."""
        names = "; ".join(op.label for op in self.ops)
        prefix = f"recorded step {self.recorded_step}: " if self.recorded_step is not None else ""
        return prefix + (names if len(names) <= 200 else names[:197] + "...")

    def __call__(self, vm: VM) -> None:
        for op in self.ops:
            op(vm)


@dataclass
class ReplayPlan:
    """What to start from and what to run."""

    root: Mapping[str, Any] | None
    setup: list[ReplayOp]
    steps: list[ReplayStep]
    notes: list[str]


def _op(entry: Mapping[str, Any], env: Mapping[str, str], notes: list[str], source: str) -> ReplayOp:
    where = f"{source} entry {entry.get('seq', '?')}"
    if entry["kind"] == "write_file" and payload_bytes(entry.get("data")) is None:
        raise TranscriptError(
            f"{where} writes {entry.get('path')} ({entry['data'].get('bytes')} bytes), too large "
            "to have been recorded: it cannot be replayed"
        )
    if entry["kind"] == "exec" and "stdin" in entry and payload_bytes(entry["stdin"]) is None:
        raise TranscriptError(
            f"{where} had {entry['stdin'].get('bytes')} bytes of stdin, too many to have been "
            "recorded: it cannot be replayed"
        )
    if entry["kind"] == "copy_in":
        if not os.path.lexists(str(entry.get("local"))):
            raise TranscriptError(
                f"{where} copies {entry.get('local')} from the host into {entry.get('path')}, "
                "and that host path no longer exists: it cannot be replayed"
            )
        notes.append(f"{where} copies {entry.get('local')} again as it is now (its contents were not recorded)")
    keys = entry.get("env_keys") or []
    missing = [key for key in keys if key not in env]
    if missing:
        notes.append(
            f"{where} replayed without the values of {', '.join(missing)} (not recorded; pass --env KEY=VALUE)"
        )
    return ReplayOp(entry, {key: env[key] for key in keys if key in env})


def plan_replay(
    transcript: TranscriptFile, vm_name: str | None = None, env: Mapping[str, str] | None = None
) -> ReplayPlan:
    """The setup and the steps to replay for one VM of ``transcript``."""
    env = env or {}
    vm = transcript.vm(vm_name)
    notes: list[str] = []
    setup = [
        _op(entry, env, notes, "inherited")
        for entry in transcript.inherited_entries(vm["name"])
        if entry.get("kind") in REPLAYABLE
    ]
    own = transcript.own_entries(vm["name"])
    restores = [index for index, entry in enumerate(own) if entry.get("kind") == "restore"]
    if restores:
        notes.append(
            f"VM {vm['name']} was restored {len(restores)} times; replaying the operations before its "
            f"first restore ({restores[0]} of {len(own)} entries)"
        )
        own = own[: restores[0]]
    steps: list[ReplayStep] = []
    for entry in own:
        if entry.get("kind") not in REPLAYABLE:
            continue
        op = _op(entry, env, notes, vm["name"])
        recorded = entry.get("step")
        if recorded is not None and steps and steps[-1].recorded_step == recorded:
            steps[-1] = ReplayStep((*steps[-1].ops, op), recorded)
        else:
            steps.append(ReplayStep((op,), recorded))
    if not steps:
        raise TranscriptError(
            f"VM {vm['name']} in {transcript.path} ran no command or file write of its own: nothing to bisect"
        )
    return ReplayPlan(vm.get("root"), setup, steps, notes)
