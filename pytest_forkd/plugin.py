"""pytest plugin: real microVMs per test at fork() speed (``-p no:forkd`` disables it).

Fixtures
    ``forkd`` (session)
        the :class:`~pytest_forkd.session.ForkdSession`: factory, store,
        ``snapshot`` (the parent's current state), ``parent``, ``timings``,
        ``fork(n)``, ``snapshot_for(name)``.
    ``forkd_parent`` (session; one per xdist worker)
        the warm parent VM, restored from the selected snapshot. Prepare it in
        a session fixture (``forkd_parent.exec(...)``): every later child
        starts from its state.
    ``forkd_vm`` (function)
        a fresh copy-on-write child of the parent's current state (or of the
        snapshot the test's ``forkd`` marker names), killed after the test.
    ``forkd_checkpoint`` (function)
        ``forkd_checkpoint(vm)`` returns ``vm.checkpoint()``: a context manager
        that rolls back on exit unless ``.keep()``; ``.rollback()``,
        ``.fork(n)``. Children forked from it are killed after the test.
    ``forkd_dangerous_checkpoint`` (function)
        for tests marked ``forkd_dangerous``: the checkpoint of ``forkd_vm``
        taken when this fixture is set up (without the fixture it is taken
        right before the test body, and found in
        ``request.node.stash[pytest_forkd.plugin.DANGEROUS_CHECKPOINT]``).

Markers
    ``forkd(snapshot=None, backend=None, memory_mib=None)``, ``forkd_dangerous``,
    ``forkd_budget(fork_ms=..., exec_ms=..., ...)``.

Settings precedence: marker > command line > ``PYTEST_FORKD_*`` > ini
``forkd_*`` > forkd.yaml ``settings:`` > default (see
:mod:`pytest_forkd.settings`). A failing test's report gets a section with its
VM's last commands and console tail; ``--forkd-keep-failed`` saves the VM as
snapshot ``failed-<test>``.

Latency: every VM operation is timed and attributed to the running test.
Budgets (``--forkd-budget``, forkd.yaml ``budgets:``, ``forkd_budget``) are
checked when the run ends; a violation, like a regression found by
``--forkd-compare-fail``, makes the exit status 1
(``pytest.ExitCode.TESTS_FAILED``) and is listed in the terminal summary.

Nothing boots and nothing is probed until a test uses a forkd fixture.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import pytest

from . import settings as forkd_settings
from . import timings
from .budgets import MARKER_HELP as BUDGET_MARKER_HELP
from .budgets import Budget, Violation, budget_from_cli, budgets_from_marker
from .errors import ForkdError
from .paths import sanitize_tag
from .project import EMPTY_PROJECT, Project, load_project
from .settings import Settings, VMChoice
from .stats import summarize
from .timings import Recorder

if TYPE_CHECKING:
    from .baseline import Comparison, Threshold
    from .checkpoint import Checkpoint
    from .engine.accel import AccelVerdict
    from .session import ForkdSession
    from .snapshot import Snapshot
    from .vm import VM

#: Operation name of the per-test cost of the ``forkd_vm`` fixture (setup + teardown).
OP_FIXTURE_OVERHEAD: Final = "fixture_overhead"
#: Where a ``forkd_dangerous`` test's checkpoint is kept: ``request.node.stash[DANGEROUS_CHECKPOINT]``.
DANGEROUS_CHECKPOINT: Final = pytest.StashKey["Checkpoint"]()
DANGEROUS_MARKER_HELP: Final = (
    "forkd_dangerous: checkpoint the test's forkd_vm right before the test body (fixture "
    "forkd_dangerous_checkpoint), so the test can roll back what it destroys"
)
_WORKER_OUTPUT_KEY: Final = "forkd"


@dataclass(frozen=True)
class KeptVM:
    """A failing test's VM saved as a snapshot (``--forkd-keep-failed``)."""

    test: str
    tag: str
    store: str


