"""``pytest --forkd-isolate``: an existing suite's tests, each in its own child VM, set-up inherited from a parent.

The host's pytest collects and selects as always (``-k``, ``-m``, ``-x``,
``--lf``), reports as always (the terminal, ``--junitxml``, pytest-html,
forkd's own summary), and runs each selected test's setup, call and teardown
in a copy-on-write child of a parent VM where the suite is already imported
and collected and its session- and module-scoped fixtures are already set up
(:mod:`~pytest_forkd.isolate.parent`). The reports are the guest
pytest's own (:mod:`~pytest_forkd.isolate.reports`).

Which tests: every test with ``--forkd-isolate`` (ini ``forkd_isolate =
true``, env ``PYTEST_FORKD_ISOLATE=1``; command line over env over ini), else
those marked ``@pytest.mark.forkd_isolate`` (on a test, a class or a module's
``pytestmark``). Tests that use forkd's own fixtures (``forkd_vm``...) drive
VMs from the host and stay there.

The marker's arguments: ``fresh=True`` runs the test in a child of the state
before any set-up, so it sets up (and tears down) its session and module
fixtures itself instead of inheriting the parent's; ``timeout=SECONDS`` its
limit (default ``--forkd-isolate-timeout``, 600 s; a ``timeout`` marker of
pytest-timeout counts too). A test past its limit fails and its VM is
killed; the run goes on. With pytest-timeout on both sides, the host arms no
timer around an isolated test (its ``pytest_timeout_set_timer`` hook is
answered here): the guest's pytest-timeout fails the test, and the VM's
timeout waits for it.

What inheriting means: a session-, module- or class-scoped fixture (and
``setup_module``, ``setup_class``, ``setUpClass``) is set up once, in the
parent, before the children are forked, so each child starts with its own
copy of its value and of what it did in the guest (files, processes). What a
test changes in it stays in that test's child; teardown runs once, in the
parent, after the scope's (or the run's) last test, and its errors are
reported with that test's teardown. Under an xdist schedule that hands a
worker its tests one by one (``load``, ``worksteal``), the parent sets up and
the pool restores children only for the tests known to come to that worker.
A run the guest cannot make as the host would (an option or plugin it lacks,
the project's code found elsewhere) stops with one line saying why.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Final

import pytest

from pytest_forkd.errors import ForkdError
from pytest_forkd.isolate.options import IsolatedTest, IsolateSettings, isolated_test, resolve

if TYPE_CHECKING:
    from pytest_forkd.isolate.parent import GuestRefused, IsolationParent
    from pytest_forkd.plugin.state import RunState

#: Set on an isolated item: how it runs.
ISOLATED: Final = pytest.StashKey["IsolatedTest"]()
#: xdist distributions that hand a worker every test of a scope (class, module), in order.
WHOLE_SCOPE_DISTRIBUTIONS: Final = ("no", "each", "loadfile", "loadscope")
#: Seconds past pytest-timeout's limit at which the VM is killed (the guest's pytest-timeout fails the test first).
PLUGIN_TIMEOUT_GRACE_S: Final = 30.0


class IsolationHooks:
    """The hooks of the isolation mode, registered for every run; they act once a test is selected."""

    def __init__(self, state: RunState) -> None:
        self.state = state
        self.settings: IsolateSettings | None = None
        self.items: list[pytest.Item] = []
        self.index: dict[str, int] = {}
        self.collected_files: list[Path] = []
        self.schedule_known = True
        """Whether the tests to come are ``items`` in order (xdist's load schedules hand them out one by one)."""
        self.parent: IsolationParent | None = None
        self.start_error: str | None = None

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        """Select the tests to isolate (after every other plugin's selection and ordering)."""
        try:
            settings = self.settings = resolve(config)
            for item in items:
                test = isolated_test(item, settings)
                if test is not None:
                    item.stash[ISOLATED] = test
        except ForkdError as exc:
            raise pytest.UsageError(str(exc)) from None
        self.items = [item for item in items if ISOLATED in item.stash]
        self.index = {item.nodeid: position for position, item in enumerate(self.items)}
        self.collected_files = list(dict.fromkeys(Path(item.path) for item in items))
        if getattr(config, "workerinput", None) is not None:
            self.schedule_known = config.getoption("dist", "load") in WHOLE_SCOPE_DISTRIBUTIONS
        if self.items:
            self.state.resolve()  # a bad forkd setting fails the run now, not in every test

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
        test = item.stash.get(ISOLATED, None)
        if test is None:
            return None
        ihook = item.ihook
        ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        for report in self.run(item, test, nextitem):
            ihook.pytest_runtest_logreport(report=report)
        ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    @pytest.hookimpl(tryfirst=True, optionalhook=True)
    def pytest_timeout_set_timer(self, item: pytest.Item, settings: object) -> bool | None:
        """pytest-timeout arms no timer on the host around an isolated test: the guest's pytest-timeout
        times the test itself, and the VM's own timeout backs it up."""
        return True if ISOLATED in item.stash else None

    @pytest.hookimpl(tryfirst=True, optionalhook=True)
    def pytest_timeout_cancel_timer(self, item: pytest.Item) -> bool | None:
        return True if ISOLATED in item.stash else None

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        parent, self.parent = self.parent, None
        if parent is not None:
            parent.close(interrupted=exitstatus == pytest.ExitCode.INTERRUPTED)
            _relay(session.config, parent.parent_output())

    # -- one test ---------------------------------------------------------------------------------
    def run(self, item: pytest.Item, test: IsolatedTest, nextitem: pytest.Item | None) -> list[pytest.TestReport]:
        from pytest_forkd.isolate import reports as isolate_reports

        config = item.config
        parent = self._parent(config)
        if parent is None:
            return isolate_reports.completed(item, [], self.start_error)
        failure = self._not_runnable(item, parent)
        if failure is not None:
            return isolate_reports.completed(item, [], failure)
        timeout = self._vm_timeout(test, parent)
        group = self._group(item, test, nextitem)
        try:
            snapshot = parent.snapshot_for(
                item.nodeid,
                test.scope,
                group,
                fresh=test.fresh,
                timeout=timeout,
                demand=len(group) + 1 if self.schedule_known else None,
            )
        except ForkdError as exc:
            _relay(config, parent.parent_output())
            return isolate_reports.completed(item, [], f"forkd could not set up {test.scope} in the parent VM: {exc}")
        _relay(config, parent.parent_output())
        outcome = parent.run(snapshot, item.nodeid, fresh=test.fresh, timeout=timeout, scope=test.scope)
        reports = [isolate_reports.from_guest(config, item, data) for data in outcome.reports]
        for warning in outcome.warnings:
            isolate_reports.replay_warning(config, item, warning)
        isolate_reports.write_junit_records(config, item, parent.take_recorded())
        isolate_reports.write_junit_records(config, item, outcome.recorded)
        _relay(config, outcome.output)
        error = outcome.error
        reports = isolate_reports.completed(item, reports, f"{type(error).__name__}: {error}" if error else None)
        if parent.set_up and self._leaves_scope(parent, nextitem):
            reports = self._teardown_in_parent(item, reports, parent, nextitem, timeout)
            _relay(config, parent.parent_output())
        return reports

    def _parent(self, config: pytest.Config) -> IsolationParent | None:
        """The run's parent VM, started on the first isolated test; None (and ``start_error``) if it cannot be.

        When the guest cannot run the suite as the host would (an option or
        plugin it lacks, the project's code found elsewhere), the run stops
        with one line saying so (exit status 4, as for bad input).
        """
        if self.parent is not None or self.start_error is not None:
            return self.parent
        from pytest_forkd.isolate import plan as isolate_plan
        from pytest_forkd.isolate.parent import GuestRefused, IsolationParent
        from pytest_forkd.plugin.progress import progress_printer

        assert self.settings is not None
        progress = progress_printer(config)
        parent: IsolationParent | None = None
        try:
            plan = isolate_plan.plan(
                config,
                [Path(item.path) for item in self.items],
                configured_paths=self.settings.paths,
                exclude=self.settings.exclude,
                collected_files=self.collected_files,
            )
            session = self.state.open_session(progress)
            parent = IsolationParent(
                session, plan, progress=progress, relay_output=config.getoption("capture", "fd") == "no"
            )
            parent.start()
        except GuestRefused as exc:
            if parent is not None:
                parent.close()
            self.start_error = refusal_line(config, exc)
            pytest.exit(self.start_error, returncode=pytest.ExitCode.USAGE_ERROR)
        except (ForkdError, OSError, ValueError) as exc:  # a bad reply is a ValueError (JSON)
            self.start_error = f"forkd could not start the isolation parent VM: {type(exc).__name__}: {exc}"
            if parent is not None:
                parent.close()
            return None
        except BaseException:  # Ctrl-C while it starts: no VM outlives the run
            if parent is not None:
                parent.close(interrupted=True)
            raise
        self.parent = parent
        _relay(config, parent.parent_output())
        return parent

    def _not_runnable(self, item: pytest.Item, parent: IsolationParent) -> str | None:
        """Why the guest cannot run ``item`` (its pytest did not collect it), or None."""
        if item.nodeid in parent.collected:
            return None
        file = item.stash[ISOLATED].file
        error = parent.collection_errors.get(file) or next(
            (text for nodeid, text in parent.collection_errors.items() if file.startswith(nodeid)), None
        )
        if error is not None:
            return (
                f"the guest's pytest could not collect {file} (a test dependency missing from the guest image? "
                f"declare it under images: in forkd.yaml):\n{error}"
            )
        return (
            f"the guest's pytest (pytest {parent.guest_versions.get('pytest')}, Python "
            f"{parent.guest_versions.get('python')}) did not collect {item.nodeid}; it collects the same files "
            "with the same ini file, so a plugin or conftest.py that generates this test may be missing in the guest"
        )

    @staticmethod
    def _vm_timeout(test: IsolatedTest, parent: IsolationParent) -> float:
        """Seconds before the test's VM is killed: forkd's timeout when it was set for it, else the default or
        after pytest-timeout's limit, when the guest has that plugin to fail the test itself."""
        if test.plugin_timeout is not None and not test.timeout_given and "timeout" in parent.guest_plugins:
            return max(test.timeout, test.plugin_timeout + PLUGIN_TIMEOUT_GRACE_S)
        return test.timeout

    def _group(self, item: pytest.Item, test: IsolatedTest, nextitem: pytest.Item | None) -> list[str]:
        """The tests after ``item`` of its scope (in run order) whose fixtures the parent sets up with its own.

        Under an xdist schedule that hands tests out one by one only the next
        test is known to come to this worker: the parent never sets up, nor
        the pool restores children, for tests another worker runs.
        """
        if not self.schedule_known:
            following = nextitem.stash.get(ISOLATED, None) if nextitem is not None else None
            if nextitem is not None and following is not None and following.scope == test.scope:
                return [] if following.fresh else [nextitem.nodeid]
            return []
        group: list[str] = []
        for following_item in self.items[self.index.get(item.nodeid, len(self.items)) + 1 :]:
            other = following_item.stash[ISOLATED]
            if other.scope != test.scope:
                break
            if not other.fresh:
                group.append(following_item.nodeid)
        return group

    @staticmethod
    def _leaves_scope(parent: IsolationParent, nextitem: pytest.Item | None) -> bool:
        """Whether the next test no longer shares what the parent has set up (its scope, or anything)."""
        if nextitem is None:
            return True
        following = nextitem.stash.get(ISOLATED, None)
        return parent.prepared_scope is not None and (following is None or following.scope != parent.prepared_scope)

    def _teardown_in_parent(
        self,
        item: pytest.Item,
        reports: list[pytest.TestReport],
        parent: IsolationParent,
        nextitem: pytest.Item | None,
        timeout: float,
    ) -> list[pytest.TestReport]:
        from pytest_forkd.isolate import reports as isolate_reports

        following = nextitem.stash.get(ISOLATED, None) if nextitem is not None else None
        try:
            reply = parent.teardown(
                item.nodeid,
                nextitem.nodeid if nextitem is not None else None,
                timeout=timeout,
                next_scope=following.scope if following is not None else None,
            )
        except ForkdError as exc:
            failed = isolate_reports.made_here(
                item, "teardown", "failed", f"forkd: tearing down in the parent VM: {exc}"
            )
            return isolate_reports.with_parent_teardown(reports, failed)
        for warning in reply.get("warnings", ()):
            isolate_reports.replay_warning(item.config, item, warning)
        isolate_reports.write_junit_records(item.config, item, reply)
        return isolate_reports.with_parent_teardown(
            reports, isolate_reports.from_guest(item.config, item, reply["report"])
        )


def refusal_line(config: pytest.Config, refused: GuestRefused) -> str:
    """The one line that stops a run the guest cannot make as the host would."""
    if refused.kind == "options":
        from pytest_forkd.isolate.forwarding import explain_refused

        return explain_refused(config, refused.names)
    if refused.kind == "plugins":
        return (
            f"pytest --forkd-isolate: the guest's Python has no plugin {', '.join(refused.names)}, which the host "
            "loads with -p; add it to the guest image in forkd.yaml (images: NAME: packages: [...]) or drop the -p"
        )
    if refused.kind == "imports":
        return (
            "pytest --forkd-isolate: "
            + "; ".join(refused.names)
            + " (the guest's sys.path has another copy first; see 'The guest imports another copy' in the "
            "troubleshooting guide)"
        )
    return f"pytest --forkd-isolate: {refused}"


def _relay(config: pytest.Config, output: str) -> None:
    """Print what the guest's tests and fixtures wrote uncaptured (``-s``) on the host's terminal."""
    if output and config.getoption("capture", "fd") == "no":
        sys.stdout.write(output)
        sys.stdout.flush()
