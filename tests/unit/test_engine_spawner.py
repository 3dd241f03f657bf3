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
        time.sleep(0.1)  # a PDEATHSIG tied to the requesting thread would have fired by now
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


def assert_dies_with_its_owner(owner_script: str, what: str) -> None:
    """Run ``owner_script`` (it prints the pid of a process it spawned), SIGKILL it, and check that process dies too."""
    owner = subprocess.Popen([sys.executable, "-c", owner_script], stdout=subprocess.PIPE, text=True)
    child_pid = None
    try:
        child_pid = int(owner.stdout.readline())  # type: ignore[union-attr]
        assert is_running(child_pid)
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
        assert wait_until_dead(child_pid, seconds=10), f"{what} {child_pid} survived its owner's SIGKILL"
    finally:
        owner.kill()
        owner.wait()
        owner.stdout.close()  # type: ignore[union-attr]
        if child_pid is not None and is_running(child_pid):
            os.kill(child_pid, signal.SIGKILL)


def test_child_is_killed_when_its_owner_is_killed() -> None:
    assert_dies_with_its_owner(OWNER_SCRIPT, "sleep")


PAUSED_FAKE_AGENT_OWNER_SCRIPT = """
import os, signal, socket, subprocess, sys, threading
from pytest_forkd.engine.fake import AGENT_SCRIPT, LAUNCHER
from pytest_forkd.engine.spawner import spawn
host, guest = socket.socketpair()
argv = [sys.executable, "-E", "-s", "-S", "-c", LAUNCHER, str(AGENT_SCRIPT), "--stdio"]
children = []
start = lambda: children.append(
    spawn(argv, stdin=guest, stdout=guest, stderr=subprocess.PIPE, start_new_session=True, die_with_parent=False)
)
worker = threading.Thread(target=start)
worker.start()
worker.join()
children[0].stderr.readline()  # "serving on --stdio": the launcher has set its death signal
os.kill(children[0].pid, signal.SIGSTOP)  # a paused machine: its agent cannot notice the channel closing
print(children[0].pid, flush=True)
signal.pause()
"""


def test_a_fake_agent_sets_its_own_death_signal_and_dies_with_its_owner_even_paused() -> None:
    """The fake engine starts its agent without code between fork and exec (spawn(die_with_parent=False))."""
    assert_dies_with_its_owner(PAUSED_FAKE_AGENT_OWNER_SCRIPT, "agent")


def test_a_start_that_hangs_is_given_up_on_in_bounded_time_and_the_next_start_works(monkeypatch) -> None:
    """A fork that never reaches exec (simulated: the child sleeps before it) must not block its caller."""
    from pytest_forkd.engine import spawner

    marker = f"forkd-late-{os.getpid()}-{time.monotonic_ns()}"

    def slow_start() -> None:
        time.sleep(3)

    monkeypatch.setattr(spawner, "_die_with_parent", slow_start)
    try:
        spawn([sys.executable, "-c", "import time; time.sleep(600)", marker], timeout=0.2)
    except spawner.SpawnTimeout as exc:  # raised only by the bounded wait: the child was still asleep
        assert "did not complete within" in str(exc) and "hung" in str(exc)
    else:
        raise AssertionError("the hung start was not given up on")
    monkeypatch.undo()

    child = spawn(["sleep", "600"])  # a fresh spawner thread serves the next start
    try:
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()

    def late_child_alive() -> bool:
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                        if marker.encode() in cmdline.read():
                            return True
                except OSError:
                    pass
        return False

    deadline = time.monotonic() + 10
    while late_child_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not late_child_alive()  # the process that started after its caller gave up was killed
