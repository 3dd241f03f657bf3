"""The fake engine's agents, forked from one template process: each a process of its own, and none left behind.

The template (``pytest_forkd.engine.fake_agents``) imports the agent once and
forks it per machine. What a fresh interpreter gave each agent must hold for a
fork too: its own process and session, its machine's directory, the
environment and umask of the moment it starts, an exit status the machine can
report; and no process of the template's outlives the process that started it
(tests/unit/test_engine_spawner.py kills that owner; here it exits normally).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import is_running, wait_until_dead

from pytest_forkd.core.factory import VMFactory
from pytest_forkd.core.vm import VM
from pytest_forkd.engine import fake_agents
from pytest_forkd.engine.fake import FakeMachine
from pytest_forkd.waiting import poll_until


@pytest.fixture
def factory() -> Iterator[VMFactory]:
    made = VMFactory(engine="fake")
    try:
        yield made
    finally:
        made.close()


def machine(vm: VM) -> FakeMachine:
    assert isinstance(vm.machine, FakeMachine)
    return vm.machine


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])


def test_each_machine_gets_an_agent_of_its_own_as_it_is_at_its_start(
    factory: VMFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FORKD_TEST_WHICH", "first")
    previous = os.umask(0o027)
    try:
        first = factory.boot(memory_mib=64)
    finally:
        os.umask(previous)
    monkeypatch.setenv("FORKD_TEST_WHICH", "second")
    second = factory.boot(memory_mib=64)
    said = [vm.exec("umask; echo $FORKD_TEST_WHICH; pwd").stdout.split() for vm in (first, second)]
    assert said[0][:2] == ["0027", "first"] and said[1][:2] == [f"{previous:04o}", "second"]
    assert [Path(lines[2]) for lines in said] == [machine(first).root, machine(second).root]
    agents = [machine(vm).agent_pid for vm in (first, second)]
    assert None not in agents and agents[0] != agents[1]
    for pid in agents:
        assert pid is not None and os.getsid(pid) == pid  # a session of its own, as start_new_session gave it
    template = parent_of(agents[0])  # type: ignore[arg-type]
    assert template == parent_of(agents[1]) and template != os.getpid()  # type: ignore[arg-type]
    first.close()
    assert wait_until_dead(agents[0], seconds=10) and is_running(agents[1])  # type: ignore[arg-type]
    assert second.exec("echo still").stdout == "still\n"


def test_an_agent_killed_is_reported_with_its_exit_status(factory: VMFactory) -> None:
    vm = factory.boot(memory_mib=64)
    agent = machine(vm).agent_pid
    assert agent is not None
    os.kill(agent, signal.SIGKILL)
    assert "the agent exited with status -9" in str(machine(vm).crash_error("exec"))
    assert not machine(vm).alive()


EXITING_OWNER = """
import sys
from pathlib import Path
from pytest_forkd.engine.fake import FakeEngine, FakeSpec
directory = Path(sys.argv[1])
machine = FakeEngine().boot(FakeSpec(memory_mib=64), None, directory=directory, name="left", ram_path=directory / "ram")
template = int(Path(f"/proc/{machine.agent_pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])
print(machine.agent_pid, template, flush=True)
sys.exit(0)  # the machine is left running: the exit ends its agent and the template
"""


def test_no_agent_or_template_outlives_a_process_that_exits(tmp_path: Path) -> None:
    owner = subprocess.run(
        [sys.executable, "-c", EXITING_OWNER, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert owner.returncode == 0, owner.stderr
    pids = [int(pid) for pid in owner.stdout.split()]
    assert len(pids) == 2
    agent, template = pids
    try:
        assert not is_running(template), "the template outlived its owner: it is waited for at exit"
        assert wait_until_dead(agent, seconds=10), "the agent outlived its template"  # its death signal
    finally:
        for pid in pids:
            if is_running(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("thread_children", [True, False], ids=["children lists", "every process's parent"])
def test_the_processes_below_an_agent_are_found_either_way(
    thread_children: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What pausing and killing a machine reach: from /proc's lists of children, or where a kernel has none."""
    if thread_children and not fake_agents._THREAD_CHILDREN:
        pytest.skip("this kernel keeps no lists of children (CONFIG_PROC_CHILDREN)")
    monkeypatch.setattr(fake_agents, "_THREAD_CHILDREN", thread_children)
    tree = subprocess.Popen(["sh", "-c", "sh -c 'sleep 60 & wait' & sleep 60 & wait"], start_new_session=True)
    try:

        def all_four() -> list[int] | None:
            found = fake_agents.descendants(tree.pid)
            return found if len(found) == 3 else None

        below = poll_until(all_four, timeout=10, what="the shell and the sleeps below the first shell")
        assert all(parent_of(pid) in (tree.pid, *below) for pid in below)
        assert tree.pid not in below
    finally:
        os.killpg(tree.pid, signal.SIGKILL)  # the whole tree: the shells started no group of their own
        tree.wait()
