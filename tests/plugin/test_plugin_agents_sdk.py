"""The ``forkd_sandbox_client`` fixture in a real pytest run (pytester): sessions fork the parent, teardown kills them.

After every inner run, ``run_forkd`` checks that no process still uses the
run's private shm directory and that no run directory is left in it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest

# Every test runs pytest in a subprocess (pytester), so the fast layer never imports this module; nor
# does a run here import the SDK (a second): the inner runs do.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("agents") is None,
        reason='needs the OpenAI Agents SDK: pip install "pytest-forkd[openai-agents]"',
    ),
]

#: The scripted model of the integration tests, copied next to the inner suite.
SCRIPTED_MODEL = Path(__file__).parents[1] / "integrations" / "agents_sdk_model.py"

CONFTEST = """
import pytest


@pytest.fixture(scope="session", autouse=True)
def prepared(forkd_parent):
    forkd_parent.exec("echo prepared-in-parent > /etc/prepared", check=True)
"""

SUITE = """
import os

import pytest
from agents import Runner, set_tracing_disabled
from agents.run import RunConfig
from agents.sandbox import SandboxRunConfig

from pytest_forkd.integrations.openai_agents import ForkdSandbox

set_tracing_disabled(True)
pids = []


@pytest.mark.asyncio
async def test_sessions_are_children_of_the_parent(forkd_sandbox_client):
    session = await forkd_sandbox_client.create()
    assert isinstance(session, ForkdSandbox)
    await session.start()
    assert (await session.exec("cat /etc/prepared")).stdout == b"prepared-in-parent\\n"
    await session.exec("echo mine > /etc/leak")
    [forked] = await session.fork(1)
    assert (await forked.exec("cat /etc/leak")).stdout == b"mine\\n"
    pids.extend([session.vm.machine.pid, forked.vm.machine.pid])
    # neither is deleted here: the fixture's teardown must kill both


def test_teardown_killed_them(forkd_vm):
    assert len(pids) == 2
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()
    assert forkd_vm.exec("test -e /etc/leak").exit_code == 1


@pytest.mark.asyncio
async def test_a_sandbox_agent_in_a_test(forkd_sandbox_client):
    from agents_sdk_model import ScriptedModel
    from agents.sandbox import SandboxAgent
    from agents.sandbox.capabilities import Shell

    session = await forkd_sandbox_client.create()
    async with session:
        step = lambda outputs: {"cmd": "cat /etc/prepared > seen.txt"} if not outputs else "ok"
        agent = SandboxAgent(name="a", instructions="x", model=ScriptedModel(step), capabilities=[Shell()])
        result = await Runner.run(agent, "go", run_config=RunConfig(sandbox=SandboxRunConfig(session=session)))
        assert result.final_output == "ok"
        assert session.vm.read_file("/workspace/seen.txt") == b"prepared-in-parent\\n"
"""

WITHOUT_SDK = """
import sys

sys.modules["agents"] = None  # as on a host without the SDK: importing it raises ModuleNotFoundError


def test_needs_the_sdk(forkd_sandbox_client):
    raise AssertionError("not reached")
"""


@pytest.mark.vm
def test_forkd_sandbox_client_forks_the_parent_and_cleans_up(
    pytester: pytest.Pytester, run_forkd: Callable[..., pytest.RunResult]
) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_agents=SUITE)
    (pytester.path / "agents_sdk_model.py").write_text(SCRIPTED_MODEL.read_text())
    result = run_forkd("-v")
    result.assert_outcomes(passed=3)


def test_forkd_sandbox_client_skips_without_the_sdk(
    pytester: pytest.Pytester, run_forkd: Callable[..., pytest.RunResult]
) -> None:
    pytester.makepyfile(test_without=WITHOUT_SDK)
    result = run_forkd("-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*forkd_sandbox_client needs the OpenAI Agents SDK*pytest-forkd[[]openai-agents[]]*"])
