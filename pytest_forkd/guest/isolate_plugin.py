"""The pytest plugin the guest's pytest runs with for ``pytest --forkd-isolate``: the host's commands instead of a loop.

Started by ``isolate_runner.py`` once the project is first on ``sys.path``.
It replaces pytest's test loop: once the suite is collected it answers the
host's commands, one JSON object per line (see the runner for the channel):

``ready`` (sent unasked after collection)
    the collected node ids and the collection errors by node id. Instead,
    ``error`` with ``kind``: ``imports`` when a package of the project is
    found elsewhere than on the host, ``internals`` when this pytest's
    private shape does not fit :mod:`isolate_pytest`.
``prepare`` {nodeid, group, scope}
    in the parent: set up the test's collectors down to its ``scope`` (the
    node id of its class when it uses class-scoped set-up, else of its
    module; module and class set-up included) and the session-, package-,
    module- (and, for a class, class-) scoped fixtures of that test and of
    the ``group`` (the tests of the same scope to come), so every child forked
    afterwards starts with them done. A failure is kept where pytest keeps
    it (the fixture's cache, the collector's stack entry) and raised again in
    each child whose test needs it, so the test reports it as pytest would.
``run`` {nodeid, fresh, marker, scope}
    in a child: run that test's protocol (setup, call, teardown) through
    pytest's hooks, so assertion introspection, capturing and warnings work
    as in any run, and send each of its reports as pytest makes it
    (``report``: ``pytest_report_to_serializable``, as pytest-xdist sends
    them), then ``done`` with the warnings and what the test recorded for
    junitxml (``record_xml_attribute``, ``record_testsuite_property``), after
    writing ``marker`` on stderr (the host has all the test's output when it
    reads it). The teardown stops at the test's scope: what the parent set up
    is torn down once, in the parent. A ``fresh`` test runs in a child of the
    state taken before any set-up and tears everything down itself.
``teardown`` {nodeid, next, next_scope}
    in the parent: tear down what the test ``next`` (None: no more tests)
    does not share, as pytest does after ``nodeid``; answers with that
    teardown's report.
``warm``
    in a pooled child, before its test comes: answer (``warm``), through the
    code paths a test's run takes, so they are translated ahead under TCG.
``exit``
    end the loop; pytest then finishes as usual.

Options the host parsed arrive by name and are set in ``pytest_cmdline_main``,
before any plugin or conftest.py is configured; one the guest's parser does
not know ends the run (the runner names it to the host). pytest's private
internals are reached through :mod:`isolate_pytest` alone. Runs with the
guest's pytest (Debian bookworm's 7.2 in the default image) and the host's
(tests), so it sticks to what pytest 7.2 to 9 share.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import IO, TYPE_CHECKING, Any, Protocol

import pytest

if TYPE_CHECKING:
    from . import isolate_imports
    from . import isolate_pytest as door
else:
    try:
        from . import isolate_imports
        from . import isolate_pytest as door
    except ImportError:  # in the guest: the runner's modules lie side by side
        import isolate_imports
        import isolate_pytest as door

#: Scopes of the fixtures the parent sets up ahead of its children.
INHERITED_SCOPES = ("session", "package", "module", "class")


class Channel(Protocol):
    def receive(self) -> dict[str, Any] | None: ...

    def send(self, message: dict[str, Any]) -> None: ...


def scope_node(item: Any, scope: str | None = None) -> Any:
    """The node the parent sets up for ``item`` and its children keep: the one of ``item``'s chain the host
    named (``scope``: its class or its file), else its file (module)."""
    chain = item.listchain()
    if scope:
        for node in chain:
            if node.nodeid == scope:
                return node
    for node in reversed(chain):
        if isinstance(node, pytest.File):
            return node
    return item.parent


class JunitRecorder:
    """Stands in for the host's junitxml writer: keeps what ``record_xml_attribute`` and
    ``record_testsuite_property`` write, for the host to write into its own."""

    def __init__(self, family: str) -> None:
        self.family = family
        """The host's ``junit_family``: the ``record_*`` fixtures warn from it as on the host."""
        self.attributes: list[list[str]] = []
        self.properties: list[list[str]] = []

    def node_reporter(self, node: Any) -> _AttributeRecorder:
        return _AttributeRecorder(self, str(getattr(node, "nodeid", node)))

    def add_global_property(self, name: str, value: object) -> None:
        __tracebackhide__ = True
        if not isinstance(name, str):
            raise TypeError(f"name parameter needs to be a string, but {type(name).__name__} given")
        self.properties.append([name, str(value)])

    def drain(self) -> dict[str, list[list[str]]]:
        """What was recorded since the last call."""
        taken = {"xml_attributes": self.attributes, "testsuite_properties": self.properties}
        self.attributes, self.properties = [], []
        return taken


