"""A test suite whose code calls plain ``Sandbox.create()`` passes through ``forkd_e2b``, and leaves nothing."""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

import pytest
from support import USER_CACHE, assert_nothing_left

pytest.importorskip("e2b")

pytestmark = pytest.mark.vm

AGENT = '''
"""Code under test: written against E2B's SDK only, it knows nothing of forkd."""
from e2b import Sandbox


def solve(task: str) -> tuple[str, str]:
    sandbox = Sandbox.create()
    sandbox.files.write("task.txt", task)
    result = sandbox.commands.run("tr a-z A-Z < task.txt > answer.txt && cat answer.txt")
    return sandbox.sandbox_id, result.stdout.strip()


def leave_one_running_and_one_paused() -> list[str]:
    running = Sandbox.create()
    running.commands.run("sleep 600", background=True, timeout=0)
    paused = Sandbox.create()
    paused.pause()
    return [running.sandbox_id, paused.sandbox_id]
'''

TESTS = """
from e2b import Sandbox

import agent


def test_the_agent_solves_its_task(forkd_e2b):
    sandbox_id, answer = agent.solve("shout")
    assert answer == "SHOUT"
    vm = forkd_e2b.vm(sandbox_id)                       # the sandbox as a forkd VM
    assert vm.read_file("/home/user/answer.txt") == b"SHOUT"
    assert sandbox_id in forkd_e2b.sandboxes


def test_each_test_has_its_own_sandboxes_and_leaves_them(forkd_e2b):
    assert forkd_e2b.sandbox_ids() == []                # the first test's sandbox was killed after it
    made = agent.leave_one_running_and_one_paused()
    assert sorted(forkd_e2b.sandbox_ids()) == sorted(made)
    states = {item.sandbox_id: item.state.value for item in Sandbox.list().next_items()}
    assert states == {made[0]: "running", made[1]: "paused"}


def test_nothing_of_the_previous_test_is_left(forkd_e2b):
    assert Sandbox.list().next_items() == []
"""


def test_a_plain_sdk_suite_passes_through_forkd_e2b_and_leaves_nothing(pytester: pytest.Pytester) -> None:
    shm = Path(f"/dev/shm/forkd-e2b-fixture-{os.getpid()}-{secrets.token_hex(4)}")
    pytester.makepyfile(agent=AGENT, test_agent=TESTS)
    for name in list(os.environ):
        if name.startswith(("PYTEST_FORKD_", "E2B_")):
            pytester._monkeypatch.delenv(name)
    pytester._monkeypatch.setenv("FORKD_SHM_DIR", str(shm))
    pytester._monkeypatch.setenv("FORKD_CACHE_DIR", str(USER_CACHE))
    pytester._monkeypatch.delenv("FORKD_STORE", raising=False)
    try:
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly", timeout=900)
        result.assert_outcomes(passed=3)
        assert_nothing_left(shm)
        store = USER_CACHE / "snapshots"
        left = [path.name for path in store.rglob("e2b-p*")] if store.is_dir() else []
        inner = [name for name in left if not _server_alive(name)]
        assert inner == [], f"snapshots of the inner run's server left in the store: {inner}"
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def _server_alive(tag: str) -> bool:
    """Whether the server that wrote ``e2b-p<pid>-...`` still runs (another test's, in another process)."""
    from pytest_forkd.processes import is_alive

    pid = tag.removeprefix("e2b-p").split("-", 1)[0]
    return pid.isdigit() and is_alive(int(pid))
