"""The pytest process inside the guest that runs a suite's tests for ``pytest --forkd-isolate``.

The host copies this file into the parent VM and starts it with the path of a
spec (JSON: the pytest arguments, the options to set, the entries to put in
front of ``sys.path``). It runs ``pytest.main`` with itself as a plugin that
replaces pytest's test loop: once the suite is collected, it answers the
host's commands, one JSON object per line, on the process's original stdin
and stdout (the tests' own output goes to stderr):

``ready`` (sent unasked after collection)
    the collected node ids and the collection errors by node id.
``prepare`` {nodeid, group}
    in the parent: set up the test's collectors up to its file (module
    set-up included) and the session-, package- and module-scoped fixtures
    of that test and of the ``group`` (the tests of the same file to come),
    so every child forked afterwards starts with them done. A failure is
    kept where pytest keeps it (the fixture's cache, the collector's stack
    entry) and raised again in each child whose test needs it, so the test
    reports it as pytest would.
``run`` {nodeid, fresh}
    in a child: run that test's protocol (setup, call, teardown) through
    pytest's hooks, so assertion introspection, capturing and warnings work
    as in any run, and send each of its reports as pytest makes it
    (``report``: ``pytest_report_to_serializable``, as pytest-xdist sends
    them), then ``done`` with the warnings. The
    teardown stops at the test's file: what the parent set up is torn down
    once, in the parent. A ``fresh`` test runs in a child of the state taken
    before any set-up and tears everything down itself.
``teardown`` {nodeid, next}
    in the parent: tear down what the test ``next`` (None: no more tests)
    does not share, as pytest does after ``nodeid``; answers with that
    teardown's report.
``exit``
    end the loop; pytest then finishes as usual.

It imports nothing of pytest-forkd: it runs with the guest's Python and the
guest's pytest (Debian bookworm's 7.2 in the default image), so it sticks to
what pytest 7.2 to 9 share.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from typing import IO, Any

import pytest

#: Scopes of the fixtures the parent sets up ahead of its children.
INHERITED_SCOPES = ("session", "package", "module")


class Channel:
    """The host's commands in and the replies out: JSON, one object per line, on private descriptors."""

    def __init__(self, commands: IO[bytes], replies: IO[bytes]) -> None:
        self._commands = commands
        self._replies = replies

    @classmethod
    def from_stdio(cls) -> Channel:
        """Take stdin and stdout for the protocol; the tests get /dev/null as stdin and stderr as stdout.

        The protocol's descriptors are duplicates that subprocesses do not
        inherit, so nothing a test runs can write into the channel.
        """
        commands = os.dup(0)
        replies = os.dup(1)
        os.dup2(2, 1)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for stream in (sys.stdout, sys.stderr):  # what a test prints uncaptured (-s) reaches the host as it goes
            reconfigure = getattr(stream, "reconfigure", None)
            if reconfigure is not None:
                reconfigure(line_buffering=True)
        return cls(os.fdopen(commands, "rb"), os.fdopen(replies, "wb"))

    def receive(self) -> dict[str, Any] | None:
        """The next command, or None when the host closed the channel."""
        line = self._commands.readline()
        if not line:
            return None
        command = json.loads(line)
        if not isinstance(command, dict):
            raise ValueError(f"a command must be a JSON object, got {line[:200]!r}")
        return command

    def send(self, message: dict[str, Any]) -> None:
        self._replies.write(json.dumps(message, default=str).encode() + b"\n")
        self._replies.flush()


def _outcome_exceptions() -> tuple[type[BaseException], ...]:
    """What pytest treats as a test's outcome (skip, fail, xfail and every Exception), not an interruption."""
    from _pytest.outcomes import OutcomeException

    return (OutcomeException, Exception)


def file_node(item: pytest.Item) -> Any:
    """The file collector (module) the item belongs to: how far up the parent sets things up."""
    node = item.parent
    while node is not None and not isinstance(node, pytest.File):
        node = node.parent
    return node if node is not None else item.parent


