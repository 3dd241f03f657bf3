"""The example agent's test suite: every test gets its own copy-on-write microVM.

Run it with ``make example`` (``pytest --forkd-snapshot=base`` in this folder).
"""

from __future__ import annotations

import pytest
from agent import CONFIG_DIR, Agent, UnknownTask, plan

SCRATCH = "/root/scratch.txt"


def test_plans_are_deterministic():
    assert [call.tool for call in plan("write file /a with b")] == ["write_file"]
    with pytest.raises(UnknownTask):
        plan("make me a sandwich")


def test_write_file(agent, forkd_vm):
    agent.run(f"write file {SCRATCH} with left by a test")
    assert forkd_vm.read_file(SCRATCH) == b"left by a test\n"


def test_each_test_gets_a_clean_vm(forkd_vm):
    # test_write_file left SCRATCH in its VM; this VM is a fresh child of the parent.
    assert forkd_vm.exec(["test", "-e", SCRATCH]).exit_code == 1


def test_parent_state_is_in_every_child(agent):
    # conftest.project_in_parent wrote the project into the parent once.
    assert agent.run("run cat /srv/project/README").stdout == "a calculator\n"


def test_run_python(agent):
    assert agent.run("run python print(6 * 7)").stdout == "42\n"


def test_install_config(agent, forkd_vm):
    agent.run("install config web")
    assert "listen = 8080" in forkd_vm.read_file(f"{CONFIG_DIR}/web.conf").decode()


def test_checkpoint_rolls_back_a_destructive_tool_call(agent, forkd_vm, forkd_checkpoint):
    with forkd_checkpoint(forkd_vm):
        agent.run("delete directory /srv/project")
        assert forkd_vm.exec(["ls", "/srv/project"]).exit_code != 0
    # Leaving the block rolled the VM back: the files are there again.
    assert forkd_vm.read_file("/srv/project/README") == b"a calculator\n"


@pytest.mark.forkd_dangerous
def test_dangerous_test_can_roll_back(agent, forkd_vm, forkd_dangerous_checkpoint):
    agent.run("run rm -rf /srv /etc/hostname")
    assert forkd_vm.exec(["test", "-d", "/srv"]).exit_code == 1
    forkd_dangerous_checkpoint.rollback()
    assert forkd_vm.exec(["test", "-f", "/srv/project/calc.py"]).exit_code == 0


def test_fan_out_tries_fixes_and_keeps_the_best(agent, forkd_vm, forkd_checkpoint):
    fixes = {
        "swap operands": "return b - a",
        "multiply": "return a * b",
        "add": "return a + b",
    }
    checkpoint = forkd_checkpoint(forkd_vm)
    children = checkpoint.fork(len(fixes))
    scores = {}
    for (name, fix), child in zip(fixes.items(), children):
        Agent(child).run(f"run sed -i 's/return a - b/{fix}/' /srv/project/calc.py")
        scores[name] = int(Agent(child).run("run cd /srv/project && python3 check.py").stdout)
    best = max(scores, key=scores.get)
    assert best == "add" and scores["add"] == 4

    # Keep the winner: move the test's own VM to the best child's state.
    forkd_vm.restore(children[list(fixes).index(best)].branch())
    assert agent.run("run cd /srv/project && python3 check.py").stdout == "4\n"


@pytest.mark.forkd(snapshot="tools")
def test_custom_snapshot_has_the_linter(forkd_vm):
    # `tools` is declared in forkd.yaml: base plus a linter, built once and cached.
    assert forkd_vm.read_file("/etc/agent-lint.conf") == b"level=strict\n"
    forkd_vm.write_file("/tmp/tabbed.txt", "a\tb\n")
    result = forkd_vm.exec(["agent-lint", "/tmp/tabbed.txt"])
    assert result.exit_code == 1 and "tab found" in result.stderr
