"""``forkd bench``: measure this host and print JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pytest_forkd.cli.bench import PARTS, SWEEP_MEMORY, BenchPlan, figure, plot_sweep, run_bench, run_sweep
from pytest_forkd.engine.host import ACCELS
from pytest_forkd.engine.network import MODES


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _whole(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


def _str_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "bench",
        help="measure cold boot, fork, exec and branch latencies on this host (JSON)",
        description="Measure, in one run: cold_boot_ms, fork_ms, restore_phases_ms, fork_pooled_ms, "
        "overhead_0ms/10ms/100ms (per-test forkd_vm overhead through the plugin) and their ratios to "
        "fork_pooled_ms, fork20_parallel_speedup, exec_rtt_ms, exec_output_mib_s, "
        "manifest_ms, "
        "manifest_cold_ms and changes_ms (a 20,000-file tree), "
        "copy_reference_mib_s and a branch pause/total per (backend, memory, dirty MiB); "
        "uffd_pause_ms and uffd_growth_ratio, diff_pause_* over successive branches, "
        "child_pss_mib and parent_pss_mib, guest_python_slowdown, cpu_per_child_ms (QEMU CPU per phase "
        "of 12 serial fork(1)), tcg_translation and first_command_tax, image_* (children of container "
        "images), e2b_* (E2B's SDK against forkd's own calls) (select with --parts). "
        "Each figure is {n, min, p50, p95, max}.",
    )
    p.add_argument(
        "--memory",
        type=_int_list,
        default=None,
        metavar="MIB[,MIB...]",
        help="guest memory sizes for the branch table (default: 256,1024; with --sweep 256,512,1024,2048)",
    )
    p.add_argument(
        "--backends",
        type=_str_list,
        default=["full", "diff", "uffd"],
        metavar="NAME[,NAME...]",
        help="storage backends (default: full,diff,uffd)",
    )
    p.add_argument(
        "--dirty",
        type=_int_list,
        default=None,
        metavar="MIB[,MIB...]",
        help="MiB the guest dirties before each branch (default: 0,16,64; with --sweep 16)",
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="pause window vs memory per backend and fork latency vs memory, plotted as PNG "
        "(needs the 'plot' extra: pip install 'pytest-forkd[plot]')",
    )
    p.add_argument(
        "--plot",
        type=Path,
        default=Path("forkd-sweep.png"),
        metavar="PATH",
        help="PNG written by --sweep (default: %(default)s)",
    )
    p.add_argument(
        "--archive",
        action="store_true",
        help="instead: time `forkd snapshots export` and `import` of the default 256 MiB snapshot "
        "into an empty cache, with the archive's size",
    )
    p.add_argument(
        "--startup",
        action="store_true",
        help="instead: only what the package costs a process that boots no VM: import_ms and "
        "pytest_startup_overhead_ms (pytest --co with the plugin minus with -p no:forkd)",
    )
    p.add_argument(
        "--parts",
        type=_str_list,
        default=list(PARTS),
        metavar="PART[,PART...]",
        help="what to measure (default: all): core (boots, forks, execs, branch table), uffd (live "
        "branch pause at the smallest and largest --memory), diff (pause over --diff-branches "
        "successive branches), memory (PSS of idle children and a parent), speed (guest Python "
        "loop vs host), cpu (QEMU CPU per child by phase, TCG translation, first-command tax), images "
        "(children of a tiny and a large container image, a busybox image's child against the default's), e2b "
        "(E2B's Python SDK through the E2B server against forkd's own fork and exec; needs the e2b extra)",
    )
    p.add_argument(
        "--image-mib",
        type=int,
        default=1024,
        metavar="MIB",
        help="size of the large container image of the images part (default: %(default)s)",
    )
    p.add_argument(
        "--diff-branches",
        type=int,
        default=50,
        metavar="N",
        help="successive diff branches for the diff part (default: %(default)s)",
    )
    p.add_argument("--repeats", type=int, default=5, help="samples per figure (default: %(default)s)")
    p.add_argument("--boots", type=int, default=3, help="cold boots to time (default: %(default)s)")
    p.add_argument("--accel", choices=ACCELS, default="auto")
    p.add_argument(
        "--network",
        choices=MODES,
        default="none",
        help="network of the VMs timed for cold boot, fork and exec (default: %(default)s)",
    )
    p.add_argument(
        "--parallel",
        type=_whole,
        default=20,
        metavar="N",
        help="children of the fork(N) serial-versus-parallel comparison (default: %(default)s; 0 skips)",
    )
    p.add_argument(
        "--overhead-tests",
        type=_whole,
        default=50,
        metavar="N",
        help="tests per group (sleeping 0, 10 and 100 ms) of the per-test fixture overhead measured "
        "through the plugin in a pytest run (default: %(default)s; 0 skips)",
    )
    p.add_argument(
        "--external-suite",
        type=Path,
        default=None,
        metavar="PATH",
        help="also run this test suite (a directory or file of pytest tests from another project) "
        "through the plugin, every test with a forkd_vm, and report its per-test overhead",
    )
    p.add_argument(
        "--external-command",
        default="true",
        metavar="CMD",
        help="shell command each external test runs in its VM before its body (default: %(default)s)",
    )
    p.add_argument(
        "--overhead-only",
        action="store_true",
        help="only forks, the restore breakdown, fork(N) and the per-test overhead through the plugin",
    )
    p.add_argument(
        "--no-prefill",
        dest="prefill",
        action="store_false",
        help="run the overhead suites with the pool alone, without --forkd-pool-prefill (by default a "
        "pooled child is made ready for every test before the first; that wait is reported as "
        "overhead_suite.pool_prefill)",
    )
    p.add_argument(
        "--report",
        type=Path,
        default=None,
        metavar="DIR",
        help="instead: measure the figures that compare hosts (host, accelerator, QEMU, kernel; fork, "
        "pooled fork, restore phases, fork(N), branch pauses, CPU per child, first-command tax, PSS) and "
        "write DIR/forkd-report.json and DIR/forkd-report.md",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="with --report: fewer samples per figure, a few minutes on a 2-core TCG host",
    )
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the JSON to PATH")
    p.set_defaults(run=run)


def _progress(line: str) -> None:
    print(f"forkd bench: {line}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    if args.quick and args.report is None:
        from pytest_forkd.errors import ConfigError

        raise ConfigError("--quick only applies to --report DIR: add --report DIR (e.g. --report forkd-report)")
    if args.report is not None:
        return _report(args)
    if args.startup:
        from pytest_forkd.cli.startup_bench import startup_samples

        result = {name: figure(values) for name, values in startup_samples(args.repeats).items()}
        json_path = args.json
    elif args.archive:
        from pytest_forkd.cli.archive_bench import run_archive_bench

        result = run_archive_bench(args.repeats, args.accel, progress=_progress)
        json_path = args.json
    elif args.sweep:
        plan = BenchPlan(
            memory_mib=args.memory or SWEEP_MEMORY,
            backends=args.backends,
            dirty_mib=args.dirty or [16],
            repeats=args.repeats,
            accel=args.accel,
        )
        result = run_sweep(plan, progress=_progress)
        json_path = args.json or args.plot.with_suffix(".json")
    else:
        if args.external_suite is not None and not args.external_suite.exists():
            from pytest_forkd.errors import ConfigError

            raise ConfigError(
                f"--external-suite {args.external_suite}: no such file or directory; give the "
                "directory (or file) of the tests to run, e.g. an unpacked sdist's tests/"
            )
        plan = BenchPlan(
            memory_mib=args.memory or [256, 1024],
            backends=args.backends,
            dirty_mib=args.dirty if args.dirty is not None else [0, 16, 64],
            repeats=args.repeats,
            boots=args.boots,
            accel=args.accel,
            network=args.network,
            parallel_n=args.parallel,
            overhead_tests=args.overhead_tests,
            external_suite=args.external_suite,
            external_command=args.external_command,
            overhead_only=args.overhead_only,
            prefill=args.prefill,
            parts=args.parts,
            diff_branches=args.diff_branches,
            image_mib=args.image_mib,
        )
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


def _report(args: argparse.Namespace) -> int:
    from pytest_forkd.cli.bench.report import ReportPlan, run_report, write_report

    if args.report.exists() and not args.report.is_dir():
        from pytest_forkd.errors import ConfigError

        raise ConfigError(f"--report {args.report}: not a directory; give a directory to write the report into")
    result = run_report(ReportPlan(quick=args.quick, accel=args.accel), progress=_progress)
    json_path, markdown_path = write_report(args.report, result)
    print(markdown_path.read_text())
    _progress(f"wrote {json_path} and {markdown_path}")
    return 0
