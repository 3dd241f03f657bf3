"""The plugin's command-line options, ini keys and markers, and resolving them into a run's settings.

Registering options is on every pytest start-up path, so this module
imports only what the option table needs; :func:`resolve_run` loads
forkd.yaml, the settings and the budgets when the run first needs them
(see :mod:`pytest_forkd.plugin.state`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Final

import pytest

from pytest_forkd.project import settings as forkd_settings

if TYPE_CHECKING:
    from pytest_forkd.errors import ForkdError
    from pytest_forkd.latency.budgets import Budget
    from pytest_forkd.latency.compare import Threshold
    from pytest_forkd.project.config import Project
    from pytest_forkd.project.settings import Settings


@dataclass(frozen=True)
class Resolved:
    """The run's settings, project and budgets, resolved from every place they can be set."""

    settings: Settings
    project: Project
    cli_budgets: list[Budget]
    thresholds: list[Threshold]


DANGEROUS_MARKER_HELP: Final = (
    "forkd_dangerous: checkpoint the test's forkd_vm right before the test body (fixture "
    "forkd_dangerous_checkpoint), so the test can roll back what it destroys"
)


@dataclass(frozen=True)
class HelpGroup:
    """One group of ``pytest --help``: the forkd options that serve one purpose."""

    name: str
    heading: str


#: The forkd groups of ``pytest --help``, in the order shown. A new option goes in the group of its
#: purpose through :func:`vms_group`, :func:`timings_group` or :func:`reports_group`.
VMS: Final = HelpGroup("forkd", "pytest-forkd: VMs and snapshots")
TIMINGS: Final = HelpGroup("forkd-timings", "pytest-forkd: timings, budgets and baselines")
REPORTS: Final = HelpGroup("forkd-reports", "pytest-forkd: reports")
HELP_GROUPS: Final = (VMS, TIMINGS, REPORTS)


def help_group(parser: pytest.Parser, group: HelpGroup) -> pytest.OptionGroup:
    """``group`` of ``parser``, made on first use right after the forkd group before it (made first if need be)."""
    index = HELP_GROUPS.index(group)
    if not index:
        return parser.getgroup(group.name, group.heading)
    help_group(parser, HELP_GROUPS[index - 1])
    return parser.getgroup(group.name, group.heading, after=HELP_GROUPS[index - 1].name)


def vms_group(parser: pytest.Parser) -> pytest.OptionGroup:
    """Options that choose what the tests' VMs are made from and where their snapshots are kept."""
    return help_group(parser, VMS)


def timings_group(parser: pytest.Parser) -> pytest.OptionGroup:
    """Options about the run's timings: budgets, stored runs and comparisons with them."""
    return help_group(parser, TIMINGS)


def reports_group(parser: pytest.Parser) -> pytest.OptionGroup:
    """Options that write what happened in the run to files (JSON, HTML, transcripts)."""
    return help_group(parser, REPORTS)


def pytest_addoption(parser: pytest.Parser) -> None:
    forkd_settings.add_options(vms_group(parser), parser)
    from pytest_forkd.isolate import options as isolate_options  # its own module: the plugin's import stays small

    isolate_options.add_options(vms_group(parser), parser)
    _add_timing_options(timings_group(parser))
    _add_report_options(reports_group(parser))


def _add_timing_options(group: pytest.OptionGroup) -> None:
    group.addoption(
        "--forkd-budget",
        action="append",
        default=[],
        metavar="OP.STAT=VALUE",
        help="latency budget for the whole run, e.g. fork.p95=300 or branch_pause.max=50ms "
        "(repeatable; overrides forkd.yaml budgets)",
    )
    group.addoption(
        "--forkd-save",
        nargs="?",
        const="",
        default=None,
        metavar="NAME",
        help="store this run's timings under .forkd/benchmarks/ in the rootdir "
        "(NAME defaults to the short commit id); write --forkd-save=NAME",
    )
    group.addoption(
        "--forkd-autosave",
        action="store_true",
        default=False,
        help="store this run's timings like --forkd-save, named after the commit",
    )
    group.addoption(
        "--forkd-compare",
        nargs="?",
        const="",
        default=None,
        metavar="ID",
        help="compare timings with a stored run (default: the latest; ID is a counter, "
        "name, file, or a directory of shard runs merged into one); write --forkd-compare=ID",
    )
    group.addoption(
        "--forkd-compare-fail",
        action="append",
        default=[],
        metavar="EXPR",
        help="fail the run on a significant regression against the compared run, e.g. p95:20%% or p50:5ms (repeatable)",
    )
    group.addoption(
        "--forkd-compare-strict",
        action="store_true",
        default=False,
        help="refuse (exit status 1) to compare with a run of a different machine, accelerator, "
        "backend or QEMU version, instead of warning",
    )


