"""``forkd compare BASELINE.json CURRENT.json [--fail EXPR]...``: compare two stored runs.

Prints per operation (and per test timed in both runs) n, p50, p95 and max of
both runs with the delta, and exits 1 when a ``--fail`` threshold is a
noise-guarded regression, so the command can gate CI on its own.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..baseline import DEFAULT_MIN_SAMPLES, compare, load_run, parse_compare_fail


def _sample_count(text: str) -> int:
    """argparse type: a sample count a permutation test can work with."""
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if count < 2:
        raise argparse.ArgumentTypeError(f"need at least 2 samples to tell noise from a slowdown, got {count}")
    return count


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "compare",
        help="compare two stored benchmark runs",
        description=(
            "Compare two runs stored under .forkd/benchmarks/. A --fail threshold counts as a "
            "regression only when both runs have enough samples and a permutation test says "
            "the current run is slower beyond noise (p < 0.05 for the whole comparison, "
            "Holm-corrected over all checks)."
        ),
    )
    p.add_argument(
        "baseline", type=Path, help="run file to compare against, e.g. .forkd/benchmarks/.../0001_abc1234.json"
    )
    p.add_argument("current", type=Path, help="run file to check")
    p.add_argument(
        "--fail",
        dest="fail",
        action="append",
        default=[],
        metavar="EXPR",
        help="fail (exit 1) on a regression: STAT:N%% (relative, e.g. p95:20%%) or STAT:Nms "
        "(absolute, e.g. p50:5ms); STAT is min, p50, p95, p99, max or mean; repeatable",
    )
    p.add_argument(
        "--min-samples",
        type=_sample_count,
        default=DEFAULT_MIN_SAMPLES,
        metavar="N",
        help=f"samples each run needs before an operation can fail (default {DEFAULT_MIN_SAMPLES})",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    thresholds = [parse_compare_fail(expression) for expression in args.fail]
    comparison = compare(
        load_run(args.baseline),
        load_run(args.current),
        thresholds,
        min_samples=args.min_samples,
        baseline_label=str(args.baseline),
        current_label=str(args.current),
    )
    for warning in comparison.warnings:
        print(f"forkd: warning: {warning}", file=sys.stderr)
    print(comparison.format_table())
    return 1 if comparison.regressions else 0