class _AttributeRecorder:
    def __init__(self, recorder: JunitRecorder, nodeid: str) -> None:
        self._recorder = recorder
        self._nodeid = nodeid

    def add_attribute(self, name: str, value: object) -> None:
        self._recorder.attributes.append([self._nodeid, str(name), str(value)])


class Runner:
    """The pytest plugin that serves the host's commands instead of running the test loop."""

    def __init__(self, channel: Channel, spec: dict[str, Any]) -> None:
        self.channel = channel
        self.spec = spec
        self.collection_errors: dict[str, str] = {}
        self.warnings: list[dict[str, Any]] = []
        self.served = False
        self.refused_options: list[str] = []
        """Options the host passed that this pytest's plugins do not know (the run stops)."""
        self.junit: JunitRecorder | None = None
        self.streaming: pytest.Session | None = None
        """The session while a test runs (its reports are sent as they come), else None."""

    # -- pytest hooks ------------------------------------------------------------------------
    @pytest.hookimpl(tryfirst=True)
    def pytest_cmdline_main(self, config: pytest.Config) -> int | None:
        """Set the host's options by name, before any plugin's or conftest.py's ``pytest_configure`` runs.

        The report options (``-v``, ``--tb``...) belong to the terminal plugin,
        which the guest does not load, so they are set as they are; every
        other one must be known to this pytest's parser, else the run stops.
        """
        options: dict[str, Any] = dict(self.spec.get("options", {}))
        known = {argument.dest for argument in door.registered_options(config)}
        self.refused_options = sorted(dest for dest in options if dest not in known)
        if self.refused_options:
            return int(pytest.ExitCode.USAGE_ERROR)
        for dest, value in {**self.spec.get("report_options", {}), **options}.items():
            setattr(config.option, dest, value)
        return None

    @pytest.hookimpl(tryfirst=True)
    def pytest_configure(self, config: pytest.Config) -> None:
        family = self.spec.get("junit_family")
        if isinstance(family, str):  # the host writes junit XML: the record_* fixtures write to it through us
            self.junit = JunitRecorder(family)
            config.pluginmanager.register(self.junit, "forkd-isolate-junitxml")
            door.set_junitxml(config, self.junit)

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.collection_errors[report.nodeid] = report.longreprtext

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: Any, call: Any) -> Any:
        """Give every report its start and stop times (pytest 7.2's reports have none; the host's have)."""
        outcome = yield
        report = outcome.get_result()
        if "start" not in report.__dict__:
            report.start, report.stop = call.start, call.stop

    def pytest_runtest_logreport(self, report: Any) -> None:
        if self.streaming is not None:  # a test runs: each report goes to the host as soon as it is made
            self.channel.send({"op": "report", "report": self.serialized(self.streaming, report)})

    def pytest_warning_recorded(self, warning_message: Any, when: str, nodeid: str, location: Any) -> None:
        self.warnings.append(
            {
                "message": str(warning_message.message),
                "category": warning_message.category.__name__,
                "filename": warning_message.filename,
                "lineno": warning_message.lineno,
                "when": when,
                "nodeid": nodeid,
            }
        )

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> bool:
        self.served = True
        self.serve(session)
        return True

    # -- the commands ----------------------------------------------------------------------
    def serve(self, session: pytest.Session) -> None:
        items = {item.nodeid: item for item in session.items}
        refusal = self.refusal(session)
        if refusal is not None:
            self.channel.send(refusal)
            return
        self.channel.send(
            {
                "op": "ready",
                "collected": list(items),
                "errors": self.collection_errors,
                "pid": os.getpid(),
                "python": sys.version.split()[0],
                "pytest": pytest.__version__,
                "plugins": sorted(name for name, _ in session.config.pluginmanager.list_name_plugin() if name),
            }
        )
        while True:
            command = self.channel.receive()
            if command is None or command.get("op") == "exit":
                return
            try:
                reply = self.handle(session, items, command)
            except Exception:  # a fault of this runner, not of a test: the host shows it
                reply = {"op": "error", "message": traceback.format_exc()}
            self.channel.send(reply)

    def refusal(self, session: pytest.Session) -> dict[str, Any] | None:
        """Why this guest must not run the suite: pytest's internals moved, or the project comes from elsewhere."""
        functions = [item for item in session.items if isinstance(item, pytest.Function)]
        found = door.problems(session, functions[0] if functions else None)
        if found:
            return {"op": "error", "kind": "internals", "message": door.describe(found, pytest.__version__)}
        elsewhere = isolate_imports.mismatches(self.spec.get("project_modules", {}))
        if elsewhere:
            return {"op": "error", "kind": "imports", "lines": elsewhere, "message": "\n".join(elsewhere)}
        return None

    def handle(self, session: pytest.Session, items: dict[str, Any], command: dict[str, Any]) -> dict[str, Any]:
        op = command.get("op")
        if op == "warm":
            return self.warm_up(session)
        nodeid = command.get("nodeid")
        if op not in ("prepare", "run", "teardown"):
            return {"op": "error", "message": f"unknown command {op!r}"}
        item = items.get(nodeid) if isinstance(nodeid, str) else None
        if item is None:
            return {"op": "error", "message": f"the guest's pytest did not collect {nodeid!r}"}
        scope = command.get("scope") if isinstance(command.get("scope"), str) else None
        if op == "prepare":
            group = [items[other] for other in command.get("group", ()) if other in items]
            return self.prepare(session, item, group, scope)
        if op == "run":
            fresh = bool(command.get("fresh"))
            return self.run(session, item, fresh=fresh, marker=str(command.get("marker") or ""), scope=scope)
        next_scope = command.get("next_scope") if isinstance(command.get("next_scope"), str) else None
        next_item = items.get(command.get("next") or "")
        return self.teardown(session, item, next_item, last=command.get("next") is None, next_scope=next_scope)

    def warm_up(self, session: pytest.Session) -> dict[str, Any]:
        """Answer a pooled child's first request (before its test comes): the reply and a report serialized
        take the code paths a test's run takes, translated ahead on an idle core under TCG."""
        report = pytest.TestReport(
            nodeid="", location=("", 0, ""), keywords={}, outcome="passed", longrepr=None, when="call"
        )
        self.serialized(session, report)
        return {"op": "warm"}

    def prepare(self, session: pytest.Session, item: Any, group: list[Any], scope: str | None) -> dict[str, Any]:
        """Set up the item's collectors down to its scope, then the inherited fixtures of it and its group.

        Class-scoped fixtures are inherited when the scope is the item's
        class; with its module as the scope, its children set them up.
        """
        outcomes = door.outcome_exceptions()
        node = scope_node(item, scope)
        scopes = INHERITED_SCOPES if isinstance(node, pytest.Class) else INHERITED_SCOPES[:-1]
        errors: list[str] = []
        try:
            door.tear_down_to(session, node)  # normally done already, after the previous test
        except outcomes as exc:
            errors.append(f"tearing down before {item.nodeid}: {exc!r}")
        try:
            door.set_up(session, node)
        except outcomes as exc:  # kept in the stack: each child's test raises it again
            errors.append(f"setting up {node.nodeid}: {exc!r}")
        warmed: list[str] = []
        for other in [item, *group]:
            warmed += self.warm(session, other, errors, first=other is item, scopes=scopes)
        reply: dict[str, Any] = {"op": "prepared", "fixtures": warmed, "errors": errors}
        return {**reply, **self.recorded()}

    def warm(
        self, session: pytest.Session, item: Any, errors: list[str], *, first: bool, scopes: tuple[str, ...]
    ) -> list[str]:
        """Compute the fixtures of ``item`` of the inherited ``scopes`` in this process.

        For the other tests of the group, parametrized fixtures and those
        already computed are left alone: computing one with another parameter
        would tear down the instance the first test needs. The test counts as
        active meanwhile (pytest 9 warns about a fixture requested for a test
        that is not), without its own set-up.
        """
        definitions = door.fixture_definitions(item)
        request = door.request_of(item)
        if definitions is None or not request:
            return []
        outcomes = door.outcome_exceptions()
        warmed = []
        try:
            with door.counted_as_active(session, item), door.test_case_instance(item):
                for name in item.fixturenames:
                    fixturedefs = definitions.get(name)
                    if not fixturedefs:
                        continue
                    fixturedef = fixturedefs[-1]
                    if door.fixture_scope(fixturedef) not in scopes:
                        continue
                    if not first and (door.is_parametrized(fixturedef) or door.is_cached(fixturedef)):
                        continue
                    try:
                        request.getfixturevalue(name)
                    except outcomes as exc:  # cached by the fixture: raised again in each child that needs it
                        errors.append(f"fixture {name!r} of {item.nodeid}: {exc!r}")
                        break  # the fixtures after it may depend on it
                    warmed.append(name)
        finally:
            door.reset_request(item)  # the test's own request starts clean in every child
        return warmed

    def run(self, session: pytest.Session, item: Any, *, fresh: bool, marker: str, scope: str | None) -> dict[str, Any]:
        """Run one test through pytest's protocol; its teardown stops at its scope unless it is ``fresh``.

        Each report is sent as soon as pytest makes it (``report``), so the
        host knows how far the test got if its VM dies; ``done`` ends the run
        with the warnings it recorded, once ``marker`` followed the test's own
        output on stderr.
        """
        self.warnings = []
        nextitem = None if fresh else scope_node(item, scope)
        self.streaming = session
        try:
            session.config.hook.pytest_runtest_protocol(item=item, nextitem=nextitem)
        finally:
            self.streaming = None
            _flush(sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
            if marker:
                try:
                    os.write(2, marker.encode() + b"\n")
                except OSError:  # the test closed its stderr: the host stops waiting for the marker
                    pass
        return {"op": "done", "warnings": self.warnings, **self.recorded()}

    def teardown(
        self, session: pytest.Session, item: Any, next_item: Any, *, last: bool, next_scope: str | None = None
    ) -> dict[str, Any]:
        """Tear down in this process what the next test does not share (everything after the last one).

        The parent never ran ``item`` (its children did), so this is not the
        test's teardown hook: only the collectors' and fixtures' finalizers
        run, under output capture, and ``item`` names the report.
        """
        if last:
            target = None
        elif next_item is not None:
            target = scope_node(next_item, next_scope)
        else:  # a test the guest does not run next (on the host, or not collected here): keep the session
            target = session
        self.warnings = []
        door.clear_report_sections(item)
        with door.item_capture(session.config, "teardown", item):
            call = pytest.CallInfo.from_call(lambda: door.tear_down_to(session, target), when="teardown")
        report = pytest.TestReport.from_item_and_call(item, call)
        if "start" not in report.__dict__:
            report.start, report.stop = call.start, call.stop
        _flush(sys.stdout, sys.stderr)
        return {
            "op": "torn_down",
            "report": self.serialized(session, report),
            "warnings": self.warnings,
            **self.recorded(),
        }

    def recorded(self) -> dict[str, list[list[str]]]:
        return self.junit.drain() if self.junit is not None else {}

    @staticmethod
    def serialized(session: pytest.Session, report: Any) -> dict[str, Any]:
        data: dict[str, Any] = session.config.hook.pytest_report_to_serializable(config=session.config, report=report)
        return data


def _flush(*streams: IO[str] | None) -> None:
    for stream in streams:
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # closed by the test
            pass
