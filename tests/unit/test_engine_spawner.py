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


def assert_dies_with_its_owner(owner_script: str, what: str, *args: str) -> None:
    """Run ``owner_script`` (it prints the pids of processes it started), SIGKILL it, and check that they die too."""
    owner = subprocess.Popen([sys.executable, "-c", owner_script, *args], stdout=subprocess.PIPE, text=True)
    child_pids: list[int] = []
    try:
        child_pids = [int(pid) for pid in owner.stdout.readline().split()]  # type: ignore[union-attr]
        assert child_pids and all(map(is_running, child_pids))
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
        for child_pid in child_pids:
            assert wait_until_dead(child_pid, seconds=10), f"{what} {child_pid} survived its owner's SIGKILL"
    finally:
        owner.kill()
        owner.wait()
        owner.stdout.close()  # type: ignore[union-attr]
        for child_pid in child_pids:
            if is_running(child_pid):
                os.kill(child_pid, signal.SIGKILL)


def test_child_is_killed_when_its_owner_is_killed() -> None:
    assert_dies_with_its_owner(OWNER_SCRIPT, "sleep")


PAUSED_FAKE_AGENT_OWNER_SCRIPT = """
import signal, sys
from pathlib import Path
from pytest_forkd.engine.fake import FakeEngine, FakeSpec
from pytest_forkd.waiting import poll_until
directory = Path(sys.argv[1])
machine = FakeEngine().boot(FakeSpec(memory_mib=16), None, directory=directory, name="owned", ram_path=directory / "ram")
# "serving on --stdio": the agent runs, past the point where its death signal is set.
poll_until(lambda: "serving on" in machine.console_tail(), timeout=30, what="the agent to serve")
machine.stop()  # a paused machine: its agent cannot notice the channel closing
template = int(Path(f"/proc/{machine.agent_pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])
print(machine.agent_pid, template, flush=True)
signal.pause()
"""


def test_a_fake_agent_and_its_template_die_with_their_owner_even_paused(tmp_path: Path) -> None:
    """The fake engine forks agents from a template process: the template and a paused agent die with the owner."""
    assert_dies_with_its_owner(PAUSED_FAKE_AGENT_OWNER_SCRIPT, "fake agent or its template", str(tmp_path))


def test_a_start_that_hangs_is_given_up_on_in_bounded_time_and_the_next_start_works(monkeypatch) -> None:
    """A fork that never reaches exec (simulated: the child sleeps before it) must not block its caller."""
    from pytest_forkd.engine import spawner

    marker = f"forkd-late-{os.getpid()}-{time.monotonic_ns()}"

    def slow_start() -> None:
        time.sleep(3)

    monkeypatch.setattr(spawner, "_die_with_parent", slow_start)
    try:
        spawn([sys.executable, "-c", "import time; time.sleep(600)", marker], timeout=0.05)
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
