"""What the plugin reports: the header, a failing test's VM and transcripts, the end-of-run tables.

Also what a run leaves behind for later: ``--forkd-transcript`` files,
``--forkd-json``, stored runs and their comparison (``--forkd-save``,
``--forkd-compare``), and the VM of a failing test kept as a snapshot
(``--forkd-keep-failed``). Every table is drawn by
:func:`pytest_forkd.tables.render_table`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Final

import pytest

from pytest_forkd.errors import ForkdError
from pytest_forkd.paths import sanitize_tag
from pytest_forkd.plugin.fixtures import OP_FIXTURE_OVERHEAD, TEST_VM, TEST_VMS
from pytest_forkd.plugin.state import KeptVM, RunState, names_forkd, run_state
from pytest_forkd.tables import render_table

if TYPE_CHECKING:
    from pytest_forkd.core.vm import VM
    from pytest_forkd.engine.host import AccelVerdict
    from pytest_forkd.latency.budgets import Budget, Violation
    from pytest_forkd.latency.compare import Comparison
    from pytest_forkd.latency.timings import Sample
    from pytest_forkd.project.session import ForkdSession
    from pytest_forkd.project.settings import Settings

#: junit XML property (``record_property``) naming a test's transcript file.
TRANSCRIPT_PROPERTY: Final = "forkd_transcript"
TEST_OUTCOME: Final = pytest.StashKey[str]()


# -- the header -----------------------------------------------------------------------------------------------
def pytest_report_header(config: pytest.Config) -> list[str]:
    """Engine, accelerator (with the cached verdict), backend and snapshot (or container image); probes nothing.

    A run that sets nothing of forkd's gets one line instead: looking up the
    engine would cost every such run, and its tests may never ask for a VM.
    """
    state = run_state(config)
    if not state.resolved and not names_forkd(config):
        return ["forkd: default settings, resolved when a test first asks for a VM (-p no:forkd disables the plugin)"]
    from pytest_forkd.engine.host import find_qemu
    from pytest_forkd.errors import HostNotReady

    settings = state.settings
    try:
        qemu = find_qemu()
    except HostNotReady as exc:
        engine = f"unavailable ({exc})"
        accel = settings.describe("accel")
    else:
        engine = f"QEMU {qemu.version} ({qemu.binary})"
        verdict = cached_accel_verdict(settings)
        if verdict is not None:
            accel = f"auto -> {verdict.accel} ({verdict.reason}; cached verdict)"
        elif settings.accel == "auto":
            accel = "auto (KVM is probed on first use)"
        else:
            accel = settings.describe("accel")
    store = str(settings.store) if settings.store else "default persistent store"
    if settings.store:
        from pytest_forkd.storage.store import SnapshotStore

        if SnapshotStore(settings.store, clean=False).read_only_reason() is not None:
            store += " (read-only: restored from copies, never written)"
    project = state.project
    if project.root is not None:
        from pytest_forkd.storage.namespaces import project_id

        store += f", project snapshots under {project_id(project.root)}"
    # Under --forkd-image the session starts from a snapshot of that image (named after it): name the image.
    start = f"image {settings.describe('image')}" if settings.image else f"snapshot {settings.describe('snapshot')}"
    return [
        f"forkd: engine {engine}, accel {accel}",
        f"forkd: {start}, backend {settings.describe('backend')}, "
        f"pool {settings.pool}, store {store}" + (f", config {settings.config}" if settings.config else ""),
    ]


# -- a failing test -------------------------------------------------------------------------------------------
def test_vms(item: pytest.Item) -> list[VM]:
    """The test's forkd_vm and the VMs it forked from checkpoints, if they recorded anything."""
    vm = item.stash.get(TEST_VM, None)
    others = item.stash.get(TEST_VMS, None)
    found = ([vm] if vm is not None else []) + (others.vms() if others is not None else [])
    return [found_vm for found_vm in found if len(found_vm.transcript)]


test_vms.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test


def describe_failure(item: pytest.Item, report: pytest.TestReport, vm: VM) -> None:
    """Add the VM's console tail and every test VM's transcript to a failed report; keep the VM if asked."""
    report.sections.append((f"forkd VM {vm.name}", describe_vm(vm)))
    for test_vm in test_vms(item):
        text = test_vm.transcript.format()
        report.sections.append((f"forkd transcript {test_vm.name}", text))
        add_html_extra(report, f"forkd transcript {test_vm.name}\n{text}")
    state = run_state(item.config)
    if state.settings.keep_failed and state.session is not None:
        report.sections.append(("forkd kept VM", keep_failed_vm(state, item, vm)))


