"""``fork_snapshot(wait_ready=False)``: children handed back restored and running, their agents answering later.

On the fake engine (the real agent as a host process): the children keep the
snapshot's state and answer their first requests, which wait in the channel
until the agent answers; a child whose agent never answers is closed, and a
request already waiting fails with the error a waiting fork raises.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pytest_forkd.core.factory import VMFactory, _await_agent
from pytest_forkd.errors import VMError, VMStartError
from pytest_forkd.waiting import poll_until


@pytest.fixture
def factory() -> Iterator[VMFactory]:
    made = VMFactory(engine="fake")
    try:
        yield made
    finally:
        made.close()


def test_children_not_awaited_keep_the_state_and_answer(factory: VMFactory) -> None:
    root = factory.boot(memory_mib=64)
    root.exec("echo kept > state.txt")
    snapshot = root.freeze("unready-base", keep_running=False)
    for count in (1, 3):
        children = factory.fork_snapshot(snapshot, count, wait_ready=False)
        assert len(children) == count
        assert all(child.machine.status() == "running" for child in children)  # resumed, not parked
        for child in children:
            assert child.exec("cat state.txt; echo mine > state.txt").stdout == "kept\n"
        assert [child.exec("cat state.txt").stdout for child in children] == ["mine\n"] * count
        for child in children:
            child.close()


def test_a_child_whose_agent_never_answers_fails_its_waiting_call(factory: VMFactory) -> None:
    vm = factory.boot(memory_mib=64)
    vm.machine.stop()  # its agent is frozen: it will not answer
    _await_agent(vm, vm.agent, 0.1)  # what a child started without waiting for its agent runs
    with pytest.raises(VMStartError, match="did not answer within"):
        vm.exec("true")  # sent before the wait ran out: it fails with the start's error, not a hang
    assert poll_until(lambda: vm.closed, timeout=10, what="the VM to be closed", interval=0.05)
    with pytest.raises(VMError, match="did not answer within"):
        vm.exec("true")  # and so does every later call
    assert poll_until(lambda: not vm.machine.alive(), timeout=10, what="its machine to end", interval=0.05)