def _add_report_options(group: pytest.OptionGroup) -> None:
    group.addoption(
        "--forkd-json",
        metavar="PATH",
        default=None,
        help="write every timing sample, the summaries and budget results to PATH as JSON",
    )
    group.addoption(
        "--forkd-report",
        metavar="PATH",
        default=None,
        help="write an HTML report of the run to PATH: latency table, a histogram per operation with its "
        "budgets, the comparison with a baseline (--forkd-compare), the slowest tests (self-contained, one file)",
    )
    group.addoption(
        "--forkd-transcript",
        metavar="DIR",
        default=None,
        help="write the transcript of every test's VMs (each exec, file operation, snapshot and "
        "restore) to DIR/<test>.jsonl; replay one with `forkd bisect FILE --check CMD`",
    )


def add_markers(config: pytest.Config) -> None:
    """Declare the forkd markers (so ``--strict-markers`` knows them)."""
    from pytest_forkd.isolate.options import MARKER_HELP as ISOLATE_MARKER_HELP
    from pytest_forkd.latency.budgets import MARKER_HELP as BUDGET_MARKER_HELP

    config.addinivalue_line("markers", forkd_settings.MARKER_HELP)
    config.addinivalue_line("markers", DANGEROUS_MARKER_HELP)
    config.addinivalue_line("markers", BUDGET_MARKER_HELP)
    config.addinivalue_line("markers", ISOLATE_MARKER_HELP)


def resolve_run(config: pytest.Config, *, backends: Callable[[], list[str]]) -> Resolved:
    """Read forkd.yaml and resolve the run's settings and budgets; raises ForkdError on a bad value.

    ``backends`` lists the storage backend ids a setting may name (asked only when one is named).
    """
    from pytest_forkd.errors import ConfigProblems
    from pytest_forkd.latency.budgets import budgets_from_cli
    from pytest_forkd.project.config import EMPTY_PROJECT, load_project

    config_file, config_source = forkd_settings.project_file(config)
    problems = ConfigProblems()  # forkd.yaml's mistakes and the options' are reported together
    project = problems.attempt(lambda: load_project(config_file), EMPTY_PROJECT) if config_file else EMPTY_PROJECT
    cli_budgets: list[Budget] = problems.attempt(lambda: budgets_from_cli(config.getoption("forkd_budget")), [])
    thresholds: list[Threshold] = problems.attempt(
        lambda: _compare_fail_thresholds(config.getoption("forkd_compare_fail")), []
    )
    problems.raise_all()
    mirror = project.settings.get("debian_mirror")
    if mirror is not None or "pytest_forkd.image.mirror" in sys.modules:  # else nothing to set or forget
        from pytest_forkd.image.mirror import use_project_mirror

        use_project_mirror(mirror, f"{project.origin} settings.debian_mirror")
    settings = forkd_settings.from_pytest_config(
        config,
        project.settings,
        config_file=config_file,
        config_source=config_source,
        backends=backends,
    )
    check_snapshots(settings, project, [settings.snapshot])
    return Resolved(settings=settings, project=project, cli_budgets=cli_budgets, thresholds=thresholds)


def usage_error(exc: ForkdError) -> pytest.UsageError:
    """``exc`` as pytest's usage error: one ``ERROR:`` line per line of it (a file's mistakes, one each)."""
    return pytest.UsageError(*(str(exc).splitlines() or [type(exc).__name__]))


def check_snapshots(settings: Settings, project: Project, names: list[str]) -> None:
    """Fail (ConfigError) when a snapshot the run uses is unknown, or starts from an image that is missing.

    A snapshot is known when forkd.yaml declares it (or it is ``base``) or the
    store holds it (a kept failed test's VM, an imported one). Checked before
    any test runs, so the mistake is one usage error rather than the same
    error in every test's setup.
    """
    from pytest_forkd.project.snapshot_builder import check_images, unknown_snapshot_error

    declared = project.snapshot_names()
    check_images(project, [name for name in names if name in declared])
    undeclared = [name for name in names if name not in declared]
    if undeclared:
        from pytest_forkd.project.session import open_stores

        shared, store = open_stores(settings, project)
        for name in undeclared:
            if not store.exists(name) and not shared.exists(name):
                raise unknown_snapshot_error(name, project, store)


def _compare_fail_thresholds(expressions: list[str]) -> list[Threshold]:
    if not expressions:
        return []
    from pytest_forkd.latency.compare import parse_compare_fail

    return [parse_compare_fail(text) for text in expressions]
