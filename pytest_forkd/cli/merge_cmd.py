"""``forkd merge RUN... (-o FILE | --save [NAME])``: merge shard runs into one run.

The last job of a sharded CI run merges the shards' ``--forkd-json`` files
into one run: to keep as the baseline (``--save`` stores it in the project's
benchmark storage, where ``--forkd-compare`` finds it) or to compare
(``forkd compare`` also merges on its own).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pytest_forkd.errors import ConfigError
from pytest_forkd.latency.runs import write_run
from pytest_forkd.latency.shards import expand_run_paths, load_runs


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "merge",
        help="merge the runs of several shards into one run (sample counts add up)",
        description="Merge run files (pytest --forkd-json, or stored runs), one per CI shard, into one run. "
        "Refuses shards whose snapshot recipe hashes or run conditions differ. Each shard's machine "
        "info stays in the merged run under 'shards'.",
    )
    p.add_argument("runs", type=Path, nargs="+", metavar="RUN", help="run files, or directories of them")
    p.add_argument("-o", "--output", type=Path, metavar="FILE", help="write the merged run to FILE")
    p.add_argument(
        "--save",
        nargs="?",
        const="",
        default=None,
        metavar="NAME",
        help="store the merged run under .forkd/benchmarks/ of --root, as pytest --forkd-save does "
        "(NAME defaults to the short commit id)",
    )
    p.add_argument(
        "--root",
        type=Path,
        default=Path("."),
        metavar="DIR",
        help="project root holding .forkd/benchmarks (default: the working directory)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.output is None and args.save is None:
        raise ConfigError("forkd merge: say where the merged run goes: -o FILE, --save [NAME], or both")
    files = expand_run_paths(args.runs)
    merged = load_runs(files)
    counts = {op: len(section["samples"]) for op, section in merged["operations"].items()}
    if args.output is not None:
        args.output.write_text(json.dumps(merged, indent=2) + "\n", encoding="utf-8")
        print(f"merged {len(files)} run(s) into {args.output}")
    if args.save is not None:
        path = write_run(args.root, merged, args.save or None)
        print(f"merged {len(files)} run(s), stored as {path}")
    print("samples: " + ", ".join(f"{op} {count}" for op, count in counts.items()))
    return 0
