"""The in-guest runner of ``pytest --forkd-isolate``, run on the host: a pytest process answering JSON commands.

No VM: the runner is plain Python over its stdin and stdout, so these tests
start it as a host subprocess with the host's pytest and speak its protocol.
What a VM adds (forking the waiting process into children) is tested in
tests/plugin/test_isolate_vms.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from pytest_forkd.guest import GUEST_DIR

pytestmark = pytest.mark.slow  # each test starts a pytest process

RUNNER = GUEST_DIR / "isolate_runner.py"

SUITE = """\
import os
import pytest

EVENTS = os.environ["EVENTS"]


def log(line):
    with open(EVENTS, "a") as events:
        events.write(line + "\\n")


@pytest.fixture(scope="session")
def resource():
    log("session setup")
    yield [1]
    log("session teardown")


@pytest.fixture(scope="module")
def module_thing(resource):
    log("module setup")
    yield "thing"
    log("module teardown")


@pytest.fixture(scope="module")
def broken_module_fixture():
    raise RuntimeError("module fixture broke")


def test_uses_both(resource, module_thing):
    log("test_uses_both")
    assert resource == [1]


def test_fails_with_introspection(resource):
    assert [1, 2, 3] == [1, 5, 3]


def test_needs_the_broken_fixture(broken_module_fixture):
    pass


def test_warns():
    import warnings
    warnings.warn(UserWarning("careful"))
