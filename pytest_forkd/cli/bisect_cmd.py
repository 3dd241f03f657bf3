"""``forkd bisect``: find the step of a recorded transcript after which a check fails."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pytest_forkd.analysis.trajectory import DEFAULT_EVERY
from pytest_forkd.engine.host import ACCELS
from pytest_forkd.errors import ConfigError, TranscriptError


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "bisect",
        help="replay a recorded transcript and find the first step after which a check fails",
        description="Start a child of the snapshot the transcript's history starts at (e.g. base), replay the "
        "operations the VM inherited, then its own operations as steps with a diff checkpoint every "
        "--every steps, and bisect: CHECK is a shell command run in the guest, exit status 0 meaning "
        "good. Prints which step broke it and which steps were replayed. Example: forkd bisect "
        "transcripts/test_agent.jsonl --check 'cd /srv/repo && python3 -m unittest'",
    )
    p.add_argument("transcript", type=Path, metavar="TRANSCRIPT", help="a file written by --forkd-transcript=DIR")
    p.add_argument("--check", required=True, metavar="CMD", help="shell command in the guest: exit 0 = good state")
    p.add_argument("--vm", metavar="NAME", help="which VM of the transcript (default: the first, the test's VM)")
    p.add_argument("--snapshot", metavar="TAG", help="start from this snapshot instead of the recorded root")
    p.add_argument(
        "--store", metavar="DIR", help="snapshot store of --snapshot (default: the recorded one, else the user cache)"
    )
    p.add_argument(
        "--every", type=int, default=DEFAULT_EVERY, metavar="K", help="checkpoint every K steps (default: %(default)s)"
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="value of an environment variable the recorded commands had (values are never recorded)",
    )
    p.add_argument("--accel", choices=ACCELS, default="auto", help="accelerator (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(run=run)


def _env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--env takes KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


def run(args: argparse.Namespace) -> int:
    from pytest_forkd.analysis.replay import plan_replay
    from pytest_forkd.analysis.trajectory import Trajectory
    from pytest_forkd.analysis.transcript import read_jsonl
    from pytest_forkd.core.factory import VMFactory
    from pytest_forkd.storage.store import SnapshotStore

    transcript = read_jsonl(args.transcript)
    plan = plan_replay(transcript, args.vm, _env(args.env))
    root = plan.root or {}
    tag = args.snapshot or root.get("tag")
    if not tag:
        raise TranscriptError(f"{args.transcript}: the VM was booted, not started from a snapshot; pass --snapshot")
    store_dir = args.store or (None if args.snapshot else root.get("store"))
    store = SnapshotStore(store_dir) if store_dir else SnapshotStore.persistent()
    if not store.exists(tag):
        raise TranscriptError(
            f"the transcript's history starts at snapshot {tag!r} in {store.root}, which no longer "
            "exists (session snapshots go with their run); pass --snapshot TAG [--store DIR]"
        )

    def progress(line: str) -> None:
        print(f"forkd bisect: {line}", file=sys.stderr)

    for note in plan.notes:
        progress(note)
    factory = VMFactory(accel=args.accel, progress=progress)
    try:
        vm = factory.fork_snapshot(store.get(tag), 1)[0]
        progress(f"replaying {len(plan.setup)} inherited operations, then {len(plan.steps)} steps, from {tag!r}")
        for op in plan.setup:
            op(vm)
        with Trajectory(vm, every=args.every) as trajectory:
            trajectory.run(plan.steps)
            result = trajectory.bisect(lambda vm: vm.exec(args.check).exit_code == 0)
    finally:
        factory.close()
    if args.json:
        print(
            json.dumps(
                {
                    "first_bad": result.first_bad,
                    "step": result.step.name if result.step else None,
                    "steps": result.steps,
                    "restores": result.restores,
                    "replayed": result.replayed,
                    "evaluations": {str(k): v for k, v in sorted(result.evaluations.items())},
                    "message": result.message,
                    "notes": plan.notes,
                },
                indent=2,
            )
        )
    else:
        print(result.report())
    return 0 if result.found else 1
