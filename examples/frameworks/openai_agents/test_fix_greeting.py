"""The SandboxAgent example as a test: each run gets a child of the suite's parent VM through ``forkd_sandbox_client``.

Always offline: the scripted model plays the agent, whatever the environment holds.
"""

import pytest

pytest.importorskip("agents", reason='the OpenAI Agents SDK example: pip install "pytest-forkd[openai-agents]"')

from fix_greeting import choose_model, fix_greeting  # noqa: E402


@pytest.mark.asyncio
async def test_the_agent_fixes_the_file_in_its_vm(forkd_sandbox_client):
    answer, fixed = await fix_greeting(forkd_sandbox_client, choose_model(offline=True))
    assert fixed == b'def greet(name):\n    return "Hello, " + name\n'
    assert "Hello, forkd" in answer
    assert forkd_sandbox_client.vms == []  # the session's VM is gone once the example is done with it


@pytest.mark.asyncio
async def test_sessions_start_from_the_parent_state(forkd_sandbox_client):
    """Whatever the suite prepared in the parent VM is there in every session (examples/conftest.py prepares some)."""
    session = await forkd_sandbox_client.create()
    async with session:
        listing = await session.exec("ls /srv/project")
        assert (await session.exec("pwd")).stdout == b"/workspace\n"
    assert listing.exit_code == 0 and "calc.py" in listing.stdout.decode().split()
