"""``forkd exec``: run one command in a fresh microVM and exit with its status."""

from __future__ import annotations

import argparse
import json
import sys
import time

from ..engine.accel import ACCELS
from ..factory import VMFactory
from ..store import SnapshotStore


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "exec", help="boot a VM (or fork a snapshot), run a command, exit with its status",
        description="Boot a microVM from an image (or fork a child of a snapshot), run CMD in it, copy its "
                    "stdout/stderr to ours and exit with its exit code. Example: forkd exec -- python3 -c 'print(42)'",
    )
    p.add_argument("--image", default="default", help="guest image name (default: %(default)s)")
    p.add_argument("--snapshot", metavar="TAG", help="run in a child of this snapshot instead of a fresh boot")
    p.add_argument("--store", metavar="DIR", help="snapshot store (default: the user cache)")
    p.add_argument("--memory", type=int, default=256, metavar="MIB", help="guest memory (default: %(default)s)")
    p.add_argument("--vcpus", type=int, default=1, help="virtual CPUs (default: %(default)s)")
    p.add_argument("--accel", choices=ACCELS, default="auto", help="accelerator (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="kill the command after S seconds")
    p.add_argument("--timings", action="store_true", help="print start-up and command timings (JSON) to stderr")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command and its arguments")
    p.set_defaults(run=run)


def exit_status(exit_code: int) -> int:
    """Shell convention: a command killed by signal N exits 128+N."""
    return 128 - exit_code if exit_code < 0 else exit_code


def run(args: argparse.Namespace) -> int:
    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("forkd exec: no command given; usage: forkd exec [OPTIONS] -- CMD [ARGS...]", file=sys.stderr)
        return 2
    factory = VMFactory(accel=args.accel, progress=lambda line: print(line, file=sys.stderr))
    try:
        started = time.perf_counter()
        if args.snapshot:
            store = SnapshotStore(args.store) if args.store else SnapshotStore.persistent()
            vm = factory.fork_snapshot(store.get(args.snapshot), 1)[0]
        else:
            vm = factory.boot(args.image, memory_mib=args.memory, vcpus=args.vcpus)
        ready_ms = (time.perf_counter() - started) * 1000
        result = vm.exec(command, timeout=args.timeout)
        sys.stdout.buffer.write(result.stdout_bytes)
        sys.stdout.flush()
        sys.stderr.buffer.write(result.stderr_bytes)
        sys.stderr.flush()
        if args.timings:
            report = {
                "accel": factory.accel_verdict(vm.image).accel,
                "memory_mib": vm.memory_mib,
                "start_to_first_reply_ms": round(ready_ms, 1),
                "exec_ms": round(vm.history[-1]["ms"], 1),
                "exec_guest_ms": round(result.duration_ms, 1),
                "mode": "fork" if args.snapshot else "cold_boot",
            }
            print(json.dumps(report), file=sys.stderr)
        return exit_status(result.exit_code)
    finally:
        factory.close()
