"""``forkd bench``: measure this host and print JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..bench import BenchPlan, run_bench
from ..engine.accel import ACCELS


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _str_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench", help="measure cold boot, fork, exec and branch latencies on this host (JSON)",
        description="Measure, in one run: cold_boot_ms, fork_ms, fork_pooled_ms, exec_rtt_ms, "
                    "copy_reference_mib_s and a branch pause/total per (backend, memory, dirty MiB). "
                    "Each figure is {n, min, p50, p95, max}.")
    p.add_argument("--memory", type=_int_list, default=[256, 1024], metavar="MIB[,MIB...]",
                   help="guest memory sizes for the branch table (default: 256,1024)")
    p.add_argument("--backends", type=_str_list, default=["full", "diff", "uffd"], metavar="NAME[,NAME...]",
                   help="storage backends (default: full,diff,uffd)")
    p.add_argument("--dirty", type=_int_list, default=[0, 16, 64], metavar="MIB[,MIB...]",
                   help="MiB the guest dirties before each branch (default: 0,16,64)")
    p.add_argument("--repeats", type=int, default=5, help="samples per figure (default: %(default)s)")
    p.add_argument("--boots", type=int, default=3, help="cold boots to time (default: %(default)s)")
    p.add_argument("--accel", choices=ACCELS, default="auto")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the JSON to PATH")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    plan = BenchPlan(memory_mib=args.memory, backends=args.backends, dirty_mib=args.dirty,
                     repeats=args.repeats, boots=args.boots, accel=args.accel)
    result = run_bench(plan, progress=lambda line: print(f"forkd bench: {line}", file=sys.stderr))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0
