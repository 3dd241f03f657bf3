"""The plugin against real VMs: pytest suites run in a subprocess (pytester), with and without xdist.

After every inner run, ``run_forkd`` checks that no process still uses the
run's private shm directory and that no run directory is left in it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vm

FORKD = str(Path(sys.executable).parent / "forkd")

CONFTEST = """
import pytest


@pytest.fixture(scope="session", autouse=True)
def prepared(forkd_parent):
    forkd_parent.exec("echo prepared-in-parent > /etc/prepared", check=True)
"""

SUITE = """
import pytest

children = []


def test_writes_a_file(forkd_vm):
    assert forkd_vm.exec("test -e /root/leak").exit_code == 1
    forkd_vm.exec("echo x > /root/leak", check=True)


def test_file_of_previous_test_is_absent(forkd_vm):
    assert forkd_vm.exec("test -e /root/leak").exit_code == 1
    assert forkd_vm.read_file("/etc/prepared") == b"prepared-in-parent\\n"


def test_guest_crash(forkd_vm):
    forkd_vm.exec("echo before-crash")
    forkd_vm.exec("echo c > /proc/sysrq-trigger")


def test_next_vm_is_healthy(forkd_vm):
    assert forkd_vm.exec("cat /etc/prepared").stdout == "prepared-in-parent\\n"


def test_checkpoint_rollback_and_fan_out(forkd_vm, forkd_checkpoint):
    forkd_vm.exec("mkdir -p /srv && echo data > /srv/f", check=True)
    with forkd_checkpoint(forkd_vm):
        forkd_vm.exec("rm -rf /srv", check=True)
    assert forkd_vm.read_file("/srv/f") == b"data\\n"
    checkpoint = forkd_checkpoint(forkd_vm)
    children.extend(checkpoint.fork(2))
    assert [child.read_file("/srv/f") for child in children] == [b"data\\n", b"data\\n"]


def test_checkpoint_children_died_with_their_test(forkd_vm):
    assert len(children) == 2 and all(child.closed for child in children)


@pytest.mark.forkd(backend="full")
def test_marker_backend(forkd_vm, forkd_checkpoint):
    assert forkd_checkpoint(forkd_vm).snapshot.backend == "full"
    assert forkd_vm.checkpoint().snapshot.backend == "full"


@pytest.mark.forkd_dangerous
def test_dangerous(forkd_vm, forkd_dangerous_checkpoint):
    forkd_vm.exec("rm -rf /etc/prepared", check=True)
    forkd_dangerous_checkpoint.rollback()
    assert forkd_vm.exec("cat /etc/prepared").ok
