"""The ``forkd_inspect_sandbox`` fixture in a real pytest run (pytester): an Inspect eval inside a test.

The inner suite prepares the parent VM in a session fixture and runs an
Inspect eval whose samples must see that state, each in its own child. After
the inner run, ``run_forkd`` checks that no process still uses the run's
private shm directory and that no run directory is left in it.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("inspect_ai", reason='needs Inspect: pip install "pytest-forkd[inspect]"')

pytestmark = pytest.mark.vm

#: The page that documents running an Inspect eval inside a test; its two code blocks are run as they are.
DOCS_PAGE = Path(__file__).parents[2] / "docs" / "frameworks" / "inspect.md"

#: The scripted model of the integration tests, copied next to the inner suite.
SCRIPTED_MODEL = Path(__file__).parents[1] / "inspect_scripts.py"

CONFTEST = """
import pytest


@pytest.fixture(scope="session", autouse=True)
def prepared(forkd_parent):
    forkd_parent.exec("echo prepared-in-parent > /root/prepared", check=True)
"""

SUITE = """
import json

from inspect_ai import Task, eval as inspect_eval
from inspect_ai.dataset import Sample
from inspect_ai.solver import generate, use_tools
from inspect_ai.tool import bash

from inspect_scripts import offline_tokens, outputs_of, scripted_model


def test_an_eval_inside_a_test(forkd_inspect_sandbox, forkd_parent, tmp_path, monkeypatch):
    offline_tokens(monkeypatch)
    commands = ["cat /root/prepared", "cat /root/mine 2>/dev/null || echo none; echo $RANDOM > /root/mine"]
    samples = [Sample(id=f"s{i}", input=json.dumps(commands)) for i in range(3)]
    task = Task(dataset=samples, solver=[use_tools(bash()), generate()], sandbox=forkd_inspect_sandbox)
    [log] = inspect_eval(task, model=scripted_model(), log_dir=str(tmp_path), display="none", max_samples=3)
    assert log.status == "success", log.error
    for sample in log.samples:
        assert outputs_of(sample) == ["prepared-in-parent\\n", "none\\n"]
    # The samples' VMs were children: the parent never saw their files.
    assert forkd_parent.exec("ls /root/mine 2>/dev/null || echo absent").stdout == "absent\\n"


def test_the_fixture_is_a_forkd_sandbox_spec(forkd_inspect_sandbox):
    assert forkd_inspect_sandbox.type == "forkd"
"""


def test_an_inspect_eval_inside_a_test_forks_its_samples_from_the_parent(
    pytester: pytest.Pytester, run_forkd: Callable[..., pytest.RunResult]
) -> None:
    shutil.copy(SCRIPTED_MODEL, pytester.path / SCRIPTED_MODEL.name)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_inspect_suite=SUITE)
    result = run_forkd("-p", "no:warnings")
    result.assert_outcomes(passed=2)


def test_the_documented_eval_inside_a_test_runs_as_written(
    pytester: pytest.Pytester, run_forkd: Callable[..., pytest.RunResult]
) -> None:
    blocks = re.findall(r"```python\n(# (conftest\.py|test_agent_eval\.py).*?)```", DOCS_PAGE.read_text(), re.DOTALL)
    files = {name: code for code, name in blocks}
    assert sorted(files) == ["conftest.py", "test_agent_eval.py"]
    pytester.makeconftest(files["conftest.py"])
    pytester.makepyfile(test_agent_eval=files["test_agent_eval.py"])
    result = run_forkd("-p", "no:warnings")
    result.assert_outcomes(passed=1)
