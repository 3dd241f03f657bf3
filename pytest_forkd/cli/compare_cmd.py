"""``forkd compare BASELINE CURRENT... [--fail EXPR]... [--strict]``: compare two stored runs.

Each run is a run file, a directory of them, or the ID of a run stored under
``.forkd/benchmarks/`` of ``--root`` (default: the nearest directory upwards
with one): a counter such as ``0001``, a name, or a stem such as
``0001_abc1234``.

Prints per operation (and per test timed in both runs) n, p50, p95 and max of
both runs with the delta, and exits 1 when a ``--fail`` threshold is a
noise-guarded regression, so the command can gate CI on its own. Several
CURRENT runs (one per CI shard), or a directory of them, are merged into one
first (:mod:`pytest_forkd.latency.shards`); so is a BASELINE directory. Runs of a
different machine, accelerator, backend or QEMU version are warned about, or
refused with ``--strict`` (exit 4).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pytest_forkd.errors import ConfigError
from pytest_forkd.latency.compare import DEFAULT_MIN_SAMPLES, compare, parse_compare_fail
from pytest_forkd.latency.runs import find_baseline, list_runs, storage_dir
from pytest_forkd.latency.shards import expand_run_paths, load_runs


def _sample_count(text: str) -> int:
    """argparse type: a sample count a permutation test can work with."""
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if count < 2:
        raise argparse.ArgumentTypeError(f"need at least 2 samples to tell noise from a slowdown, got {count}")
    return count


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
        "runs",
        nargs="+",
        metavar="RUN",
        help="BASELINE then CURRENT...: the run to compare against (e.g. .forkd/benchmarks/.../0001_abc1234.json, "
        "or a directory of shard runs), then the run to check; several current runs (one per shard) or a "
        "directory of them are merged into one",
    )
    p.add_argument(
        "--baseline",
        action="append",
        default=[],
        metavar="RUN",
        help="a baseline run (repeatable: the runs of several shards are merged into one baseline); "
        "then every RUN argument is a current run",
    )
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
    p.add_argument(
        "--root",
        type=Path,
        default=None,
        metavar="DIR",
        help="project directory whose .forkd/benchmarks/ holds the runs that IDs name (default: the nearest "
        "directory upwards from the current one that has .forkd/benchmarks/, else the current one)",
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="refuse (exit 4) to compare runs of a different machine, accelerator, backend or QEMU version "
        "instead of warning",
    )
    p.set_defaults(run=run)


def resolve_run(ref: str, root: Path) -> Path:
    """The run file or directory ``ref`` names: an existing path, else a run ID stored under ``root``.

    Something that looks like a path (a ``/`` or a ``.json`` suffix) stays a
    path, so a mistyped file name is reported as the missing file it is.
    """
    candidate = Path(ref)
    if candidate.exists() or "/" in ref or ref.endswith(".json"):
        return candidate
    found = find_baseline(root, ref)
    if found is not None:
        return found
    stored = [path.stem for path in list_runs(root)]
    available = f"stored runs: {', '.join(stored[-10:])}" if stored else "no runs are stored there yet"
    raise ConfigError(
        f"no run {ref!r}: it is neither a file nor the ID of a run in {storage_dir(root)} ({available}); "
        "give a run file, or a run ID such as 0001 (use --root DIR for another project's runs)"
    )


def default_root(start: Path | None = None) -> Path:
    """The nearest directory from ``start`` (the current one) upwards with stored runs, else ``start``."""
    here = (start or Path.cwd()).resolve()
    for directory in (here, *here.parents):
        if (directory / ".forkd" / "benchmarks").is_dir():
            return directory
    return here


def run(args: argparse.Namespace) -> int:
    thresholds = [parse_compare_fail(expression) for expression in args.fail]
    baseline, current = (args.baseline, args.runs) if args.baseline else (args.runs[:1], args.runs[1:])
    if not current:
        raise ConfigError(
            "forkd compare: give a baseline run and at least one current run "
            "(forkd compare BASELINE CURRENT..., or --baseline RUN... CURRENT...)"
        )
    root = args.root if args.root is not None else default_root()
    baseline_files = expand_run_paths([resolve_run(ref, root) for ref in baseline])
    current_files = expand_run_paths([resolve_run(ref, root) for ref in current])
    comparison = compare(
        load_runs(baseline_files),
        load_runs(current_files),
        thresholds,
        min_samples=args.min_samples,
        baseline_label=_label(baseline_files, baseline),
        current_label=_label(current_files, current),
        strict=args.strict,
    )
    for warning in comparison.warnings:
        print(f"forkd: warning: {warning}", file=sys.stderr)
    print(comparison.format_table())
    return 1 if comparison.regressions else 0


def _label(files: list[Path], refs: list[str]) -> str:
    """What the user named (a run ID reads better than its resolved path), or how many shard runs merged."""
    if len(files) == 1:
        return refs[0] if len(refs) == 1 else str(files[0])
    return f"{len(files)} shard runs merged"
