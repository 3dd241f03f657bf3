"""Every kind of report, made by the guest's pytest and read back by the host's, against a plain host run.

The in-guest runner (``pytest_forkd/guest/isolate_runner.py``) runs a suite
with every outcome pytest has (pass with output, logs and a property, fail,
skip, skipif, xfail, xpass, strict xpass, errors in setup and in teardown,
``record_xml_attribute`` and ``record_testsuite_property``) with Debian
bookworm's pytest 7.2 (the guest's, on the host: no VM needed) and with the
host's own. The host's pytest then logs those reports through
:mod:`pytest_forkd.isolate.reports` instead of running the tests, with
``--junitxml`` and ``-rA``, and its junit XML, short summary and ``--lf``
must be those of the host running the suite itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

import pytest
from isolate_support import guest_pytest, guest_python

from pytest_forkd.guest import GUEST_DIR

pytestmark = pytest.mark.slow  # pytest processes, and a download of pytest 7.2 the first time

pytest_plugins = ["pytester"]

SUITE = """
import logging

import pytest


@pytest.fixture
def broken_setup():
    raise RuntimeError("setup broke")


@pytest.fixture
def broken_teardown():
    yield
    raise RuntimeError("teardown broke")


def test_passes(record_property):
    record_property("answer", 42)
    print("to stdout")
    logging.getLogger("suite").warning("logged")


def test_fails():
    assert [1, 2, 3] == [1, 5, 3]


def test_skips():
    pytest.skip("not here")


@pytest.mark.skipif(True, reason="never")
def test_skipif():
    pass


@pytest.mark.xfail(reason="known bug")
def test_xfails():
    assert 0


@pytest.mark.xfail(reason="fixed already")
def test_xpasses():
    pass


@pytest.mark.xfail(strict=True, reason="strictly")
def test_xpasses_strictly():
    pass


def test_errors_in_setup(broken_setup):
    pass


def test_errors_in_teardown(broken_teardown):
    pass


def test_records_xml(record_xml_attribute, record_testsuite_property):
    record_xml_attribute("owner", "team-a")
    record_testsuite_property("build", "17")
"""

#: A conftest.py that logs the reports the runner made instead of running the tests.
REPLAY = """
import json

import pytest

from pytest_forkd.isolate import reports