def describe_vm(vm: VM) -> str:
    """The VM's origin and its console tail, for a failure report (its transcript has its own section)."""
    lines = [f"{vm!r}, started from snapshot {vm.origin.tag if vm.origin else '-'}"]
    try:
        console = vm.console_tail()
    except OSError:
        console = ""
    lines += ["console (last lines):", console.rstrip() or "  (empty, or gone with the VM)"]
    return "\n".join(lines)


def transcript_path(item: pytest.Item) -> Path | None:
    directory = item.config.getoption("forkd_transcript", None)
    if not directory:
        return None
    import hashlib

    digest = hashlib.sha256(item.nodeid.encode()).hexdigest()[:8]
    return Path(directory).absolute() / f"{sanitize_tag(item.nodeid)[:60]}-{digest}.jsonl"


def write_transcript(item: pytest.Item) -> Path | None:
    """Write the test's transcript file (--forkd-transcript) and record its path as a user property."""
    path = transcript_path(item)
    vms = test_vms(item) if path is not None else []
    if path is None or not vms:
        return None
    from pytest_forkd.analysis.transcript import write_jsonl

    write_jsonl(path, [vm.transcript for vm in vms], test=item.nodeid, outcome=item.stash.get(TEST_OUTCOME, "passed"))
    item.user_properties.append((TRANSCRIPT_PROPERTY, str(path)))
    return path


def add_html_extra(report: pytest.TestReport, text: str, url: str | None = None) -> None:
    """Attach ``text`` (or a link) to the report for pytest-html, when it is installed."""
    try:
        from pytest_html import extras
    except ImportError:
        return
    extra = extras.url(url, name="forkd transcript") if url else extras.text(text, name="forkd transcript")
    report.extras = [*getattr(report, "extras", []), extra]  # type: ignore[attr-defined]  # read by pytest-html


def keep_failed_vm(state: RunState, item: pytest.Item, vm: VM) -> str:
    """Save a failing test's VM as snapshot ``failed-<test>`` (``--forkd-keep-failed``); say how to open it."""
    from pytest_forkd.project.snapshot_builder import publish_copy

    session = state.session
    assert session is not None
    if vm.closed:
        return f"VM {vm.name} is gone (its guest crashed or it was closed), so there is nothing to keep"
    tag = sanitize_tag(f"failed-{item.name}")
    try:
        with state.recorder.running_test(None):
            staged = vm.branch(backend="full")
            try:
                publish_copy(staged, session.store, tag, extra={"failed_test": item.nodeid})
            finally:
                session.factory.session_store.remove(staged.tag)
    except ForkdError as exc:
        return f"could not save VM {vm.name} as snapshot {tag!r}: {exc}"
    state.kept.append(KeptVM(item.nodeid, tag, str(session.store.root)))
    store_option = (
        f" --store {session.store.root}" if session.store is not session.shared_store or session.settings.store else ""
    )
    return (
        f"saved as snapshot {tag!r} in {session.store.root}; open it with\n"
        f"  forkd shell {tag}{store_option}\n"
        f"  forkd exec --snapshot {tag}{store_option} -- CMD" + _expire_failed(session, keep=tag)
    )


def _expire_failed(session: ForkdSession, keep: str) -> str:
    """Remove the project's kept failures beyond ``keep_failed_count`` or older than ``keep_failed_age``."""
    from pytest_forkd.project.lifecycle import expire_failed

    settings = session.settings
    removals = [
        removal
        for removal in expire_failed(
            session.store, keep=max(1, settings.keep_failed_count), max_age_s=settings.keep_failed_age
        )
        if removal.tag != keep
    ]
    if not removals:
        return ""
    return "\nexpired: " + "; ".join(f"{removal.tag} ({removal.reason})" for removal in removals)


