"""The E2B agent's tests: its code calls plain ``Sandbox.create()``; ``forkd_e2b`` makes that a forked microVM.

``forkd_e2b`` points E2B's SDK at forkd's E2B server for each test (the
variables ``E2B_API_URL``, ``E2B_SANDBOX_URL``, ``E2B_API_KEY``), kills what a
test leaves, and hands out each sandbox as a forkd VM, to check what the
agent left in it. Offline: the agent's model is scripted.
"""

import pytest

pytest.importorskip("e2b", reason="the E2B example: pip install 'pytest-forkd[e2b]'")

from e2b import Sandbox  # noqa: E402
from word_count_agent import DATA, EXAMPLE_DOCUMENTS, WORKDIR, ScriptedModel, count_words, run_agent  # noqa: E402

EXPECTED = {"total": 21, "top": [["the", 5], ["dog", 3], ["fox", 2]]}


def test_the_agent_counts_the_words_in_a_sandbox_of_its_own(forkd_e2b):
    result = count_words(EXAMPLE_DOCUMENTS)
    assert result.report == EXPECTED
    assert result.attempts == 2  # its first script failed in the sandbox, and the error reached the model
    assert "NameError: name 'Counter' is not defined" in result.errors[0]
    assert forkd_e2b.sandbox_ids() == []  # the agent's `with Sandbox.create()` killed it: its VM is gone


def test_what_the_agent_left_in_its_sandbox(forkd_e2b):
    sandbox = Sandbox.create()  # what the agent's own code does; here the test keeps the sandbox to look into it
    model = ScriptedModel()
    result = run_agent(sandbox, model, EXAMPLE_DOCUMENTS)

    vm = forkd_e2b.vm(sandbox.sandbox_id)  # the same sandbox as a forkd VM
    report = vm.read_file(f"{WORKDIR}/report.json").decode()
    assert report == sandbox.files.read(f"{WORKDIR}/report.json")  # the VM's file is the sandbox's
    rerun = vm.exec(f"python3 {WORKDIR}/count_words.py {DATA}", check=True)
    assert rerun.stdout == report  # the script the agent left works when run again
    assert vm.exec(f"ls {DATA}").stdout.split() == sorted(EXAMPLE_DOCUMENTS)
    assert result.report == EXPECTED and len(model.prompts) == 2
    # No sandbox.kill(): forkd_e2b kills what a test leaves once it ends.
