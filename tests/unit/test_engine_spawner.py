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

from support import is_running, wait_until_dead

from pytest_forkd.engine.spawner import spawn


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
