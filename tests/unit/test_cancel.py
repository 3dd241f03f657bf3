"""SIGTERM, SIGHUP and SIGINT to a process running VMs: a clean stop first, a bounded forced exit after.

Each case runs a small Python program in a subprocess (signal dispositions are
per process): it installs the handlers, registers an emergency cleanup that
leaves a mark, and then behaves as the case needs. No VM: the real runs (pytest
building a snapshot) are tests/plugin/test_cancellation.py.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

PROGRAM = """
import signal, sys, time
from pathlib import Path
from pytest_forkd.engine import cancel

cancel.GRACE_S = {grace}
mark = Path(sys.argv[1])
cancel.on_emergency(lambda: mark.write_text("cleaned"))
{before}
cancel.install()
try:
    print("ready", flush=True)
    while True:
        time.sleep(0.05)
except KeyboardInterrupt as exc:
    print("interrupted:", exc, flush=True)
    {after}
"""


#: The programs this module's tests started, killed after each test (see ``kill_what_was_started``).
_started: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def kill_what_was_started() -> Iterator[None]:
    """A test that fails before its program exits leaves no program behind (some sleep 600 s in their cleanup)."""
    yield
    while _started:
        process = _started.pop()
        if process.poll() is None:
            process.kill()
        process.communicate()


def start(
    tmp_path: Path, *, grace: float = 30.0, before: str = "", after: str = "sys.exit(7)"
) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", PROGRAM.format(grace=grace, before=before, after=after), str(tmp_path / "mark")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _started.append(process)
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    return process


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda s: s.name)
def test_the_first_signal_is_a_keyboard_interrupt_so_cleanup_code_runs(tmp_path: Path, signum: int) -> None:
    process = start(tmp_path)
    process.send_signal(signum)
    out, _ = process.communicate(timeout=30)
    assert process.returncode == 7  # the program's own cleanup path ran and chose its exit status
    assert f"interrupted: {signal.Signals(signum).name} received" in out
    assert not (tmp_path / "mark").exists()  # no forced exit was needed


def test_a_cleanup_that_hangs_is_cut_short_after_the_grace_period(tmp_path: Path) -> None:
    process = start(tmp_path, grace=0.1, after="time.sleep(600)")
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=30)
    assert process.returncode == 128 + signal.SIGTERM
    assert (tmp_path / "mark").read_text() == "cleaned"  # VMs killed, run directories removed
    assert "SIGTERM: still running 0.1 s after the signal; killing this run's VMs" in err


def test_a_second_signal_exits_at_once(tmp_path: Path) -> None:
    process = start(tmp_path, after="time.sleep(600)")
    process.send_signal(signal.SIGTERM)
    assert process.stdout is not None  # the first signal is being handled (the program sleeps in its cleanup):
    assert process.stdout.readline().startswith("interrupted: SIGTERM")
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=30)
    assert process.returncode == 128 + signal.SIGINT
    assert (tmp_path / "mark").read_text() == "cleaned" and "a second signal" in err


def test_a_signal_someone_else_handles_or_ignores_is_left_alone(tmp_path: Path) -> None:
    process = start(
        tmp_path,
        before="signal.signal(signal.SIGTERM, lambda *a: sys.exit(5)); signal.signal(signal.SIGHUP, signal.SIG_IGN)",
    )
    process.send_signal(signal.SIGHUP)  # ignored, as nohup would have it
    time.sleep(0.1)
    assert process.poll() is None
    process.send_signal(signal.SIGTERM)  # the program's own handler
    process.communicate(timeout=30)
    assert process.returncode == 5