"""


def test_clean_vm_per_test_parent_state_and_crash(pytester, run_forkd):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_suite=SUITE)
    result = run_forkd("-v")
    result.assert_outcomes(passed=7, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*test_guest_crash FAILED*",
            "*test_next_vm_is_healthy PASSED*",
        ]
    )
    # The failure report shows the VM's last commands and the crash.
    result.stdout.fnmatch_lines(
        [
            "*GuestCrashed: VM child*: guest died while running 'echo c > /proc/sysrq-trigger'*",
            "*- forkd VM child* -*",
            "*exit 0 * ms  echo before-crash",
            "*no answer * ms  echo c > /proc/sysrq-trigger",
        ]
    )
    result.stdout.fnmatch_lines(["*fixture_overhead_ms per test (forkd_vm setup + teardown): p50 *"])


def test_xdist_builds_each_snapshot_once(pytester, run_forkd):
    pytester.makefile(".yaml", forkd="snapshots:\n  xdist-shared:\n    setup: ['echo shared > /etc/shared']\n")
    pytester.makeini("[pytest]\nforkd_snapshot = xdist-shared\n")
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        test_suite=SUITE.replace(
            "@pytest.mark.forkd_dangerous", "@pytest.mark.forkd_dangerous\n@pytest.mark.forkd_budget(exec_ms=60000)"
        )
    )
    pytester.makepyfile(
        test_shared="""
        import pytest

        @pytest.mark.parametrize("n", range(4))
        def test_sees_snapshot_and_parent(forkd_vm, n):
            assert forkd_vm.read_file("/etc/shared") == b"shared\\n"
            assert forkd_vm.read_file("/etc/prepared") == b"prepared-in-parent\\n"
    """
    )
    result = run_forkd("-p", "xdist", "-n", "2", "-p", "no:randomly", "--dist=loadfile")
    result.assert_outcomes(passed=11, failed=1)
    built = [line for line in result.outlines if line.startswith("snapshot 'xdist-shared': built in")]
    cached = [line for line in result.outlines if line.startswith("snapshot 'xdist-shared': cached")]
    assert len(built) == 1 and len(cached) == 1, result.outlines
    # Timing samples of both workers reach the controller's summary.
    fork_row = next(line for line in result.outlines if line.startswith("fork "))
    assert int(fork_row.split()[1]) >= 10


def test_second_run_reuses_cached_snapshots_and_recipe_changes_rebuild(pytester, run_forkd, tmp_path):
    recipe = "snapshots:\n  tools:\n    from: base\n    files: {tool.sh: /usr/local/bin/tool}\n    setup: [%s]\n"
    pytester.makefile(".sh", tool="#!/bin/sh\necho tool-v1\n").chmod(0o755)
    pytester.makefile(".yaml", forkd=recipe % "'tool > /etc/tool-out'")
    pytester.makepyfile(
        test_tools="""
        import pytest

        @pytest.mark.forkd(snapshot="tools")
        def test_tools(forkd_vm):
            assert forkd_vm.read_file("/etc/tool-out") in (b"tool-v1\\n", b"tool-v2\\n")

        @pytest.mark.forkd(memory_mib=320)
        def test_memory(forkd_vm):
            assert forkd_vm.memory_mib == 320
            assert "MemTotal" in forkd_vm.read_file("/proc/meminfo").decode()
    """
    )
    first = run_forkd("-s", f"--forkd-json={tmp_path / 'first.json'}", store=tmp_path / "store")
    first.assert_outcomes(passed=2)
    first.stdout.fnmatch_lines(
        [
            "*forkd: building snapshot 'base' from image 'default'*",
            "*forkd: building snapshot 'tools' from 'base' (1 setup command)...*",
        ]
    )
    first.stdout.fnmatch_lines(["*forkd: building snapshot 'base-m320' from image 'default'*"])

    second = run_forkd("-s", f"--forkd-json={tmp_path / 'second.json'}", store=tmp_path / "store")
    second.assert_outcomes(passed=2)
    second.stdout.fnmatch_lines(["*forkd: using cached snapshot 'tools'*"])
    second.stdout.fnmatch_lines(["*forkd: using cached snapshot 'base-m320'*"])
    second.stdout.no_fnmatch_line("*building snapshot*")
    ops = {sample["op"] for sample in json.loads((tmp_path / "second.json").read_text())["samples"]}
    assert "boot" not in ops and "fork" in ops

    pytester.makefile(".sh", tool="#!/bin/sh\necho tool-v2\n")  # a file the recipe copies in changed (mode kept)
    third = run_forkd("-s", store=tmp_path / "store")
    third.assert_outcomes(passed=2)
    third.stdout.fnmatch_lines(
        ["*forkd: using cached snapshot 'base'*", "*forkd: building snapshot 'tools' from 'base'*"]
    )


def test_setup_failure_names_snapshot_command_and_status(pytester, run_forkd):
    pytester.makefile(".yaml", forkd="snapshots:\n  broken:\n    setup: ['true', 'echo oops >&2; exit 3']\n")
    pytester.makepyfile("def test_x(forkd_vm): pass")
    result = run_forkd("--forkd-snapshot=broken")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        ["*building snapshot 'broken': setup[[]1[]] `echo oops >&2; exit 3` exited with status 3:*", "*oops*"]
    )


def test_keep_failed_saves_the_vm_for_forkd_shell(pytester, run_forkd, shared_store, check_nothing_left):
    pytester.makepyfile(
        test_keep="""
        def test_boom(forkd_vm):
            forkd_vm.exec("mkdir -p /root/case && echo evidence > /root/case/notes", check=True)
            assert False, "the agent broke something"
    """
    )
    result = run_forkd("--forkd-keep-failed")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*- forkd kept VM -*",
            f"*saved as snapshot 'failed-test_boom' in {shared_store}; open it with*",
            f"*forkd shell failed-test_boom --store {shared_store}*",
            f"*forkd exec --snapshot failed-test_boom --store {shared_store} -- CMD*",
        ]
    )
    executed = subprocess.run(
        [
            FORKD,
            "exec",
            "--snapshot",
            "failed-test_boom",
            "--store",
            str(shared_store),
            "--",
            "cat",
            "/root/case/notes",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (executed.returncode, executed.stdout) == (0, "evidence\n"), executed.stderr
    shell = subprocess.run(
        [FORKD, "shell", "failed-test_boom", "--store", str(shared_store)],
        input="cd /root/case\npwd\ncat notes\nls /missing\nexit\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shell.stdout == "/root/case\nevidence\n", shell.stderr
    assert "[exit 1]" in shell.stderr
    check_nothing_left()


def test_budget_violation_fails_the_run_and_names_the_test(pytester, run_forkd, tmp_path):
    pytester.makepyfile(
        test_budget="""
        import pytest

        def test_within(forkd_vm):
            forkd_vm.exec("true")

        @pytest.mark.forkd_budget(exec_ms=0.001)
        def test_too_slow(forkd_vm):
            forkd_vm.exec("true")
    """
    )
    report = tmp_path / "report.json"
    result = run_forkd(f"--forkd-json={report}", "--forkd-save=first")
    result.assert_outcomes(passed=1, failed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "*latency budget violations (exit status 1):*",
            "*test_budget.py::test_too_slow * exec * max * 0.001 *marker on test_budget.py::test_too_slow*",
        ]
    )
    document = json.loads(report.read_text())
    assert [violation["test"] for violation in document["violations"]] == ["test_budget.py::test_too_slow"]
    assert {sample["test"] for sample in document["samples"] if sample["op"] == "exec"} == {
        "test_budget.py::test_within",
        "test_budget.py::test_too_slow",
    }

    compared = run_forkd("--forkd-compare=first", "--forkd-budget=fork.max=600000")
    compared.assert_outcomes(passed=1, failed=1)
    assert compared.ret == pytest.ExitCode.TESTS_FAILED  # the marker budget still fails
    compared.stdout.fnmatch_lines(["*compared with 0001_first:*"])


def test_xdist_worker_death_leaves_nothing_behind(pytester, run_forkd):
    pytester.makepyfile(
        test_kill="""
        import os
        import signal

        def test_worker_dies(forkd_vm, forkd_parent):
            forkd_vm.exec("true")
            os.kill(os.getpid(), signal.SIGKILL)

        def test_other(forkd_vm):
            assert forkd_vm.exec("true").ok
    """
    )
    result = run_forkd("-p", "xdist", "-n", "2")  # run_forkd checks that no QEMU and no run directory is left
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*worker 'gw*' crashed while running*test_worker_dies*"])
