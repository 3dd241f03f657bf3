"""The OpenAI Agents SDK's E2B sandbox client, unchanged, with the older SDK it pins, on ``forkd_e2b``.

``openai-agents[e2b]`` pins e2b 2.31.0 and e2b-code-interpreter 2.8.1, so it
runs from a virtualenv of its own (installed from PyPI on first use, cached:
consumers_env). That SDK creates through the v1 ``POST /sandboxes``, checks
the key's ``e2b_<hex>`` form itself, sends ``allow_internet_access: true``
and an ``on_timeout: pause`` lifecycle on every create, and runs commands
with a 24-hour ``connect-timeout-ms`` when the session sets no timeout. The
client creates a session from a manifest, runs commands, writes and reads a
file, and a SandboxAgent's scripted model calls the shell tool; meanwhile the
test reads the sandbox's VM directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from consumers_env import python_env
from consumers_server import consumer_environment, run_consumer
from support import wait_until_dead

pytestmark = pytest.mark.vm

#: The Agents SDK release whose ``e2b`` extra is tested, and the SDK versions that extra pins.
AGENTS_SDK = "openai-agents[e2b]==0.24.0"
PINNED = {"e2b": "2.31.0", "e2b-code-interpreter": "2.8.1"}
SCRIPT = Path(__file__).with_name("consumers_agents_sdk_run.py")


def test_the_agents_sdk_e2b_client_runs_a_session_and_an_agent(forkd_e2b, tmp_path: Path) -> None:
    python = python_env("openai-agents-e2b", [AGENTS_SDK])
    pids: list[int] = []

    def look_inside(result: dict[str, Any]) -> None:
        vm = forkd_e2b.vm(result["sandbox_id"])
        pids.append(vm.machine.pid)
        assert vm.read_file("/workspace/out/answer.txt") == b"42\n"
        assert vm.read_file("/workspace/greeting.txt") == b"hello from the manifest\n"
        assert forkd_e2b.sandbox_ids() == [result["sandbox_id"]]

    out = run_consumer([str(python), str(SCRIPT)], consumer_environment(forkd_e2b.env), tmp_path, inspect=look_inside)

    assert {name: out["versions"][name] for name in PINNED} == PINNED
    assert out["listed"] == [0, "hello from the manifest\n/workspace\n", ""]
    assert out["failed"] == [3, "", "to-stderr\n"]
    assert out["read_back"] == out["catted"] == "42\n"
    assert "42 Linux\nhello from the manifest" in out["agent"]
    assert forkd_e2b.sandbox_ids() == []  # leaving the session killed the sandbox
    assert pids and wait_until_dead(pids[0])