@dataclass
class _RunState:
    """Everything the plugin keeps for one pytest run, in ``config.stash``."""

    settings: Settings
    project: Project
    recorder: Recorder
    previous_recorder: Recorder
    cli_budgets: list[Budget]
    thresholds: list[Threshold]
    marker_budgets: list[Budget] = field(default_factory=list)
    build_events: list[dict[str, Any]] = field(default_factory=list)
    kept: list[KeptVM] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    comparison: Comparison | None = None
    saved_run: Path | None = None
    session: ForkdSession | None = None
    worker_died: bool = False
    """An xdist worker crashed: its QEMUs died with it (PDEATHSIG), its run directory is removed at the end."""

    def open_session(self, progress: Callable[[str], None]) -> ForkdSession:
        if self.session is None:
            from .session import ForkdSession

            self.session = ForkdSession(self.settings, self.project, recorder=self.recorder, progress=progress)
        return self.session

    def close_session(self, worker: str) -> None:
        session, self.session = self.session, None
        if session is None:
            return
        self.build_events += [
            {"snapshot": event.snapshot, "action": event.action, "seconds": event.seconds, "worker": worker}
            for event in session.build_events
        ]
        session.close()


_STATE: Final = pytest.StashKey[_RunState]()
_CHOICE: Final = pytest.StashKey[VMChoice]()
_TEST_VM: Final = pytest.StashKey["VM"]()
_TEST_VMS: Final = pytest.StashKey["_TestVMs"]()


# -- options and configuration ------------------------------------------------------------------------------
def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("forkd", "pytest-forkd: microVM fixtures")
    forkd_settings.add_options(group, parser)
    group.addoption("--forkd-budget", action="append", default=[], metavar="OP.STAT=VALUE",
                    help="latency budget for the whole run, e.g. fork.p95=300 or branch_pause.max=50ms "
                         "(repeatable; overrides forkd.yaml budgets)")
    group.addoption("--forkd-json", metavar="PATH", default=None,
                    help="write every timing sample, the summaries and budget results to PATH as JSON")
    group.addoption("--forkd-save", nargs="?", const="", default=None, metavar="NAME",
                    help="store this run's timings under .forkd/benchmarks/ in the rootdir "
                         "(NAME defaults to the short commit id); write --forkd-save=NAME")
    group.addoption("--forkd-autosave", action="store_true", default=False,
                    help="store this run's timings like --forkd-save, named after the commit")
    group.addoption("--forkd-compare", nargs="?", const="", default=None, metavar="ID",
                    help="compare timings with a stored run (default: the latest; ID is a counter, "
                         "name or file); write --forkd-compare=ID")
    group.addoption("--forkd-compare-fail", action="append", default=[], metavar="EXPR",
                    help="fail the run on a significant regression against the compared run, "
                         "e.g. p95:20%% or p50:5ms (repeatable)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", forkd_settings.MARKER_HELP)
    config.addinivalue_line("markers", DANGEROUS_MARKER_HELP)
    config.addinivalue_line("markers", BUDGET_MARKER_HELP)
    try:
        state = _configure(config)
    except ForkdError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.stash[_STATE] = state
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_XdistHooks(state), "forkd-xdist")


def _configure(config: pytest.Config) -> _RunState:
    from .backend import registry

    config_file, config_source = forkd_settings.project_file(config)
    project = load_project(config_file) if config_file else EMPTY_PROJECT
    settings = forkd_settings.from_pytest_config(
        config, project.settings, config_file=config_file, config_source=config_source,
        backends=lambda: registry().ids(),
    )
    if settings.snapshot not in project.snapshot_names():
        from .snapshot_builder import unknown_snapshot_error
        from .store import SnapshotStore

        store = SnapshotStore(settings.store) if settings.store else SnapshotStore.persistent()
        if not store.exists(settings.snapshot):
            raise unknown_snapshot_error(settings.snapshot, project, store)
    recorder = Recorder()
    return _RunState(
        settings=settings,
        project=project,
        recorder=recorder,
        previous_recorder=timings.set_active_recorder(recorder),
        cli_budgets=[budget_from_cli(text) for text in config.getoption("forkd_budget")],
        thresholds=_compare_fail_thresholds(config.getoption("forkd_compare_fail")),
    )


def _compare_fail_thresholds(expressions: list[str]) -> list[Threshold]:
    if not expressions:
        return []
    from .baseline import parse_compare_fail

    return [parse_compare_fail(text) for text in expressions]