RUNS = json.loads(open({runs!r}).read())


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    run = RUNS[item.nodeid]
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    logged = [reports.from_guest(item.config, item, data) for data in run["reports"]]
    reports.write_junit_records(item.config, item, run["recorded"])
    for warning in run["recorded"]["warnings"]:
        reports.replay_warning(item.config, item, warning)
    for report in logged:
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True
"""

NODEIDS = [
    f"test_suite.py::{name}"
    for name in (
        "test_passes",
        "test_fails",
        "test_skips",
        "test_skipif",
        "test_xfails",
        "test_xpasses",
        "test_xpasses_strictly",
        "test_errors_in_setup",
        "test_errors_in_teardown",
        "test_records_xml",
    )
]


def guest_runs(command: list[str], env: dict[str, str], project: Path) -> dict[str, Any]:
    """Each test run by the runner, as the host's parent receives it: its reports and what it recorded."""
    spec = {
        "args": ["--rootdir", str(project), "-o", "addopts=", "-p", "no:cacheprovider", "-p", "no:terminal",
                 "-p", "no:forkd", "-p", "no:xdist", "-p", "no:randomly", str(project / "test_suite.py")],
        "report_options": {"verbose": 0, "tbstyle": "auto"},
        "sys_path": [str(project)],
        "junit_family": "xunit1",
    }  # fmt: skip
    (project / "spec.json").write_text(json.dumps(spec))
    process = subprocess.Popen(
        [*command, str(GUEST_DIR / "isolate_runner.py"), str(project / "spec.json")],
        cwd=project,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdin is not None and process.stdout is not None

    def read() -> dict[str, Any]:
        line = process.stdout.readline()  # type: ignore[union-attr]
        assert line, process.communicate(timeout=30)[1].decode(errors="replace")
        message: dict[str, Any] = json.loads(line)
        return message

    try:
        ready = read()
        assert ready["op"] == "ready", ready
        runs = {}
        for nodeid in NODEIDS:
            process.stdin.write(json.dumps({"op": "run", "nodeid": nodeid, "fresh": True}).encode() + b"\n")
            process.stdin.flush()
            reports = []
            while (message := read())["op"] == "report":
                reports.append(message["report"])
            assert message["op"] == "done", message
            runs[nodeid] = {"reports": reports, "recorded": message}
        process.stdin.write(b'{"op": "exit"}\n')
        process.stdin.flush()
        assert process.wait(timeout=60) in (0, 1)  # 1: some tests failed, as pytest says
        return runs
    finally:
        with process:  # reaped, and its pipes closed
            process.kill()


def junit(path: Path) -> dict[str, Any]:
    """What a junit XML says about each test case and the suite, without times."""
    root = ElementTree.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    assert suite is not None
    cases = {}
    for case in suite.iter("testcase"):
        outcome = [
            (child.tag, child.get("type"), (child.get("message") or "").splitlines()[:1])
            for child in case
            if child.tag in ("failure", "error", "skipped")
        ]
        cases[case.get("name")] = {
            "attributes": {key: value for key, value in case.attrib.items() if key not in ("time",)},
            "outcome": outcome,
            "properties": [(p.get("name"), p.get("value")) for p in case.iter("property")],
            "system-out": [(child.text or "").strip() for child in case if child.tag == "system-out"],
        }
    counts = {key: suite.get(key) for key in ("tests", "failures", "errors", "skipped")}
    properties = [(p.get("name"), p.get("value")) for p in suite.findall("properties/property")]
    return {"cases": cases, "counts": counts, "properties": properties}


def summary(result: pytest.RunResult) -> list[str]:
    """The -rA short summary: outcome and test (the reasons' wording belongs to each pytest version)."""
    start = result.outlines.index(next(line for line in result.outlines if "short test summary info" in line))
    words = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
    return sorted(" ".join(line.split()[:2]) for line in result.outlines[start:] if line.startswith(words))


@pytest.mark.parametrize("guest", ["pytest 7.2 (Debian bookworm's)", "the host's pytest"])
def test_the_hosts_reporters_see_the_guests_reports_as_their_own(
    pytester: pytest.Pytester, guest: str, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> None:
    project = tmp_path_factory.mktemp("guest")
    (project / "test_suite.py").write_text(SUITE)
    if guest.startswith("pytest 7.2"):
        command, env = guest_python(guest_pytest())
    else:
        command, env = [sys.executable], {"PATH": "/usr/bin:/bin"}
    runs = guest_runs(command, env, project)
    (pytester.path / "runs.json").write_text(json.dumps(runs))

    pytester.makepyfile(test_suite=SUITE)
    pytester.makeini("[pytest]\njunit_family = xunit1\n")
    monkeypatch.setenv("COLUMNS", "200")
    options = ("-p", "no:randomly", "-p", "no:forkd", "-rA", "-o", "console_output_style=classic")
    plain = pytester.runpytest_subprocess(*options, "--junitxml=plain.xml")
    pytester.makeconftest(REPLAY.format(runs=str(pytester.path / "runs.json")))
    replayed = pytester.runpytest_subprocess(*options, "--junitxml=replayed.xml")
    assert "INTERNALERROR" not in replayed.stdout.str() + replayed.stderr.str(), replayed.stdout.str()[-4000:]
    assert replayed.ret == plain.ret == pytest.ExitCode.TESTS_FAILED
    assert replayed.parseoutcomes() == plain.parseoutcomes(), replayed.stdout.str()[-4000:]
    assert summary(replayed) == summary(plain)
    expected, got = junit(pytester.path / "plain.xml"), junit(pytester.path / "replayed.xml")
    assert got["counts"] == expected["counts"]
    assert got["properties"] == expected["properties"] == [("build", "17")]
    assert got["cases"]["test_records_xml"]["attributes"]["owner"] == "team-a"
    for name, case in expected["cases"].items():
        assert got["cases"][name] == case, name

    # --lf and --sw read the same reports: the failures of the replayed run are the ones run again.
    last_failed = pytester.runpytest_subprocess("-p", "no:randomly", "-p", "no:forkd", "--lf", "--co", "-q")
    selected = sorted(line for line in last_failed.outlines if line.startswith("test_suite.py::"))
    assert selected == [
        "test_suite.py::test_errors_in_setup",
        "test_suite.py::test_errors_in_teardown",
        "test_suite.py::test_fails",
        "test_suite.py::test_xpasses_strictly",
    ]
