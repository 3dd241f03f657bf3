"""Cancelled runs, as CI cancels them: a signal to pytest in the middle of a snapshot build or a test.

pytest must end within CI's grace period (20 s here), kill its QEMU
processes, leave its run directory removed and no half-built snapshot listed
as ready; the next run builds the snapshot again and passes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support import assert_nothing_left, processes_mentioning

pytestmark = pytest.mark.vm

#: The guest's setup step: long enough to be cancelled in, short enough for the next run to finish it.
SETUP_SECONDS = 20
PROJECT = f"""\
settings: {{snapshot: slow}}
snapshots:
  slow:
    setup:
      - "echo built > /root/built"
      - "sleep {SETUP_SECONDS}"
"""
TESTS = """\
def test_built(forkd_vm):
    assert forkd_vm.read_file("/root/built") == b"built\\n"


def test_long(forkd_vm):
    forkd_vm.exec("echo started-long-test; sleep 600", timeout=900)
"""


class Run:
    """pytest in a subprocess whose output is collected as it comes (to signal it at the right moment)."""

    def __init__(self, directory: Path, store: Path, *args: str) -> None:
        self.output: list[str] = []
        # As in a CI job: stdout is a pipe that Python buffers, so progress lines must be flushed as they come.
        environment = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-s", f"--forkd-store={store}", *args],
            cwd=directory,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=environment,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line)

    def wait_for(self, text: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.output):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise AssertionError(f"never saw {text!r}; output:\n{''.join(self.output)}")
            time.sleep(0.1)

    def finish(self, timeout: float) -> int:
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"pytest did not end within {timeout} s of the signal") from None
        self.reader.join(timeout=10)
        return code


@pytest.fixture
def project(pytester: pytest.Pytester, shm_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    pytester.makefile(".yaml", forkd=PROJECT)
    pytester.makepyfile(test_cancel=TESTS)
    return pytester.path, tmp_path / "store"


def qemu_of(shm_dir: Path) -> list[str]:
    return [line for line in processes_mentioning(shm_dir) if "qemu" in line]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_during_a_snapshot_build_stops_pytest_kills_its_vms_and_publishes_nothing(
    project: tuple[Path, Path], shm_dir: Path, signum: signal.Signals
) -> None:
    directory, store = project
    run = Run(directory, store, "-k", "test_built")
    run.wait_for(f"sleep {SETUP_SECONDS}")  # the build's second setup step has started
    assert qemu_of(shm_dir)  # the build's VM runs
    run.process.send_signal(signum)
    code = run.finish(timeout=20)
    assert code != 0
    try:
        assert_nothing_left(shm_dir)  # no QEMU, no run directory
    except AssertionError as exc:
        raise AssertionError(f"{exc}\ninner run's output:\n{''.join(run.output)[-3000:]}") from None
    # Neither published (a directory "slow" in the project's namespace) nor half-written (a temporary one):
    # only the lock file of its builds is left.
    assert [p.name for p in store.rglob("*slow*")] == ["slow.lock"]

    if signum == signal.SIGTERM:  # the next run builds it again and passes
        again = Run(directory, store, "-k", "test_built")
        assert again.finish(timeout=600) == 0, "".join(again.output)
        assert "1 passed" in "".join(again.output)
        assert_nothing_left(shm_dir)


def test_sigterm_during_a_test_with_a_prefilled_pool_stops_within_the_grace_period(
    project: tuple[Path, Path], shm_dir: Path
) -> None:
    directory, store = project
    run = Run(directory, store, "-k", "test_long", "--forkd-pool-prefill")
    deadline = time.monotonic() + 600
    while not list(store.rglob("slow/snapshot.json")):
        assert run.process.poll() is None and time.monotonic() < deadline, "".join(run.output)
        time.sleep(0.5)
    time.sleep(5)  # the pool fills, the test's child runs its long command
    assert qemu_of(shm_dir)
    os.kill(run.process.pid, signal.SIGTERM)
    assert run.finish(timeout=20) != 0
    assert_nothing_left(shm_dir)