def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(_STATE, None)
    if state is None:
        return
    state.close_session(_worker_id(config))
    timings.set_active_recorder(state.previous_recorder)
    if state.worker_died:  # by now xdist has reaped the dead worker, so its run directory counts as stale
        from .engine.rundir import clean_stale

        clean_stale()


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Engine, accelerator (with the cached verdict), backend and snapshot; probes nothing."""
    from .engine.host import find_qemu
    from .errors import HostNotReady

    settings = config.stash[_STATE].settings
    try:
        qemu = find_qemu()
    except HostNotReady as exc:
        engine = f"unavailable ({exc})"
        accel = settings.describe("accel")
    else:
        engine = f"QEMU {qemu.version} ({qemu.binary})"
        verdict = _cached_accel_verdict(settings)
        if verdict is not None:
            accel = f"auto -> {verdict.accel} ({verdict.reason}; cached verdict)"
        elif settings.accel == "auto":
            accel = "auto (KVM is probed on first use)"
        else:
            accel = settings.describe("accel")
    store = str(settings.store) if settings.store else "default persistent store"
    return [
        f"forkd: engine {engine}, accel {accel}",
        f"forkd: snapshot {settings.describe('snapshot')}, backend {settings.describe('backend')}, "
        f"pool {settings.pool}, store {store}"
        + (f", config {settings.config}" if settings.config else ""),
    ]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Validate the forkd markers up front, so a typo fails the run before any VM starts."""
    state = config.stash[_STATE]
    backends: list[str] | None = None
    try:
        for item in items:
            budget_marker = item.get_closest_marker("forkd_budget")
            if budget_marker is not None:
                state.marker_budgets += budgets_from_marker(item.nodeid, budget_marker.args, budget_marker.kwargs)
            marker = item.get_closest_marker("forkd")
            if marker is not None:
                if backends is None:
                    from .backend import registry

                    backends = registry().ids()
                item.stash[_CHOICE] = forkd_settings.choose_vm(
                    state.settings, marker.args, marker.kwargs, backends=backends, test=item.nodeid
                )
    except ForkdError as exc:
        raise pytest.UsageError(str(exc)) from None


# -- fixtures -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def forkd(pytestconfig: pytest.Config) -> Iterator[ForkdSession]:
    """The forkd session: factory, store, parent, current snapshot, timings."""
    state = pytestconfig.stash[_STATE]
    yield state.open_session(_progress_printer(pytestconfig))
    state.close_session(_worker_id(pytestconfig))


@pytest.fixture(scope="session")
def forkd_parent(forkd: ForkdSession) -> VM:
    """The warm parent VM of this session (of this xdist worker); children fork from its state."""
    return forkd.parent


class _TestVMs:
    """The VMs a test started besides its forkd_vm (children of checkpoints); killed after the test.

    Acts as the owner of the checkpoint snapshots handed to the test, so
    ``checkpoint.fork(n)`` starts children through it.
    """

    def __init__(self, session: ForkdSession) -> None:
        self._session = session
        self._vms: list[VM] = []

    def fork_snapshot(self, snapshot: Snapshot, n: int) -> list[VM]:
        children = self._session.factory.fork_snapshot(snapshot, n)
        self._vms += children
        return children

    def checkpoint(self, vm: VM, tag: str | None = None, *, backend: str | None = None) -> Checkpoint:
        """``vm.checkpoint()``, with the children forked from it started (and later killed) here."""
        checkpoint = vm.checkpoint(tag, backend=backend)
        checkpoint.snapshot = checkpoint.snapshot.with_owner(self)
        return checkpoint

    def close(self) -> None:
        for vm in self._vms:
            vm.close()
        self._vms.clear()


def _choice(item: pytest.Item, settings: Settings) -> VMChoice:
    """The test's VM choice: its validated ``forkd`` marker, else the run's settings."""
    return item.stash.get(_CHOICE, None) or VMChoice(settings.snapshot, settings.backend)


@pytest.fixture
def _forkd_test_vms(forkd: ForkdSession, request: pytest.FixtureRequest) -> Iterator[_TestVMs]:
    test_vms = request.node.stash[_TEST_VMS] = _TestVMs(forkd)
    yield test_vms
    test_vms.close()


