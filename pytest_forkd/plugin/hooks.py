"""The plugin's hooks: configuring the run, checking markers, timing each test, judging budgets.

Per test: every timing sample taken from setup to teardown is attributed
to it (work of broader-scoped fixtures to no test); a test with its own
budget is judged once its teardown's samples are in, in its own report; a
``forkd_dangerous`` test's VM is checkpointed right before its body. At the
end: suite-wide budgets and the comparison with a stored run decide the
exit status (see :mod:`pytest_forkd.plugin.report` for what is printed).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Generator
from typing import TYPE_CHECKING, Any, Final

import pytest

from pytest_forkd.errors import ForkdError
from pytest_forkd.plugin import report
from pytest_forkd.plugin.fixtures import CHOICE, DANGEROUS_CHECKPOINT, TEST_BUDGETS, TEST_VM, TEST_VMS, choice_of
from pytest_forkd.plugin.options import add_markers, usage_error
from pytest_forkd.plugin.progress import PrefixRestorer
from pytest_forkd.plugin.state import STATE, names_forkd, run_state, start_run, uses_forkd, worker_id
from pytest_forkd.plugin.xdist import WORKER_OUTPUT_KEY, XdistHooks

if TYPE_CHECKING:
    from pytest_forkd.latency.budgets import Budget

CALL_REPORT: Final = pytest.StashKey[pytest.TestReport]()
REPORTS_HELD: Final = pytest.StashKey[bool]()
"""The item's reports are logged after its teardown, so a budget can still fail its call report."""


# -- the run --------------------------------------------------------------------------------------------------
def pytest_configure(config: pytest.Config) -> None:
    add_markers(config)
    state = start_run(config)
    # VMs a test starts with pytest_forkd.boot() are the run's too: their timings count in its summary and budgets.
    from pytest_forkd.core import defaults  # a slot: imports nothing

    state.previous_default_runtime = defaults.use_runtime(lambda: state.runtime)
    if names_forkd(config):
        state.resolve()  # a bad setting fails the run now, before any test
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(XdistHooks(state), "forkd-xdist")
    config.pluginmanager.register(PrefixRestorer(config), "forkd-progress")
    from pytest_forkd.isolate.hooks import IsolationHooks  # its hooks act once a test is selected

    config.pluginmanager.register(IsolationHooks(state), "forkd-isolate")
    if config.getoption("forkd_report", None) and getattr(config, "workerinput", None) is None:
        from pytest_forkd.plugin.html_report import TestTimes, check_report_path

        check_report_path(config.getoption("forkd_report"))
        config.pluginmanager.register(TestTimes(state), "forkd-report")


