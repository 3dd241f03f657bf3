"""Transcripts in failure reports and files, assertion explanations of Changes, forkd_trajectory (pytester)."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from pytest_forkd.analysis.transcript import read_jsonl

pytestmark = pytest.mark.vm

FORKD = str(Path(sys.executable).parent / "forkd")

SUITE = """
import pytest


def test_agent_breaks_something(forkd_vm):
    forkd_vm.exec("mkdir -p /srv/app && echo v1 > /srv/app/conf", check=True)
    forkd_vm.exec(["sh", "-c", "echo to-stderr >&2; exit 3"], env={"API_TOKEN": "secret-" + "value"}, cwd="/srv")
    forkd_vm.write_file("/srv/app/conf", "v2\\n")
    assert forkd_vm.exec("cat /srv/app/conf").stdout == "v1\\n"


def test_changes_are_explained(forkd_vm):
    checkpoint = forkd_vm.checkpoint()
    forkd_vm.exec("echo new > /root/added", check=True)
    changes = checkpoint.changes(include=("/root",))
    assert changes.added == {"/root/other"}


def test_trajectory_fixture_bisects(forkd_trajectory, forkd_vm):
    forkd_trajectory.run([f"echo {i} >> /root/log" + (" && rm /root/marker" if i == 13 else "")
                          for i in range(1, 31)])
    result = forkd_trajectory.bisect(lambda vm: vm.exec(["test", "-e", "/root/marker"]).exit_code == 0)
    assert result.first_bad == 13 and result.restores <= 6
    assert forkd_vm.exec("wc -l < /root/log").stdout.strip() == "13"


def test_passes(forkd_vm):
    forkd_vm.exec("true", check=True)
"""

CONFTEST = """
import pytest


@pytest.fixture(scope="session", autouse=True)
def prepared(forkd_parent):
    forkd_parent.exec("echo marker > /root/marker", check=True)
"""


def test_transcripts_in_reports_files_and_junit(pytester, run_forkd, tmp_path):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_suite=SUITE)
    out = tmp_path / "transcripts"
    junit = tmp_path / "junit.xml"
    result = run_forkd("-v", f"--forkd-transcript={out}", f"--junitxml={junit}")
    result.assert_outcomes(passed=2, failed=2)
    # The failure report has a transcript section: commands, cwd, env keys (not values), exit codes, output.
    result.stdout.fnmatch_lines(
        [
            "*- forkd transcript child* -*",
            "*exit 0 * ms  mkdir -p /srv/app && echo v1 > /srv/app/conf",
            "*exit 3 * ms  [[]env API_TOKEN[]] (cd /srv) sh -c echo to-stderr >&2; exit 3",
            "*stderr: to-stderr",
            "*write * ms  /srv/app/conf (3 bytes)",
            "*exit 0 * ms  cat /srv/app/conf",
        ]
    )
    assert "secret-value" not in result.stdout.str()
    # Changes explain themselves in an assertion failure.
    result.stdout.fnmatch_lines(
        [
            "*AssertionError: assert *",
            "*unexpected: /root/added",
            "*missing:    /root/other",
        ]
    )
    files = sorted(out.glob("*.jsonl"))
    assert len(files) == 4
    failing = next(path for path in files if "breaks_something" in path.name)
    transcript = read_jsonl(failing)
    assert transcript.header["test"] == "test_suite.py::test_agent_breaks_something"
    assert transcript.header["outcome"] == "failed"
    vm = transcript.vm()
    assert vm["root"]["tag"] == "base"
    inherited = transcript.inherited_entries(vm["name"])
    assert [entry["command"] for entry in inherited] == ["echo marker > /root/marker"]
    own = transcript.own_entries(vm["name"])
    assert [entry["kind"] for entry in own] == ["exec", "exec", "write_file", "exec"]
    failed = own[1]
    assert failed["exit_code"] == 3 and failed["signal"] is None and failed["cwd"] == "/srv"
    assert failed["env_keys"] == ["API_TOKEN"] and "secret-value" not in failing.read_text()
    assert failed["stderr"] == {"bytes": 10, "head": "to-stderr\n", "tail": ""}
    assert failed["duration_ms"] > 0 and failed["truncated"] is False
    assert own[2]["data"]["text"] == "v2\n"
    # junit XML names the file of each test.
    properties = {
        case.get("name"): {p.get("name"): p.get("value") for p in case.iter("property")}
        for case in ET.parse(junit).getroot().iter("testcase")
    }
    assert properties["test_agent_breaks_something"]["forkd_transcript"] == str(failing)
    assert all("forkd_transcript" in props for props in properties.values())
    trajectory = read_jsonl(next(path for path in files if "trajectory" in path.name))
    steps = {entry.get("step") for entry in trajectory.entries if entry.get("kind") == "exec"}
    assert set(range(1, 31)) <= steps
    assert any(entry["kind"] == "restore" for entry in trajectory.entries)
    # forkd bisect replays the recorded trajectory from the root snapshot and finds the same step.
    bisect = subprocess.run(
        [FORKD, "bisect", str(trajectory.path), "--check", "test -e /root/marker", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert bisect.returncode == 0, bisect.stderr
    found = json.loads(bisect.stdout)
    assert found["first_bad"] == 13 and found["step"].startswith("recorded step 13: echo 13 >> /root/log")
    assert found["restores"] <= 7 and found["replayed"]
    # A transcript of another format version is refused with a message naming the versions.
    old = tmp_path / "old.jsonl"
    old.write_text(json.dumps({**transcript.header, "version": 0}) + "\n")
    refused = subprocess.run([FORKD, "bisect", str(old), "--check", "true"], capture_output=True, text=True)
    assert refused.returncode == 1 and "version 0 transcript" in refused.stderr


def test_pytest_html_gets_the_transcript_as_an_extra(pytester, run_forkd, tmp_path):
    pytest.importorskip("pytest_html")
    pytester.makepyfile(
        test_html="""
        def test_fails(forkd_vm):
            forkd_vm.exec("echo from-the-guest-html", check=True)
            assert False
    """
    )
    report = tmp_path / "report.html"
    result = run_forkd(
        "-p", "pytest_html", f"--html={report}", "--self-contained-html", f"--forkd-transcript={tmp_path / 'out'}"
    )
    result.assert_outcomes(failed=1)
    html = report.read_text()
    assert "forkd transcript" in html and "from-the-guest-html" in html
    assert (tmp_path / "out").as_uri() in html