@pytest.fixture
def forkd_vm(forkd: ForkdSession, request: pytest.FixtureRequest, _forkd_test_vms: _TestVMs) -> Iterator[VM]:
    """A fresh copy-on-write child VM for this test, killed afterwards.

    While the test runs, branches and checkpoints taken without naming a
    backend use the test's backend (its ``forkd`` marker, else the run's).
    """
    item = request.node
    choice = _choice(item, forkd.settings)
    build_seconds = forkd.build_seconds
    started = time.perf_counter()
    vm = forkd.child(choice)
    factory = forkd.factory
    previous_backend, factory.default_backend = factory.default_backend, choice.backend
    item.stash[_TEST_VM] = vm
    setup_ms = (time.perf_counter() - started - (forkd.build_seconds - build_seconds)) * 1000
    try:
        yield vm
    finally:
        factory.default_backend = previous_backend
        teardown_started = time.perf_counter()
        vm.close()
        teardown_ms = (time.perf_counter() - teardown_started) * 1000
        forkd.timings.record(OP_FIXTURE_OVERHEAD, setup_ms + teardown_ms, memory_mib=vm.memory_mib,
                             extra={"setup_ms": round(setup_ms, 3), "teardown_ms": round(teardown_ms, 3)})


@pytest.fixture
def forkd_checkpoint(forkd: ForkdSession, _forkd_test_vms: _TestVMs, request: pytest.FixtureRequest
                     ) -> Callable[..., Checkpoint]:
    """``forkd_checkpoint(vm, tag=None)``: ``vm.checkpoint()`` whose forked children die with the test."""
    backend = _choice(request.node, forkd.settings).backend

    def take(vm: VM, tag: str | None = None) -> Checkpoint:
        return _forkd_test_vms.checkpoint(vm, tag, backend=backend)

    return take


@pytest.fixture
def forkd_dangerous_checkpoint(forkd_checkpoint: Callable[..., Checkpoint], forkd_vm: VM,
                               request: pytest.FixtureRequest) -> Checkpoint:
    """The checkpoint of forkd_vm of a ``forkd_dangerous`` test, taken now."""
    if request.node.get_closest_marker("forkd_dangerous") is None:
        pytest.fail("forkd_dangerous_checkpoint is for tests marked @pytest.mark.forkd_dangerous; "
                    "mark the test, or take a checkpoint yourself with forkd_checkpoint(forkd_vm)", pytrace=False)
    checkpoint = request.node.stash[DANGEROUS_CHECKPOINT] = forkd_checkpoint(forkd_vm)
    return checkpoint


# -- per-test hooks -----------------------------------------------------------------------------------------
@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """Attribute every timing sample taken while the test runs (setup to teardown) to it."""
    with item.config.stash[_STATE].recorder.running_test(item.nodeid):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    """Checkpoint a ``forkd_dangerous`` test's VM right before its body, unless its fixture did."""
    if item.get_closest_marker("forkd_dangerous") is not None and DANGEROUS_CHECKPOINT not in item.stash:
        vm = item.stash.get(_TEST_VM, None)
        if vm is None:
            pytest.fail("@pytest.mark.forkd_dangerous checkpoints the test's VM: the test must use the forkd_vm "
                        "fixture", pytrace=False)
        backend = _choice(item, item.config.stash[_STATE].settings).backend
        item.stash[DANGEROUS_CHECKPOINT] = item.stash[_TEST_VMS].checkpoint(vm, backend=backend)
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    """Add the VM's last commands and console to a failing test's report; keep its VM if asked."""
    report: pytest.TestReport = yield
    vm = item.stash.get(_TEST_VM, None)
    if vm is None or not report.failed or report.when not in ("setup", "call"):
        return report
    report.sections.append((f"forkd VM {vm.name}", _describe_vm(vm)))
    state = item.config.stash[_STATE]
    if state.settings.keep_failed and state.session is not None:
        report.sections.append(("forkd kept VM", _keep_failed_vm(state, item, vm)))
    return report


def _describe_vm(vm: VM) -> str:
    """The VM's last commands (exit code, ms) and its console tail, for a failure report."""
    lines = [f"{vm!r}, started from snapshot {vm.origin.tag if vm.origin else '-'}", "last commands (oldest first):"]
    for entry in vm.history:
        command = entry["command"] if isinstance(entry["command"], str) else " ".join(entry["command"])
        if entry.get("timed_out"):
            outcome = "timed out"
        elif "exit_code" in entry:
            outcome = f"exit {entry['exit_code']}"
        else:
            outcome = "no answer"
        lines.append(f"  {outcome:>10}  {entry.get('ms', 0):9.1f} ms  {command}")
    if not vm.history:
        lines.append("  (none)")
    try:
        console = vm.console_tail()
    except OSError:
        console = ""
    lines += ["console (last lines):", console.rstrip() or "  (empty, or gone with the VM)"]
    return "\n".join(lines)