def pytest_unconfigure(config: pytest.Config) -> None:
    factories = sys.modules.get("pytest_forkd.core.factory")  # only if a test used pytest_forkd.boot()
    if factories is not None:
        factories.close_default_factories()
    state = config.stash.get(STATE, None)
    if state is None:
        return
    from pytest_forkd.core import defaults

    defaults.use_runtime(state.previous_default_runtime)
    state.close_session(worker_id(config))
    if state.worker_died:  # by now xdist has reaped the dead worker, so its run directory counts as stale
        from pytest_forkd.engine.rundir import clean_stale

        clean_stale()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Validate the forkd markers up front, so a typo fails the run before any VM starts."""
    state = run_state(config)
    used = [item for item in items if uses_forkd(item)]
    if not used:
        return
    state.children_expected = _expected_children(config, used)
    state.resolve()
    backends: list[str] | None = None
    marked_snapshots: set[str] = set()
    try:
        for item in used:
            budget_marker = item.get_closest_marker("forkd_budget")
            if budget_marker is not None:
                from pytest_forkd.latency.budgets import budgets_from_marker

                test_budgets = budgets_from_marker(item.nodeid, budget_marker.args, budget_marker.kwargs)
                item.stash[TEST_BUDGETS] = list(test_budgets)
                state.marker_budgets += test_budgets
            marker = item.get_closest_marker("forkd")
            if marker is not None:
                from pytest_forkd.project.settings import choose_vm

                if backends is None:
                    backends = state.runtime.backends.ids()
                item.stash[CHOICE] = choice = choose_vm(
                    state.settings, marker.args, marker.kwargs, backends=backends, test=item.nodeid
                )
                marked_snapshots.add(choice.snapshot)
        if marked_snapshots - {state.settings.snapshot}:
            from pytest_forkd.plugin.options import check_snapshots

            check_snapshots(state.settings, state.project, sorted(marked_snapshots - {state.settings.snapshot}))
    except ForkdError as exc:
        raise usage_error(exc) from None


def _expected_children(config: pytest.Config, items: list[pytest.Item]) -> int:
    """Tests of this process that will take a ``forkd_vm``: an xdist worker runs about its share of them."""
    count = sum("forkd_vm" in getattr(item, "fixturenames", ()) for item in items)
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1) or 1)
    return -(-count // max(1, workers))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    state = run_state(config)
    state.close_session(worker_id(config))
    workeroutput = getattr(config, "workeroutput", None)  # set by pytest-xdist on its workers
    if workeroutput is None and state.recorder.samples():
        # The run's own span: tests and their VMs, up to the last VM closed; not what
        # other plugins do afterwards in their terminal summaries.
        from pytest_forkd.plugin import cpu_bound

        state.cpu_bound = cpu_bound.measure()
    if workeroutput is not None:
        workeroutput[WORKER_OUTPUT_KEY] = json.dumps(
            {
                "samples": state.recorder.to_json(),
                "marker_budgets": [vars(budget) for budget in state.marker_budgets],
                "build_events": state.build_events,
                "kept": [vars(kept) for kept in state.kept],
            }
        )
        return
    samples = state.recorder.samples()
    options = config.option
    if not samples and not options.forkd_report:
        return
    from pytest_forkd.latency.budgets import check, resolve

    budgets = resolve(state.project.budgets, state.cli_budgets, state.marker_budgets)
    if samples:
        state.violations = check(budgets, samples)
        failed = bool(state.violations)
        if (
            options.forkd_json
            or options.forkd_save is not None
            or options.forkd_autosave
            or options.forkd_compare is not None
        ):
            failed |= report.store_and_compare(config, state, budgets)
        if failed and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if options.forkd_report:
        from pytest_forkd.plugin.html_report import write_html_report

        try:
            state.report = write_html_report(config, state, budgets, session.exitstatus)
        except OSError as exc:  # the path was checked at start-up: the disk filled up, or it went away
            state.report_error = f"could not write the HTML report to {options.forkd_report}: {exc}"
            if session.exitstatus == pytest.ExitCode.OK:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED


# -- each test ------------------------------------------------------------------------------------------------
@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """Attribute every timing sample taken while the test runs (setup to teardown) to it."""
    with run_state(item.config).recorder.running_test(item.nodeid):
        return (yield)


@pytest.hookimpl(tryfirst=True, specname="pytest_runtest_protocol")
def pytest_runtest_protocol_of_budgeted_tests(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    """Run a test with a per-test budget, and log its reports only once its teardown is done.

    A budget can only be judged when every sample of the test is in, and
    teardown (closing VMs, fixture finalizers) takes some; the verdict belongs
    in the test's call report, which pytest would otherwise have logged
    already. Other tests take pytest's own protocol.
    """
    if TEST_BUDGETS not in item.stash and "forkd_budget" not in getattr(item, "fixturenames", ()):
        return None
    from _pytest.runner import runtestprotocol

    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    item.stash[REPORTS_HELD] = True
    for test_report in runtestprotocol(item, nextitem=nextitem, log=False):
        item.ihook.pytest_runtest_logreport(report=test_report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> Any:
    """Attribute the work of session-, package-, module- and class-scoped fixtures to no test.

    Which test happens to set such a fixture up depends on the order tests run
    in; charging its work to that test would fail a neighbour's budget.
    """
    state = request.config.stash.get(STATE, None)
    if fixturedef.scope == "function" or state is None:
        return (yield)
    with state.recorder.running_test(None):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    """Checkpoint a ``forkd_dangerous`` test's VM right before its body, unless its fixture did."""
    if item.get_closest_marker("forkd_dangerous") is not None and DANGEROUS_CHECKPOINT not in item.stash:
        vm = item.stash.get(TEST_VM, None)
        if vm is None:
            pytest.fail(
                "@pytest.mark.forkd_dangerous checkpoints the test's VM: the test must use the forkd_vm fixture",
                pytrace=False,
            )
        backend = choice_of(item, run_state(item.config).settings).backend
        item.stash[DANGEROUS_CHECKPOINT] = item.stash[TEST_VMS].checkpoint(vm, backend=backend)
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Judge the test's own budgets once teardown's timings are in; add the VMs' transcripts and console
    to a failing test's report; keep its VM if asked.

    After teardown, write the test's transcript file (``--forkd-transcript``)
    and name it in the report's user properties (junit XML) and extras (pytest-html).
    """
    budget_failure = _judge_test_budgets(item) if call.when == "teardown" and TEST_BUDGETS in item.stash else None
    transcript_path = report.write_transcript(item) if call.when == "teardown" else None
    test_report: pytest.TestReport = yield
    if test_report.when == "call":
        item.stash[CALL_REPORT] = test_report
    if budget_failure is not None:
        _fail_with(test_report, budget_failure)
    if transcript_path is not None:
        report.add_html_extra(test_report, f"forkd transcript: {transcript_path}", url=transcript_path.as_uri())
    if call.when == "teardown":  # the test is over: let its VMs and their transcripts go
        keys: tuple[pytest.StashKey[Any], ...] = (TEST_VMS, TEST_VM)
        for key in keys:
            if key in item.stash:
                del item.stash[key]
        return test_report
    vm = item.stash.get(TEST_VM, None)
    if vm is None:
        return test_report
    if test_report.when == "call" or test_report.failed:
        item.stash[report.TEST_OUTCOME] = test_report.outcome
    if test_report.failed and test_report.when in ("setup", "call"):
        report.describe_failure(item, test_report, vm)
    return test_report


def _judge_test_budgets(item: pytest.Item) -> str | None:
    """Fail the test whose samples (setup to teardown) exceed its own budgets, naming operation and figure.

    Called once teardown is done. The call report carries the failure while
    it is still held back (see :func:`pytest_runtest_protocol_of_budgeted_tests`);
    otherwise the verdict is returned for the teardown report. A test that
    failed or was skipped for another reason keeps its outcome; a failed one
    gets the budget verdict as an extra section.
    """
    from pytest_forkd.latency.budgets import check, resolve, violation_report

    declared: list[Budget] = item.stash[TEST_BUDGETS]
    budgets = resolve(declared)
    samples = [sample for sample in run_state(item.config).recorder.samples() if sample.test == item.nodeid]
    violations = check(budgets, samples)
    if not violations:
        return None
    message = violation_report(violations)
    if not item.stash.get(REPORTS_HELD, False):
        return message
    call = item.stash.get(CALL_REPORT, None)
    if call is not None:  # else setup failed or was skipped: the test's outcome says why already
        _fail_with(call, message)
        if call.failed:
            item.stash[report.TEST_OUTCOME] = "failed"
    return None


def _fail_with(test_report: pytest.TestReport, message: str) -> None:
    """Turn a passed report into a failure saying ``message``; add it to an already failed one."""
    if test_report.passed and not hasattr(test_report, "wasxfail"):
        test_report.outcome = "failed"
        test_report.longrepr = message
    elif test_report.failed:
        test_report.sections.append(("forkd_budget", message))


def pytest_assertrepr_compare(config: pytest.Config, op: str, left: object, right: object) -> list[str] | None:
    """Explain a failed comparison of :class:`~pytest_forkd.analysis.changes.Changes` or its path sets."""
    changes = sys.modules.get("pytest_forkd.analysis.changes")
    if changes is None:  # not imported, so neither side can be one of its values
        return None
    return changes.explain_comparison(op, left, right)  # type: ignore[no-any-return]