def _scope_of(fixturedef: Any) -> str:
    scope = fixturedef.scope
    return str(getattr(scope, "value", scope))


class Runner:
    """The pytest plugin that serves the host's commands instead of running the test loop."""

    def __init__(self, channel: Channel, spec: dict[str, Any]) -> None:
        self.channel = channel
        self.spec = spec
        self.collection_errors: dict[str, str] = {}
        self.warnings: list[dict[str, Any]] = []
        self.served = False
        self.streaming: pytest.Session | None = None
        """The session while a test runs (its reports are sent as they come), else None."""

    # -- pytest hooks ------------------------------------------------------------------------
    def pytest_configure(self, config: pytest.Config) -> None:
        """Set the options the host passed by name (report options, those of the project's conftest.py files)."""
        for dest, value in self.spec.get("options", {}).items():
            setattr(config.option, dest, value)

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.collection_errors[report.nodeid] = report.longreprtext

    def pytest_runtest_logreport(self, report: Any) -> None:
        if self.streaming is not None:  # a test runs: each report goes to the host as soon as it is made
            self.channel.send({"op": "report", "report": self.serialized(self.streaming, [report])[0]})

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
        self.channel.send(
            {
                "op": "ready",
                "collected": list(items),
                "errors": self.collection_errors,
                "pid": os.getpid(),
                "python": sys.version.split()[0],
                "pytest": pytest.__version__,
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

    def handle(self, session: pytest.Session, items: dict[str, Any], command: dict[str, Any]) -> dict[str, Any]:
        op = command.get("op")
        nodeid = command.get("nodeid")
        if op not in ("prepare", "run", "teardown"):
            return {"op": "error", "message": f"unknown command {op!r}"}
        item = items.get(nodeid) if isinstance(nodeid, str) else None
        if item is None:
            return {"op": "error", "message": f"the guest's pytest did not collect {nodeid!r}"}
        if op == "prepare":
            group = [items[other] for other in command.get("group", ()) if other in items]
            return self.prepare(session, item, group)
        if op == "run":
            return self.run(session, item, fresh=bool(command.get("fresh")))
        return self.teardown(session, item, items.get(command.get("next") or ""), last=command.get("next") is None)

    def prepare(self, session: pytest.Session, item: Any, group: list[Any]) -> dict[str, Any]:
        """Set up the item's collectors up to its file, then the inherited fixtures of it and its group."""
        outcomes = _outcome_exceptions()
        setupstate = session._setupstate
        scope_node = file_node(item)
        errors: list[str] = []
        try:
            setupstate.teardown_exact(scope_node)  # normally done already, after the previous test
        except outcomes as exc:
            errors.append(f"tearing down before {item.nodeid}: {exc!r}")
        try:
            setupstate.setup(scope_node)
        except outcomes as exc:  # kept in the stack: each child's test raises it again
            errors.append(f"setting up {scope_node.nodeid}: {exc!r}")
        warmed: list[str] = []
        for other in [item, *group]:
            warmed += self.warm(setupstate, other, errors, first=other is item)
        return {"op": "prepared", "fixtures": warmed, "errors": errors}

    def warm(self, setupstate: Any, item: Any, errors: list[str], *, first: bool) -> list[str]:
        """Compute the session-, package- and module-scoped fixtures of ``item`` in this process.

        For the other tests of the group, parametrized fixtures and those
        already computed are left alone: computing one with another parameter
        would tear down the instance the first test needs. The test counts as
        active meanwhile (pytest 9 warns about a fixture requested for a test
        that is not), without its own set-up.
        """
        info = getattr(item, "_fixtureinfo", None)
        request = getattr(item, "_request", None)
        if info is None or not request:
            return []
        outcomes = _outcome_exceptions()
        warmed = []
        active = item not in setupstate.stack
        if active:
            setupstate.stack[item] = ([], None)
        try:
            for name in item.fixturenames:
                definitions = info.name2fixturedefs.get(name)
                if not definitions:
                    continue
                fixturedef = definitions[-1]
                if _scope_of(fixturedef) not in INHERITED_SCOPES:
                    continue
                if not first and (fixturedef.params is not None or fixturedef.cached_result is not None):
                    continue
                try:
                    request.getfixturevalue(name)
                except outcomes as exc:  # cached by the fixture: raised again in each child that needs it
                    errors.append(f"fixture {name!r} of {item.nodeid}: {exc!r}")
                    break  # the fixtures after it may depend on it
                warmed.append(name)
        finally:
            if active:
                del setupstate.stack[item]
            reset = getattr(item, "_initrequest", None)
            if reset is not None:
                reset()  # the test's own request starts clean in every child
        return warmed

    def run(self, session: pytest.Session, item: Any, *, fresh: bool) -> dict[str, Any]:
        """Run one test through pytest's protocol; its teardown stops at its file unless it is ``fresh``.

        Each report is sent as soon as pytest makes it (``report``), so the
        host knows how far the test got if its VM dies; ``done`` ends the run
        with the warnings it recorded.
        """
        self.warnings = []
        nextitem = None if fresh else file_node(item)
        self.streaming = session
        try:
            session.config.hook.pytest_runtest_protocol(item=item, nextitem=nextitem)
        finally:
            self.streaming = None
            sys.stdout.flush()
            sys.stderr.flush()
        return {"op": "done", "warnings": self.warnings}

    def teardown(self, session: pytest.Session, item: Any, next_item: Any, *, last: bool) -> dict[str, Any]:
        """Tear down in this process what the next test does not share (everything after the last one).

        The parent never ran ``item`` (its children did), so this is not the
        test's teardown hook: only the collectors' and fixtures' finalizers
        run, under output capture, and ``item`` names the report.
        """
        if last:
            target = None
        elif next_item is not None:
            target = file_node(next_item)
        else:  # a test the guest does not run next (on the host, or not collected here): keep the session
            target = session
        self.warnings = []
        setupstate = session._setupstate
        capture = session.config.pluginmanager.getplugin("capturemanager")
        context = capture.item_capture("teardown", item) if capture is not None else contextlib.nullcontext()
        item._report_sections = []
        with context:
            call = pytest.CallInfo.from_call(lambda: setupstate.teardown_exact(target), when="teardown")
        report = pytest.TestReport.from_item_and_call(item, call)
        return {"op": "torn_down", "report": self.serialized(session, [report])[0], "warnings": self.warnings}

    @staticmethod
    def serialized(session: pytest.Session, reports: list[Any]) -> list[dict[str, Any]]:
        hook = session.config.hook
        return [hook.pytest_report_to_serializable(config=session.config, report=report) for report in reports]


def main(argv: list[str] | None = None) -> int:
    """``python3 isolate_runner.py SPEC``: collect the suite, then serve the host's commands."""
    arguments = sys.argv[1:] if argv is None else argv
    if len(arguments) != 1:
        print("usage: python3 isolate_runner.py SPEC.json", file=sys.stderr)
        return 4
    channel = Channel.from_stdio()
    try:
        with open(arguments[0], encoding="utf-8") as spec_file:
            spec = json.load(spec_file)
        if os.path.dirname(os.path.abspath(__file__)) in sys.path[:1]:
            del sys.path[0]  # this file's directory: not the project's
        for entry in reversed(spec.get("sys_path", [])):
            sys.path.insert(0, entry)
    except BaseException:
        channel.send({"op": "error", "message": traceback.format_exc()})
        return 3
    runner = Runner(channel, spec)
    try:
        status = int(pytest.main(list(spec["args"]), plugins=[runner]))
    except BaseException:
        channel.send({"op": "error", "message": traceback.format_exc()})
        return 3
    if not runner.served:
        channel.send(
            {
                "op": "error",
                "message": f"the guest's pytest ended with status {status} before collecting the tests",
                "status": status,
            }
        )
    return status


if __name__ == "__main__":
    sys.exit(main())
