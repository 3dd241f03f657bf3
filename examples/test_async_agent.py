"""The asyncio agent's test suite: ``async def`` tests on ``forkd_avm``, each in its own microVM.

Every test here runs twice, once under pytest-asyncio and once under anyio's
pytest plugin (see ``pytest_generate_tests`` in conftest.py). Run it with
``make example``, like the synchronous suite.
"""

from __future__ import annotations

import asyncio

import pytest
from async_agent import PROJECT, AsyncAgent, FixAttempt, Notes

pytestmark = pytest.mark.usefixtures("anyio_backend")

FIXES = {
    "swap operands": "return b - a",
    "multiply": "return a * b",
    "add": "return a + b",
}


async def test_tools_write_read_and_exec(forkd_avm):
    agent = AsyncAgent(forkd_avm, Notes("/root/notes/todo.txt", ["fix add", "write tests"]))

    assert await agent.run("keep notes") == "2"
    assert await forkd_avm.read_file("/root/notes/todo.txt") == b"fix add\nwrite tests\n"


async def test_each_test_gets_a_clean_vm(forkd_avm):
    # test_tools_write_read_and_exec wrote notes in its VM; this VM is a fresh child of the parent.
    assert (await forkd_avm.exec(["test", "-e", "/root/notes"])).exit_code == 1


async def test_parent_state_is_in_every_child(forkd_avm):
    # conftest.project_in_parent wrote the project into the parent once.
    assert await forkd_avm.read_file(f"{PROJECT}/README") == b"a calculator\n"


async def test_checkpoint_rolls_back_a_destructive_tool_call(forkd_avm):
    async with forkd_avm.checkpoint():
        await forkd_avm.exec(f"rm -rf {PROJECT}")
        assert (await forkd_avm.exec(["ls", PROJECT])).exit_code != 0
    # Leaving the block rolled the VM back: the files are there again.
    assert await forkd_avm.read_file(f"{PROJECT}/README") == b"a calculator\n"


async def test_three_agents_in_three_forks_of_one_checkpoint(forkd_avm):
    checkpoint = await forkd_avm.checkpoint()
    forks = await checkpoint.fork(len(FIXES))  # killed after the test
    agents = [AsyncAgent(vm, FixAttempt(fix)) for vm, fix in zip(forks, FIXES.values())]

    # The three agents run concurrently, each in its own copy of the checkpoint.
    answers = await asyncio.gather(*(agent.run("make add() pass the checks") for agent in agents))

    scores = {name: int(answer) for name, answer in zip(FIXES, answers)}
    assert scores == {"swap operands": 1, "multiply": 1, "add": 4}
    assert max(scores, key=scores.get) == "add"
    # Each agent changed only its own fork; the checkpointed VM still has the bug.
    sources = await asyncio.gather(*(vm.read_file(f"{PROJECT}/calc.py") for vm in forks))
    assert [source.decode().splitlines()[1].strip() for source in sources] == list(FIXES.values())
    assert b"return a - b" in await forkd_avm.read_file(f"{PROJECT}/calc.py")
    # Each agent read both files in one step, with two concurrent tool calls.
    assert all(len(agent.transcript[0]) == 2 for agent in agents)

    # Keep the winner: roll the test's VM forward to the best fork's state.
    await forkd_avm.restore(await forks[list(FIXES).index("add")].branch())
    assert (await forkd_avm.exec(f"cd {PROJECT} && python3 -S check.py")).stdout == "4\n"


async def test_a_cancelled_tool_call_stops_in_the_guest(forkd_avm):
    # An agent framework cancels a slow tool call (a timeout, a user interrupt): the command dies with it.
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(forkd_avm.exec("sleep 30"), timeout=1)
    assert (await forkd_avm.exec("ps | grep -c '[s]leep 30' || true")).stdout == "0\n"


@pytest.mark.forkd_dangerous
async def test_dangerous_test_can_roll_back(forkd_avm, forkd_dangerous_checkpoint):
    await forkd_avm.exec("rm -rf /srv /etc/hostname")
    assert (await forkd_avm.exec(["test", "-d", "/srv"])).exit_code == 1
    await forkd_avm.restore(forkd_dangerous_checkpoint.snapshot)
    assert (await forkd_avm.exec(["test", "-f", f"{PROJECT}/calc.py"])).exit_code == 0


@pytest.mark.forkd(snapshot="tools")
async def test_custom_snapshot_has_the_linter(forkd_avm):
    # `tools` is declared in forkd.yaml: base plus a linter, built once and cached.
    assert await forkd_avm.read_file("/etc/agent-lint.conf") == b"level=strict\n"
    await forkd_avm.write_file("/tmp/tabbed.txt", "a\tb\n")
    result = await forkd_avm.exec(["agent-lint", "/tmp/tabbed.txt"])
    assert result.exit_code == 1 and "tab found" in result.stderr
