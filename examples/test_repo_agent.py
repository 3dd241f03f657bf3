"""What did the agent do? Filesystem changes, transcripts, and bisecting to the first bad step.

The repository (conftest.py puts it into the parent VM) gets 200 edits from a
scripted agent (repo_agent.py); one of them breaks its tests.
"""

from __future__ import annotations

import pytest
from repo_agent import BAD_STEP, REPO, TEST_COMMAND, plan, step_actions


def healthy(vm) -> bool:
    """The repository's own tests pass in this VM."""
    return vm.exec(TEST_COMMAND).exit_code == 0


def test_changes_of_the_first_twenty_steps(forkd_vm, forkd_checkpoint):
    checkpoint = forkd_checkpoint(forkd_vm)
    for command in plan(20):
        forkd_vm.exec(command, cwd=REPO, check=True)
    with checkpoint.changes(include=(REPO,)) as changes:
        # Notes 2, 7, 12 and 17 were written and archived; archives 7, 12 and 17 removed again.
        assert changes.added == {f"{REPO}/docs", f"{REPO}/docs/archived_2.md"}
        assert changes.modified == {f"{REPO}/calc.py", f"{REPO}/NOTES.md", f"{REPO}/VERSION", f"{REPO}/run.sh"}
        assert changes[f"{REPO}/run.sh"].aspects == {"mode"}  # step 4: chmod 755, content untouched
        assert not changes.deleted
        assert "+def helper_5(x):" in changes.diff(f"{REPO}/calc.py")
        assert changes.read(f"{REPO}/VERSION") == b"0.1.4\n"


def test_bisect_finds_the_step_that_broke_the_tests(forkd_trajectory, forkd_vm):
    forkd_trajectory.run(step_actions())
    assert not healthy(forkd_vm)
    result = forkd_trajectory.bisect(healthy)
    print(result.report())  # shown with -s: the steps replayed, the restores
    assert result.first_bad == BAD_STEP
    assert result.step.name == "sed -i 's/return a + b/return a - b/' calc.py"
    assert result.restores <= 10
    # The VM is left right after the bad step: look at what it did.
    assert "return a - b" in forkd_vm.read_file(f"{REPO}/calc.py").decode()


@pytest.mark.xfail(
    reason="the agent's run breaks the tests on purpose: run with --runxfail to see the failure "
    "report with the VM's transcript (and --forkd-transcript=DIR for the JSON Lines file)",
    strict=True,
)
def test_the_agent_keeps_the_tests_green(forkd_vm):
    for command in plan(BAD_STEP + 4):
        forkd_vm.exec(command, cwd=REPO, check=True)
    result = forkd_vm.exec(TEST_COMMAND)
    assert result.ok, result.stderr