def _keep_failed_vm(state: _RunState, item: pytest.Item, vm: VM) -> str:
    from .snapshot_builder import publish_copy

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
    store_option = f" --store {session.store.root}" if session.settings.store else ""
    return (
        f"saved as snapshot {tag!r} in {session.store.root}; open it with\n"
        f"  forkd shell {tag}{store_option}\n"
        f"  forkd exec --snapshot {tag}{store_option} -- CMD"
    )


# -- end of the run: budgets, baselines, summary --------------------------------------------------------------
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    state = config.stash[_STATE]
    state.close_session(_worker_id(config))
    if hasattr(config, "workerinput"):
        config.workeroutput[_WORKER_OUTPUT_KEY] = json.dumps({
            "samples": state.recorder.to_json(),
            "marker_budgets": [vars(budget) for budget in state.marker_budgets],
            "build_events": state.build_events,
            "kept": [vars(kept) for kept in state.kept],
        })
        return
    samples = state.recorder.samples()
    if not samples:
        return
    from .budgets import check, resolve

    budgets = resolve(state.project.budgets, state.cli_budgets, state.marker_budgets)
    state.violations = check(budgets, samples)
    failed = bool(state.violations)
    options = config.option
    if options.forkd_json or options.forkd_save is not None or options.forkd_autosave or \
            options.forkd_compare is not None:
        failed |= _store_and_compare(config, state, budgets)
    if failed and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _store_and_compare(config: pytest.Config, state: _RunState, budgets: list[Budget]) -> bool:
    """Write --forkd-json, compare with and save to the benchmark storage; True on a regression."""
    from .baseline import build_run, compare_with_baseline, write_run

    root = Path(config.rootpath)
    settings = state.settings
    verdict = _cached_accel_verdict(settings)
    conditions = {"accel": verdict.accel if verdict else settings.accel, "backend": settings.backend,
                  "snapshot": settings.snapshot, "pool": settings.pool}
    document = build_run(state.recorder, root=root, conditions=conditions, qemu_version=_qemu_version())
    options = config.option
    if options.forkd_compare is not None:
        state.comparison = compare_with_baseline(root, document, state.thresholds, options.forkd_compare or None)
    if options.forkd_save is not None or options.forkd_autosave:
        state.saved_run = write_run(root, document, options.forkd_save or None)
    if options.forkd_json:
        output = dict(document)
        output["budgets"] = [vars(budget) for budget in budgets]
        output["violations"] = [
            {"test": violation.budget.test, "op": violation.budget.op, "stat": violation.budget.stat,
             "backend": violation.budget.backend, "measured_ms": violation.measured_ms,
             "budget_ms": violation.budget.limit_ms, "n": violation.n, "source": violation.budget.source}
            for violation in state.violations
        ]
        Path(options.forkd_json).write_text(json.dumps(output, indent=2) + "\n", encoding="utf-8")
    return bool(state.comparison and state.comparison.regressions)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int,
                            config: pytest.Config) -> None:
    state = config.stash[_STATE]
    samples = state.recorder.samples()
    if not samples and not state.build_events:
        return
    write = terminalreporter.write_line
    terminalreporter.write_sep("-", "forkd")
    for event in state.build_events:
        where = f" [{event['worker']}]" if event["worker"] != "main" else ""
        if event["action"] == "built":
            write(f"snapshot {event['snapshot']!r}: built in {event['seconds']:.1f} s{where}")
        else:
            write(f"snapshot {event['snapshot']!r}: cached{where}")
    if samples:
        budgets = [b for b in (*state.project.budgets, *state.cli_budgets) if b.test is None]
        write(_operations_table(samples, budgets, state.comparison))
    overhead = [sample.ms for sample in samples if sample.op == OP_FIXTURE_OVERHEAD]
    if overhead:
        summary = summarize(overhead)
        write(f"fixture_overhead_ms per test (forkd_vm setup + teardown): p50 {summary.p50:.1f}, "
              f"p95 {summary.p95:.1f}, max {summary.max:.1f} (n={summary.n})")
    for kept in state.kept:
        write(f"kept failed VM of {kept.test} as snapshot {kept.tag!r}: forkd shell {kept.tag} --store {kept.store}")
    if state.comparison is not None:
        write(state.comparison.format_table())
        for warning in state.comparison.warnings:
            write(f"warning: {warning}", yellow=True)
    if state.saved_run is not None:
        write(f"saved timings to {state.saved_run}")
    if state.violations:
        write("latency budget violations (exit status 1):", red=True, bold=True)
        header = f"  {'test':<50} {'op':<14} {'stat':<5} {'measured ms':>12} {'budget ms':>10}"
        write(header, red=True)
        for violation in state.violations:
            budget = violation.budget
            op = budget.op + (f"[{budget.backend}]" if budget.backend else "")
            write(f"  {violation.scope:<50} {op:<14} {budget.stat:<5} {violation.measured_ms:>12.2f} "
                  f"{budget.limit_ms:>10g}   ({budget.source})", red=True)


