"""Spawned VMM processes die with their owner process, and only then.

PR_SET_PDEATHSIG fires when the thread that forked the child exits, so the
spawner forks from one long-lived thread: a child requested from a short-lived
worker thread must outlive that thread, and must die when the owner process is
SIGKILLed. ``sleep`` stands in for QEMU.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tenacity import Retrying, retry_if_result, stop_after_delay, wait_fixed

from pytest_forkd.engine.spawner import spawn


def is_running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def wait_until_dead(pid: int, seconds: float) -> bool:
    """Poll until ``pid`` is gone; False if it still runs after ``seconds``."""
    poll = Retrying(stop=stop_after_delay(seconds), wait=wait_fixed(0.05), retry=retry_if_result(bool),
                    retry_error_callback=lambda state: state.outcome.result())
    return not poll(is_running, pid)


def test_child_outlives_the_thread_that_requested_it() -> None:
    children: list[subprocess.Popen] = []
    requester = threading.Thread(target=lambda: children.append(spawn(["sleep", "600"])))
    requester.start()
    requester.join()
    try:
        time.sleep(0.5)  # a PDEATHSIG tied to the requesting thread would have fired by now
        assert children[0].poll() is None
    finally:
        children[0].kill()
        children[0].wait()


def test_spawn_errors_reach_the_caller() -> None:
    try:
        spawn(["/nonexistent/qemu-system-x86_64"])
    except FileNotFoundError as exc:
        assert exc.filename == "/nonexistent/qemu-system-x86_64"
    else:
        raise AssertionError("spawning a missing binary did not raise")


OWNER_SCRIPT = """
import sys, threading, time
from pytest_forkd.engine.spawner import spawn
children = []
worker = threading.Thread(target=lambda: children.append(spawn(["sleep", "600"])))
worker.start()
worker.join()
print(children[0].pid, flush=True)
time.sleep(600)
"""


def test_child_is_killed_when_its_owner_is_killed() -> None:
    owner = subprocess.Popen([sys.executable, "-c", OWNER_SCRIPT], stdout=subprocess.PIPE, text=True)
    child_pid = None
    try:
        child_pid = int(owner.stdout.readline())  # type: ignore[union-attr]
        assert is_running(child_pid)
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
        assert wait_until_dead(child_pid, seconds=10), f"sleep {child_pid} survived its owner's SIGKILL"
    finally:
        owner.kill()
        owner.wait()
        owner.stdout.close()  # type: ignore[union-attr]
        if child_pid is not None and is_running(child_pid):
            os.kill(child_pid, signal.SIGKILL)
