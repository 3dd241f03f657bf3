"""A snapshot's build against real VMs: kept apart from the tests' timings, shown with progress.

On the run that builds it, a snapshot whose set-up sleeps 3 s must not
break ``--forkd-budget=exec.max=2000``, nor on the next run that finds it
cached; the build has its own row in the summary and the HTML report.
"""

from __future__ import annotations

import json
import re

import pytest

pytestmark = pytest.mark.vm

FORKD_YAML = "snapshots:\n  slow:\n    from: base\n    setup:\n      - sleep 3\n"
SUITE = """
import pytest

def test_plain(forkd_vm):
    assert forkd_vm.exec("echo hi").stdout == "hi\\n"

@pytest.mark.forkd_budget(exec_ms=60000)
def test_with_its_own_budget(forkd_vm):
    assert forkd_vm.exec("true").ok
"""


def test_a_snapshot_build_counts_against_no_budget(pytester, run_forkd, tmp_path):
    pytester.makefile(".yaml", forkd=FORKD_YAML)
    pytester.makepyfile(test_suite=SUITE)
    store = tmp_path / "empty-store"
    args = ("--forkd-snapshot=slow", "--forkd-budget=exec.max=2000")

    building = run_forkd(*args, "--forkd-json=build.json", "--forkd-report=build.html", store=store)
    building.assert_outcomes(passed=2)
    assert building.ret == pytest.ExitCode.OK
    building.stdout.fnmatch_lines(
        [
            "forkd: building snapshot 'slow' from 'base' (1 setup command)...",
            "forkd: snapshot 'slow' +*: setup[[]1/1[]] $ sleep 3",
            "forkd: snapshot 'slow' +*: saving the snapshot",
            "forkd: built snapshot 'slow' in * s",
        ]
    )
    building.stdout.fnmatch_lines(["exec  *  2  *max<=2000, max<=60000 in 1 test*"])
    building.stdout.fnmatch_lines(["snapshot build  *  2  *not budgeted*"])  # base and slow, both built here
    report = json.loads((pytester.path / "build.json").read_text())
    assert report["violations"] == []
    assert max(sample["ms"] for sample in report["samples"] if sample["op"] == "exec") < 2000
    slow_setup = [s for s in report["build_samples"] if s["op"] == "exec" and s["extra"]["snapshot"] == "slow"]
    assert [sample["ms"] >= 3000 for sample in slow_setup] == [True]
    assert all(sample["test"] is None for sample in report["build_samples"])
    page = (pytester.path / "build.html").read_text(encoding="utf-8")
    assert "id='builds'" in page and ">slow</td><td>built</td>" in page
    assert re.findall(r"data-op='([^']+)'", page)[:2] == ["fork", "exec"]

    cached = run_forkd(*args, store=store)
    cached.assert_outcomes(passed=2)
    assert cached.ret == pytest.ExitCode.OK
    cached.stdout.fnmatch_lines(["forkd: using cached snapshot 'slow'", "snapshot 'slow': cached"])
    cached.stdout.no_fnmatch_line("snapshot build *")
    cached.stdout.no_fnmatch_line("forkd: building *")


def test_the_report_of_a_real_run_renders_in_chromium(pytester, run_forkd, tmp_path):
    from browser import dump_dom, screenshot

    pytester.makepyfile(test_suite=SUITE)
    run_forkd("--forkd-report=run.html", "--forkd-budget=fork.max=60000").assert_outcomes(passed=2)
    page = pytester.path / "run.html"
    dom = dump_dom(page)
    drawn = int(re.search(r'data-forkd-charts="(\d+)"', dom).group(1))
    assert drawn >= 3  # fork, exec, fixture_overhead at least
    boxes = [tuple(int(v) for v in box.split(",")) for box in re.findall(r'data-box="([^"]+)"', dom)]
    image = screenshot(page, tmp_path / "run.png")
    left, top, width, height = boxes[0]
    assert (0x4C, 0x78, 0xA8) in image.colours(left, top, width, height)  # the fork histogram's bars
    assert (0xD6, 0x27, 0x28) in image.colours(left, top, width, height)  # its budget line