"""


class Runner:
    """A runner subprocess and its protocol; each one ends with the test that started it."""

    started: ClassVar[list[Runner]] = []

    def __init__(self, project: Path, args: list[str]) -> None:
        Runner.started.append(self)
        spec = project / "spec.json"
        spec.write_text(json.dumps({"args": args, "report_options": {"verbose": 0}, "sys_path": [str(project)]}))
        self.events = project / "events.log"
        self.process = subprocess.Popen(
            [sys.executable, str(RUNNER), str(spec)],
            cwd=project,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={"EVENTS": str(self.events), "PATH": "/usr/bin:/bin"},
        )

    def read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line, self.stderr()
        message: dict[str, Any] = json.loads(line)
        return message

    def send(self, **command: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command).encode() + b"\n")
        self.process.stdin.flush()

    def run(self, nodeid: str, fresh: bool = False) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        self.send(op="run", nodeid=nodeid, fresh=fresh)
        reports = []
        while True:
            message = self.read()
            if message["op"] != "report":
                return reports, message
            reports.append(message["report"])

    def stderr(self) -> str:
        self.process.kill()
        _, err = self.process.communicate(timeout=30)
        return err.decode(errors="replace")

    def close(self) -> None:
        """Kill the runner if it still runs, reap it and close its pipes."""
        with self.process:
            self.process.kill()

    def events_so_far(self) -> list[str]:
        return self.events.read_text().splitlines() if self.events.exists() else []


@pytest.fixture
def runner(tmp_path: Path) -> Runner:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_suite.py").write_text(SUITE)
    return Runner(
        tmp_path,
        ["--rootdir", str(tmp_path), "-o", "addopts=", "-p", "no:cacheprovider", "-p", "no:terminal",
         "-p", "no:forkd", "-p", "no:xdist", "-p", "no:randomly", str(tmp_path / "test_suite.py")],
    )  # fmt: skip


@pytest.fixture(autouse=True)
def _runners_end_with_their_test() -> Iterator[None]:
    yield
    while Runner.started:
        Runner.started.pop().close()


def test_it_collects_then_reports_ready(runner: Runner) -> None:
    ready = runner.read()
    assert ready["op"] == "ready", runner.stderr()
    assert ready["collected"] == [
        "test_suite.py::test_uses_both",
        "test_suite.py::test_fails_with_introspection",
        "test_suite.py::test_needs_the_broken_fixture",
        "test_suite.py::test_warns",
    ]
    assert ready["errors"] == {}
    assert runner.events_so_far() == []  # collecting sets nothing up


def test_prepare_sets_up_the_inherited_fixtures_once_and_a_test_reuses_them(runner: Runner) -> None:
    runner.read()
    runner.send(op="prepare", nodeid="test_suite.py::test_uses_both", group=["test_suite.py::test_warns"])
    prepared = runner.read()
    assert prepared["op"] == "prepared"
    assert {"resource", "module_thing"} <= set(prepared["fixtures"])
    assert runner.events_so_far() == ["session setup", "module setup"]
    reports, done = runner.run("test_suite.py::test_uses_both")
    assert done["op"] == "done"
    assert [(report["when"], report["outcome"]) for report in reports] == [
        ("setup", "passed"),
        ("call", "passed"),
        ("teardown", "passed"),
    ]
    # The test's teardown stops at its module: the parent's set-up is torn down by the parent, once.
    assert runner.events_so_far() == ["session setup", "module setup", "test_uses_both"]


def test_a_failing_assert_comes_back_with_pytests_introspection(runner: Runner) -> None:
    runner.read()
    reports, _ = runner.run("test_suite.py::test_fails_with_introspection")
    call = next(report for report in reports if report["when"] == "call")
    assert call["outcome"] == "failed"
    assert call["$report_type"] == "TestReport"
    assert "At index 1 diff: 2 != 5" in call["longrepr"]["reprcrash"]["message"]


def test_a_fixture_error_in_the_parent_is_raised_again_by_the_test_that_needs_it(runner: Runner) -> None:
    runner.read()
    runner.send(op="prepare", nodeid="test_suite.py::test_needs_the_broken_fixture", group=[])
    prepared = runner.read()
    assert any("module fixture broke" in error for error in prepared["errors"])
    reports, _ = runner.run("test_suite.py::test_needs_the_broken_fixture")
    setup = reports[0]
    assert (setup["when"], setup["outcome"]) == ("setup", "failed")
    assert "module fixture broke" in json.dumps(setup["longrepr"])


def test_teardown_in_the_parent_reports_what_the_finalizers_did(runner: Runner) -> None:
    runner.read()
    runner.send(op="prepare", nodeid="test_suite.py::test_uses_both", group=[])
    runner.read()
    runner.send(op="teardown", nodeid="test_suite.py::test_uses_both", next=None)
    torn_down = runner.read()
    assert torn_down["op"] == "torn_down"
    assert (torn_down["report"]["when"], torn_down["report"]["outcome"]) == ("teardown", "passed")
    assert runner.events_so_far() == ["session setup", "module setup", "module teardown", "session teardown"]


def test_a_warning_of_the_test_comes_back_with_its_reports(runner: Runner) -> None:
    runner.read()
    _, done = runner.run("test_suite.py::test_warns")
    assert [(warning["category"], warning["message"]) for warning in done["warnings"]] == [("UserWarning", "careful")]


def test_an_unknown_test_or_command_is_an_error_reply_and_the_runner_goes_on(runner: Runner) -> None:
    runner.read()
    runner.send(op="run", nodeid="test_suite.py::test_missing")
    assert runner.read() == {
        "op": "error",
        "message": "the guest's pytest did not collect 'test_suite.py::test_missing'",
    }
    runner.send(op="dance", nodeid="test_suite.py::test_warns")
    assert runner.read()["op"] == "error"
    _, done = runner.run("test_suite.py::test_warns")
    assert done["op"] == "done"


def test_exit_ends_the_process_and_pytest_tears_down_what_is_left(runner: Runner) -> None:
    runner.read()
    runner.send(op="prepare", nodeid="test_suite.py::test_uses_both", group=[])
    runner.read()
    runner.send(op="exit")
    assert runner.process.wait(timeout=60) == 0
    assert runner.events_so_far()[-2:] == ["module teardown", "session teardown"]


def test_a_usage_error_of_the_guests_pytest_is_reported_before_collection(tmp_path: Path) -> None:
    (tmp_path / "test_x.py").write_text("def test_x():\n    pass\n")
    runner = Runner(tmp_path, ["--no-such-option", str(tmp_path / "test_x.py")])
    message = runner.read()
    assert message["op"] == "error"
    assert "before collecting the tests" in message["message"]
    assert runner.process.wait(timeout=60) == 4
    assert "--no-such-option" in runner.stderr()


def test_a_test_cannot_write_into_the_protocol_channel(tmp_path: Path) -> None:
    (tmp_path / "test_x.py").write_text(
        "import os, sys\n\ndef test_prints():\n    print('to stdout')\n    os.write(1, b'raw fd 1\\n')\n"
    )
    runner = Runner(
        tmp_path, ["-p", "no:cacheprovider", "-p", "no:terminal", "--capture=no", str(tmp_path / "test_x.py")]
    )
    runner.read()
    reports, done = runner.run("test_x.py::test_prints")
    assert [report["outcome"] for report in reports] == ["passed"] * 3
    assert done["op"] == "done"
    runner.send(op="exit")
    assert runner.process.wait(timeout=60) == 0
    assert runner.process.stderr is not None
    assert "raw fd 1" in runner.process.stderr.read().decode()


# -- the suite's configuration and the project's code, as on the host ----------------------------------
CONFIGURED_CONFTEST = """\
import pytest

SEEN = []


def pytest_addoption(parser):
    parser.getgroup("flavours").addoption("--flavour", default="mild")


def pytest_configure(config):
    SEEN.append(config.getoption("flavour"))
"""

CONFIGURED_SUITE = """\
import os
import uuid

import conftest
import pytest


def test_saw_the_option():
    assert conftest.SEEN == ["spicy"]


class TestShared:
    @classmethod
    def setup_class(cls):
        with open(os.environ["EVENTS"], "a") as events:
            events.write("setup_class\\n")

    @pytest.fixture(scope="class")
    def token(self):
        return uuid.uuid4().hex

    def test_one(self, token):
        pass

    def test_two(self, token):
        pass