def _operations_table(samples: list[timings.Sample], budgets: list[Budget], comparison: Comparison | None) -> str:
    """Per operation: n, p50, p95, max, suite-wide budgets, p95 delta against the compared run."""
    by_op: dict[str, list[float]] = {}
    for sample in samples:
        by_op.setdefault(sample.op, []).append(sample.ms)
    deltas: dict[str, str] = {}
    if comparison is not None:
        for row in comparison.rows:
            if row.test is None and row.old is not None and row.new is not None:
                deltas[row.op] = f"{row.new.p95 - row.old.p95:+.1f} ms"
    rows = [("operation", "n", "p50 ms", "p95 ms", "max ms", "budget", "delta p95")]
    for op in sorted(by_op, key=lambda op: (timings.KNOWN_OPS.index(op) if op in timings.KNOWN_OPS
                                            else len(timings.KNOWN_OPS), op)):
        summary = summarize(by_op[op])
        limits = ", ".join(f"{b.stat}<={b.limit_ms:g}" + (f"[{b.backend}]" if b.backend else "")
                           for b in budgets if b.op == op)
        rows.append((op, str(summary.n), f"{summary.p50:.1f}", f"{summary.p95:.1f}", f"{summary.max:.1f}",
                     limits or "-", deltas.get(op, "-")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


# -- xdist --------------------------------------------------------------------------------------------------
class _XdistHooks:
    """Controller side of pytest-xdist: gather each worker's samples, budgets and snapshot builds."""

    def __init__(self, state: _RunState) -> None:
        self.state = state

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: object) -> None:
        output = getattr(node, "workeroutput", {}).get(_WORKER_OUTPUT_KEY)
        if output is None:
            self.state.worker_died |= error is not None
            return
        data = json.loads(output)
        self.state.recorder.extend(Recorder.from_json(data["samples"]).samples())
        self.state.marker_budgets += [Budget(**budget) for budget in data["marker_budgets"]]
        self.state.build_events += data["build_events"]
        self.state.kept += [KeptVM(**kept) for kept in data["kept"]]


# -- helpers ------------------------------------------------------------------------------------------------
def _worker_id(config: pytest.Config) -> str:
    workerinput = getattr(config, "workerinput", None)
    return workerinput["workerid"] if workerinput else "main"


def _progress_printer(config: pytest.Config) -> Callable[[str], None]:
    """Print progress lines (snapshot builds) on the terminal even while output is captured."""
    def show(line: str) -> None:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None:
            return
        capture = config.pluginmanager.get_plugin("capturemanager")
        with capture.global_and_fixture_disabled() if capture is not None else nullcontext():
            reporter.ensure_newline()
            reporter.write_line(line)

    return show


def _cached_accel_verdict(settings: Settings) -> AccelVerdict | None:
    """The host's recorded verdict for ``--forkd-accel=auto`` (None: not probed yet, or not auto)."""
    from .engine.accel import cached_verdict
    from .engine.host import find_qemu
    from .errors import HostNotReady

    if settings.accel != "auto":
        return None
    try:
        return cached_verdict(find_qemu())
    except HostNotReady:
        return None


def _qemu_version() -> str | None:
    from .engine.host import find_qemu
    from .errors import HostNotReady

    try:
        return find_qemu().version
    except HostNotReady:
        return None
