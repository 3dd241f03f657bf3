"""Latency gates and interruption against real VMs: baselines, budgets, JSON under xdist, Ctrl-C, kill -9."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest
import tenacity
from support import processes_mentioning

pytestmark = pytest.mark.vm

STEADY_SUITE = """
import pytest

@pytest.mark.parametrize("round", range(6))
def test_agent_step(forkd_vm, forkd_checkpoint, round):
    for _ in range(4):
        assert forkd_vm.exec(["true"]).ok
    with forkd_checkpoint(forkd_vm):
        forkd_vm.exec("echo step > /tmp/step", check=True)
"""


@pytest.mark.alone
def test_unchanged_suite_passes_its_own_baseline(pytester, run_forkd):
    pytester.makepyfile(test_steady=STEADY_SUITE)

    first = run_forkd("--forkd-autosave")
    first.assert_outcomes(passed=6)
    assert first.ret == pytest.ExitCode.OK
    saved = sorted((pytester.path / ".forkd" / "benchmarks").glob("*/0001_*.json"))
    assert len(saved) == 1

    # Two real runs minutes apart on a shared 2-core host: an unchanged suite's restore p95 moved by
    # +70% between them, so the tolerance is wide; that the gate catches a slowdown is
    # test_a_several_fold_slowdown_fails_the_compare_gate's job.
    second = run_forkd("--forkd-autosave", "--forkd-compare", "--forkd-compare-fail=p95:200%")
    second.assert_outcomes(passed=6)
    second.stdout.fnmatch_lines(["*compared with 0001_*"])
    assert second.ret == pytest.ExitCode.OK, second.stdout.str()
    assert len(sorted((pytester.path / ".forkd" / "benchmarks").glob("*/0002_*.json"))) == 1


def test_missing_baseline_warns_and_passes(pytester, run_forkd):
    pytester.makepyfile(test_one="def test_one(forkd_vm):\n    assert forkd_vm.exec('true').ok\n")
    result = run_forkd("--forkd-compare", "--forkd-compare-fail=p95:5%")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.OK
    assert "baseline" in result.stdout.str().lower()


def test_branch_pause_budget_violation_names_the_test_and_figure(pytester, run_forkd):
    pytester.makepyfile(
        test_dirty="""
        import pytest

        def test_small_change(forkd_vm, forkd_checkpoint):
            with forkd_checkpoint(forkd_vm):
                forkd_vm.exec("echo x > /tmp/x", check=True)

        @pytest.mark.forkd_budget(branch_pause_ms=1)
        def test_dirties_a_lot_then_branches(forkd_vm, forkd_checkpoint):
            forkd_vm.exec(["python3", "-c", "b = bytearray(b'x') * (48 << 20)"], check=True)
            with forkd_checkpoint(forkd_vm):
                pass
    """
    )
    result = run_forkd()
    result.assert_outcomes(passed=1, failed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "*latency budget violations (exit status 1):*",
            "*test_dirty.py::test_dirties_a_lot_then_branches*branch_pause*max*",
        ]
    )
    assert "test_small_change" not in result.stdout.str().split("latency budget violations")[1]

    whole_run = run_forkd("--forkd-budget", "branch_pause.p50=1")
    assert whole_run.ret == pytest.ExitCode.TESTS_FAILED
    whole_run.stdout.fnmatch_lines(["*branch_pause*p50*"])


def test_json_report_merges_xdist_workers(pytester, run_forkd, tmp_path):
    pytester.makepyfile(test_steady=STEADY_SUITE)
    report = tmp_path / "report.json"
    result = run_forkd("-p", "xdist", "-n", "2", f"--forkd-json={report}")
    result.assert_outcomes(passed=6)
    document = json.loads(report.read_text())
    tests = {sample["test"] for sample in document["samples"] if sample["test"]}
    assert tests == {f"test_steady.py::test_agent_step[{i}]" for i in range(6)}
    ops = {sample["op"] for sample in document["samples"]}
    assert {"fork", "exec", "branch_pause", "branch_total", "checkpoint", "restore"} <= ops
    exec_samples = [s for s in document["samples"] if s["op"] == "exec"]
    assert len(exec_samples) >= 6 * 5
    assert document["operations"]["exec"]["summary"]["n"] == len(exec_samples)


SLOW_SUITE = """
import time
from pathlib import Path

def test_waits(forkd_vm):
    forkd_vm.exec("true")
    Path("vm-started").write_text(str(forkd_vm.machine.pid))
    time.sleep(300)
"""


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def inner_pytest(pytester: pytest.Pytester, shared_store: Path) -> Iterator[Callable[[], tuple[subprocess.Popen, int]]]:
    """Starts the slow inner suite; whatever the test does (or if it times out), the subprocess is killed."""
    started_processes: list[subprocess.Popen] = []

    def start() -> tuple[subprocess.Popen, int]:
        pytester.makepyfile(test_slow=SLOW_SUITE)
        process = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--forkd-store={shared_store}", "test_slow.py"],
            cwd=pytester.path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            # Ctrl-C must reach it as it would a user's pytest, even when this run was started in
            # the background of a script (which ignores SIGINT, and an ignored signal is inherited).
            preexec_fn=_default_sigint,
        )
        started_processes.append(process)
        started = pytester.path / "vm-started"
        for attempt in tenacity.Retrying(
            stop=tenacity.stop_after_delay(120), wait=tenacity.wait_fixed(0.2), reraise=True
        ):
            with attempt:
                assert process.poll() is None, f"the inner pytest exited early: {process.communicate()[0]}"
                assert started.exists() and started.read_text(), "the inner test never started its VM"
        return process, int(started.read_text())

    yield start
    for process in started_processes:
        if process.poll() is None:
            process.kill()
        try:
            process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def _gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_ctrl_c_mid_run_kills_every_vm(inner_pytest, shm_dir):
    process, qemu_pid = inner_pytest()
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == pytest.ExitCode.INTERRUPTED, output
    assert _gone(qemu_pid)
    assert processes_mentioning(shm_dir) == []
    assert list(shm_dir.glob("run-*")) == []


def test_kill_9_mid_run_then_next_run_starts_clean(pytester, inner_pytest, run_forkd, shm_dir):
    process, qemu_pid = inner_pytest()
    process.kill()
    process.communicate(timeout=60)
    for attempt in tenacity.Retrying(stop=tenacity.stop_after_delay(10), wait=tenacity.wait_fixed(0.1), reraise=True):
        with attempt:
            assert _gone(qemu_pid), "QEMU outlived the killed pytest"
    stale = list(shm_dir.glob("run-*"))
    assert stale, "a killed run cannot remove its run directory itself"

    pytester.makepyfile(test_slow="def test_quick(forkd_vm):\n    assert forkd_vm.exec('true').ok\n")
    result = run_forkd()  # also asserts that nothing is left afterwards
    result.assert_outcomes(passed=1)
    assert not any(path.exists() for path in stale)