# -- the end of the run ---------------------------------------------------------------------------------------
def store_and_compare(config: pytest.Config, state: RunState, budgets: list[Budget]) -> bool:
    """Write --forkd-json, compare with and save to the benchmark storage; True on a regression."""
    from pytest_forkd.latency.compare import compare_with_baseline
    from pytest_forkd.latency.runs import build_run, write_run

    root = Path(config.rootpath)
    settings = state.settings
    verdict = cached_accel_verdict(settings)
    conditions = {
        "accel": verdict.accel if verdict else settings.accel,
        "backend": settings.backend,
        "snapshot": settings.snapshot,
        "pool": settings.pool,
    }
    recipes = {event["snapshot"]: event.get("recipe_hash") for event in state.build_events}
    document = build_run(
        state.recorder, root=root, conditions=conditions, qemu_version=_qemu_version(), snapshots=recipes
    )
    options = config.option
    if options.forkd_compare is not None:
        from pytest_forkd.errors import IncomparableRuns

        try:
            state.comparison = compare_with_baseline(
                root, document, state.thresholds, options.forkd_compare or None, strict=options.forkd_compare_strict
            )
        except IncomparableRuns as exc:
            state.comparison_refused = str(exc)
    if options.forkd_save is not None or options.forkd_autosave:
        state.saved_run = write_run(root, document, options.forkd_save or None)
    if options.forkd_json:
        output = dict(document)
        output["budgets"] = [vars(budget) for budget in budgets]
        output["build_samples"] = [sample.to_dict() for sample in state.recorder.build_samples()]
        output["builds"] = state.build_events
        output["violations"] = [
            {
                "test": violation.budget.test,
                "op": violation.budget.op,
                "stat": violation.budget.stat,
                "backend": violation.budget.backend,
                "measured_ms": violation.measured_ms,
                "budget_ms": violation.budget.limit_ms,
                "n": violation.n,
                "source": violation.budget.source,
            }
            for violation in state.violations
        ]
        Path(options.forkd_json).write_text(json.dumps(output, indent=2) + "\n", encoding="utf-8")
    return bool(state.comparison and state.comparison.regressions) or state.comparison_refused is not None


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    state = run_state(config)
    samples = state.recorder.samples()
    if not samples and not state.build_events:
        _report_written(terminalreporter, state)
        return
    from pytest_forkd.latency.stats import summarize

    write = terminalreporter.write_line
    terminalreporter.write_sep("-", "forkd")
    for event in state.build_events:
        where = f" [{event['worker']}]" if event["worker"] != "main" else ""
        if event["action"] == "built":
            write(f"snapshot {event['snapshot']!r}: built in {event['seconds']:.1f} s{where}")
        else:
            write(f"snapshot {event['snapshot']!r}: cached{where}")
    builds = built_seconds(state)
    if samples or builds:
        write(operations_table(samples, run_budgets(state), state.comparison, builds=builds))
    for prefill in state.prefills:
        write(
            f"pool prefill: {prefill['children']} children of {prefill['snapshot']!r} ready in "
            f"{prefill['seconds']:.1f} s before the first test (session cost, not in fixture_overhead)"
        )
    overhead = [sample.ms for sample in samples if sample.op == OP_FIXTURE_OVERHEAD]
    if overhead:
        summary = summarize(overhead)
        write(
            f"fixture_overhead_ms per test (forkd_vm setup + teardown): p50 {summary.p50:.1f}, "
            f"p95 {summary.p95:.1f}, max {summary.max:.1f} (n={summary.n})"
        )
    if state.cpu_bound is not None:  # the run started VMs: was the host's CPU the limit, or idle cores?
        write(state.cpu_bound.line())
    for kept in state.kept:
        write(f"kept failed VM of {kept.test} as snapshot {kept.tag!r}: forkd shell {kept.tag} --store {kept.store}")
    if state.comparison is not None:
        write(state.comparison.format_table())
        for warning in state.comparison.warnings:
            write(f"warning: {warning}", yellow=True)
    if state.comparison_refused is not None:
        write(f"--forkd-compare-strict: {state.comparison_refused} (exit status 1)", red=True, bold=True)
    if state.saved_run is not None:
        write(f"saved timings to {state.saved_run}")
    if state.violations:
        write("latency budget violations (exit status 1):", red=True, bold=True)
        write(violations_table(state.violations), red=True)
    _report_written(terminalreporter, state)


