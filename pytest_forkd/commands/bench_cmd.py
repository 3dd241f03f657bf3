"""``forkd bench``: measure this host and print JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..bench import SWEEP_MEMORY, BenchPlan, plot_sweep, run_bench, run_sweep
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
    p.add_argument("--memory", type=_int_list, default=None, metavar="MIB[,MIB...]",
                   help="guest memory sizes for the branch table (default: 256,1024; with --sweep 256,512,1024,2048)")
    p.add_argument("--backends", type=_str_list, default=["full", "diff", "uffd"], metavar="NAME[,NAME...]",
                   help="storage backends (default: full,diff,uffd)")
    p.add_argument("--dirty", type=_int_list, default=None, metavar="MIB[,MIB...]",
                   help="MiB the guest dirties before each branch (default: 0,16,64; with --sweep 16)")
    p.add_argument("--sweep", action="store_true",
                   help="pause window vs memory per backend and fork latency vs memory, plotted as PNG "
                        "(needs the 'plot' extra: pip install 'pytest-forkd[plot]')")
    p.add_argument("--plot", type=Path, default=Path("forkd-sweep.png"), metavar="PATH",
                   help="PNG written by --sweep (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="samples per figure (default: %(default)s)")
    p.add_argument("--boots", type=int, default=3, help="cold boots to time (default: %(default)s)")
    p.add_argument("--accel", choices=ACCELS, default="auto")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the JSON to PATH")
    p.set_defaults(run=run)


def _progress(line: str) -> None:
    print(f"forkd bench: {line}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    if args.sweep:
        plan = BenchPlan(memory_mib=args.memory or SWEEP_MEMORY, backends=args.backends,
                         dirty_mib=args.dirty or [16], repeats=args.repeats, accel=args.accel)
        result = run_sweep(plan, progress=_progress)
        json_path = args.json or args.plot.with_suffix(".json")
    else:
        plan = BenchPlan(memory_mib=args.memory or [256, 1024], backends=args.backends,
                         dirty_mib=args.dirty if args.dirty is not None else [0, 16, 64],
                         repeats=args.repeats, boots=args.boots, accel=args.accel)
        result = run_bench(plan, progress=_progress)
        json_path = args.json
    text = json.dumps(result, indent=2)
    print(text)
    if json_path:
        json_path.write_text(text + "\n")
        _progress(f"wrote {json_path}")
    if args.sweep:
        try:
            _progress(f"wrote {plot_sweep(result, args.plot)}")
        except ImportError:
            _progress("matplotlib is not installed: no plot (pip install 'pytest-forkd[plot]'); the JSON is written")
    return 0