"""

BASE_ARGS = ["-o", "addopts=", "-p", "no:cacheprovider", "-p", "no:terminal", "-p", "no:forkd", "-p", "no:xdist",
             "-p", "no:randomly"]  # fmt: skip


def configured(tmp_path: Path, **spec: Any) -> Runner:
    (tmp_path / "conftest.py").write_text(CONFIGURED_CONFTEST)
    (tmp_path / "test_configured.py").write_text(CONFIGURED_SUITE)
    runner = Runner(tmp_path, ["--rootdir", str(tmp_path), *BASE_ARGS, str(tmp_path / "test_configured.py")])
    if spec:
        runner.close()
        full = {
            "args": ["--rootdir", str(tmp_path), *BASE_ARGS, str(tmp_path / "test_configured.py")],
            "report_options": {"verbose": 0},
            "sys_path": [str(tmp_path)],
            **spec,
        }
        (tmp_path / "spec.json").write_text(json.dumps(full))
        runner.process = subprocess.Popen(
            [sys.executable, str(RUNNER), str(tmp_path / "spec.json")],
            cwd=tmp_path,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={"EVENTS": str(runner.events), "PATH": "/usr/bin:/bin"},
        )
    return runner


def test_options_are_set_before_the_conftests_pytest_configure(tmp_path: Path) -> None:
    runner = configured(tmp_path, options={"flavour": "spicy"})
    assert runner.read()["op"] == "ready", runner.stderr()
    reports, _ = runner.run("test_configured.py::test_saw_the_option", fresh=True)
    assert [report["outcome"] for report in reports] == ["passed"] * 3, reports
    runner.process.kill()


def test_an_option_the_guests_plugins_do_not_know_stops_the_run_naming_it(tmp_path: Path) -> None:
    runner = configured(tmp_path, options={"flavour": "spicy", "timeout": 5.0})
    message = runner.read()
    assert (message["op"], message["kind"], message["options"]) == ("error", "options", ["timeout"])
    assert runner.process.wait(timeout=60) == 4


def test_a_plugin_named_with_p_that_the_guest_lacks_stops_the_run(tmp_path: Path) -> None:
    (tmp_path / "test_x.py").write_text("def test_x():\n    pass\n")
    runner = Runner(tmp_path, ["-p", "pytester", "-p", "no_such_plugin_here", str(tmp_path / "test_x.py")])
    message = runner.read()
    assert (message["op"], message["kind"], message["plugins"]) == ("error", "plugins", ["no_such_plugin_here"])


def test_a_project_package_found_elsewhere_stops_the_run_naming_both_places(tmp_path: Path) -> None:
    runner = configured(tmp_path, project_modules={"json": str(tmp_path / "json")})
    message = runner.read()
    assert (message["op"], message["kind"]) == ("error", "imports"), message
    (line,) = message["lines"]
    assert "'json'" in line and str(tmp_path / "json") in line and "/json" in line.split(" from ")[1]


def test_the_projects_entries_come_first_before_pytest_is_imported(tmp_path: Path) -> None:
    """A package of the project shadows an installed one of the same name, as on the host (pluggy's own suite)."""
    (tmp_path / "src" / "iniconfig").mkdir(parents=True)
    (tmp_path / "src" / "iniconfig" / "__init__.py").write_text("raise ImportError('the project copy was imported')\n")
    runner = configured(tmp_path, sys_path=[str(tmp_path / "src"), str(tmp_path)])
    message = runner.read()
    assert message["op"] == "error" and "the project copy was imported" in message["message"], message


def test_class_scoped_set_up_is_done_once_in_the_parent_when_the_host_names_the_class(tmp_path: Path) -> None:
    runner = configured(tmp_path, options={"flavour": "spicy"})
    runner.read()
    scope = "test_configured.py::TestShared"
    runner.send(op="prepare", nodeid=f"{scope}::test_one", group=[f"{scope}::test_two"], scope=scope)
    prepared = runner.read()
    assert prepared["op"] == "prepared" and "token" in prepared["fixtures"], prepared
    assert runner.events_so_far() == ["setup_class"]
    for name in ("test_one", "test_two"):  # in one process here; each in a child of the parent's branch in a run
        runner.send(op="run", nodeid=f"{scope}::{name}", fresh=False, scope=scope)
        outcomes = []
        while (message := runner.read())["op"] == "report":
            outcomes.append(message["report"]["outcome"])
        assert outcomes == ["passed"] * 3, message
    assert runner.events_so_far() == ["setup_class"]  # the class stayed set up: its teardown is the parent's


def test_a_pooled_childs_warm_up_is_answered_without_a_test(runner: Runner) -> None:
    runner.read()
    runner.send(op="warm")
    assert runner.read() == {"op": "warm"}
    _, done = runner.run("test_suite.py::test_warns")
    assert done["op"] == "done"