def _report_written(terminalreporter: pytest.TerminalReporter, state: RunState) -> None:
    """Where ``--forkd-report`` wrote the HTML report, or why it could not."""
    if state.report is not None:
        terminalreporter.write_line(f"forkd: HTML report written to {state.report}")
    if state.report_error is not None:
        terminalreporter.write_line(f"forkd: {state.report_error} (exit status 1)", red=True, bold=True)


#: Row of the summary table for snapshot builds (never budgeted, never compared).
BUILD_ROW: Final = "snapshot build"


def run_budgets(state: RunState) -> list[Budget]:
    """Every budget of the run: forkd.yaml's and the command line's (suite-wide), and the markers' (per test)."""
    from pytest_forkd.latency.budgets import resolve

    return resolve(state.project.budgets, state.cli_budgets, state.marker_budgets)


def built_seconds(state: RunState) -> list[float]:
    """How long each snapshot this run built took (by every xdist worker); cached ones cost nothing."""
    return [float(event["seconds"]) for event in state.build_events if event["action"] == "built"]


def operations_table(
    samples: list[Sample],
    budgets: list[Budget],
    comparison: Comparison | None,
    *,
    builds: list[float] | None = None,
) -> str:
    """Per operation: n, p50, p95, max, budgets, p95 delta against the compared run; builds in their own row.

    ``budgets`` holds suite-wide budgets and per-test ones (a marker's, with
    its ``test`` set): the budget column shows both, so a test's marker
    shows up in its operation's row. ``builds`` are the seconds each snapshot
    build took: one row, never budgeted nor compared (see
    :meth:`pytest_forkd.latency.timings.Recorder.building`).
    """
    from pytest_forkd.latency.budgets import describe_budgets
    from pytest_forkd.latency.stats import summarize
    from pytest_forkd.latency.timings import KNOWN_OPS

    by_op: dict[str, list[float]] = {}
    for sample in samples:
        by_op.setdefault(sample.op, []).append(sample.ms)
    deltas: dict[str, str] = {}
    if comparison is not None:
        for row in comparison.rows:
            if row.test is None and row.old is not None and row.new is not None:
                deltas[row.op] = f"{row.new.p95 - row.old.p95:+.1f} ms"
    rows = []
    for op in sorted(by_op, key=lambda op: (KNOWN_OPS.index(op) if op in KNOWN_OPS else len(KNOWN_OPS), op)):
        summary = summarize(by_op[op])
        rows.append(
            (
                op,
                summary.n,
                f"{summary.p50:.1f}",
                f"{summary.p95:.1f}",
                f"{summary.max:.1f}",
                describe_budgets(op, budgets),
                deltas.get(op, "-"),
            )
        )
    if builds:
        summary = summarize([seconds * 1000 for seconds in builds])
        rows.append(
            (
                BUILD_ROW,
                summary.n,
                f"{summary.p50:.1f}",
                f"{summary.p95:.1f}",
                f"{summary.max:.1f}",
                "not budgeted",
                "-",
            )
        )
    return render_table(rows, ("operation", "n", "p50 ms", "p95 ms", "max ms", "budget", "delta p95"))


def violations_table(violations: list[Violation]) -> str:
    """One line per violated budget: scope, operation, statistic, measured and allowed figure, source."""
    rows = [
        (
            violation.scope,
            violation.budget.op + (f"[{violation.budget.backend}]" if violation.budget.backend else ""),
            violation.budget.stat,
            f"{violation.measured_ms:.2f}",
            f"{violation.budget.limit_ms:g}",
            f"({violation.budget.source})",
        )
        for violation in violations
    ]
    return render_table(rows, ("test", "op", "stat", "measured ms", "budget ms", "source"), right=(3, 4), indent="  ")


def cached_accel_verdict(settings: Settings) -> AccelVerdict | None:
    """The host's recorded verdict for ``--forkd-accel=auto`` (None: not probed yet, or not auto)."""
    if settings.accel != "auto":
        return None
    from pytest_forkd.engine.host import cached_verdict, find_qemu
    from pytest_forkd.errors import HostNotReady

    try:
        return cached_verdict(find_qemu())
    except HostNotReady:
        return None


def _qemu_version() -> str | None:
    from pytest_forkd.engine.host import find_qemu
    from pytest_forkd.errors import HostNotReady

    try:
        return find_qemu().version
    except HostNotReady:
        return None
