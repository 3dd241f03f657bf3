"""mini-swe-agent's own agent loop in forkd VMs of a registry image: it fixes a failing test and submits.

The image (:mod:`project_images`) is pushed to the tests' real registry on
127.0.0.1 and named by a bare reference, as mini-swe-agent's SWE-bench
configs name theirs; the model is mini-swe-agent's ``DeterministicModel``,
so the run is offline and its actions are known.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import processes_mentioning

from pytest_forkd.waiting import poll_until

pytest.importorskip("minisweagent", reason='needs mini-swe-agent: pip install "pytest-forkd[mini-swe-agent]"')

from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.environments import get_environment  # noqa: E402
from minisweagent.models.test_models import DeterministicModel, make_output  # noqa: E402

from pytest_forkd.integrations.mini_swe_agent import ForkdEnvironment  # noqa: E402
from pytest_forkd.integrations.sessions import SESSIONS  # noqa: E402

pytestmark = pytest.mark.vm

CLASS_PATH = "pytest_forkd.integrations.mini_swe_agent.ForkdEnvironment"
SYSTEM = "You are a helpful assistant that can interact with a computer."
INSTANCE = "Please solve this issue: {{task}}"


@pytest.fixture
def shm_root(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = Path(f"/dev/shm/forkd-mswea-{os.getpid()}-{secrets.token_hex(3)}")
    monkeypatch.setenv("FORKD_SHM_DIR", str(root))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def observations(agent: DefaultAgent) -> list[str]:
    return [str(message["content"]) for message in agent.messages if message.get("role") == "user"][1:]


def test_the_default_agent_fixes_the_failing_test_in_the_image_and_submits(project_image: str, shm_root: Path) -> None:
    env = get_environment({"environment_class": CLASS_PATH, "image": project_image, "cwd": "/srv/project"})
    assert isinstance(env, ForkdEnvironment)
    other = get_environment({"environment_class": CLASS_PATH, "image": project_image, "cwd": "/srv/project"})
    try:
        model = DeterministicModel(
            outputs=[
                make_output("Run the tests first.", [{"command": "python3 test_calc.py 2>&1 | tail -1"}]),
                make_output("add subtracts; fix it.", [{"command": "sed -i 's/a - b/a + b/' calc.py && cat calc.py"}]),
                make_output("Check the fix.", [{"command": "python3 test_calc.py 2>&1 | tail -1"}]),
                make_output("Submit.", [{"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; cat calc.py"}]),
            ]
        )
        agent = DefaultAgent(model, env, system_template=SYSTEM, instance_template=INSTANCE, cost_limit=0)
        result = agent.run("test_calc.py fails: make it pass")
        assert result["exit_status"] == "Submitted"
        assert result["submission"] == "def add(a, b):\n    return a + b\n"
        seen = observations(agent)
        assert "<returncode>0</returncode>" in seen[0] and "FAILED (failures=1)" in seen[0]
        assert "return a + b" in seen[1]
        assert "OK" in seen[2]
        # Another environment of the same image: a child of the same parent, with the bug still there.
        untouched = other.execute({"command": "python3 test_calc.py 2>&1 | tail -1; id -u; echo $PROJECT"})
        assert untouched == {"output": "FAILED (failures=1)\n0\ncalc\n", "returncode": 0, "exception_info": ""}
        assert env.vm.origin is not None and other.vm.origin is not None
        assert env.vm.origin.path == other.vm.origin.path
    finally:
        env.cleanup()
        other.cleanup()
    poll_until(lambda: processes_mentioning(shm_root) == [], timeout=30, interval=0.1, what="the VMs to exit")
    assert not shm_root.exists() or os.listdir(shm_root) == []
    assert SESSIONS.keys() == []


def test_a_timeout_kills_the_command_in_the_image_vm(project_image: str, shm_root: Path) -> None:
    env: Any = ForkdEnvironment(image=project_image, cwd="/srv/project", timeout=2, env={"MARK": "set"})
    try:
        slow = env.execute({"command": "echo $MARK; sleep 30; echo never"})
        assert slow["returncode"] == -1 and slow["output"] == "set\n"
        assert slow["extra"]["exception_type"] == "TimeoutExpired"
        assert (
            env.execute({"command": "cat /proc/[0-9]*/cmdline | tr '\\0' ' ' | grep -c '[s]leep 30'"})["output"]
            == "0\n"
        )
        assert env.execute({"command": "ls /nowhere"})["returncode"] == 2
    finally:
        env.cleanup()
    assert SESSIONS.keys() == []
