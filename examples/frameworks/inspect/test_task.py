"""The Inspect example, run offline: ``pytest examples/frameworks/inspect``.

The first test runs the example as its users do (``python task.py``: a forkd
session of its own, the scripted model); the second runs the same task inside
a pytest test with the plugin's ``forkd_inspect_sandbox`` fixture, so its
samples fork from this run's parent VM. Inspect's logs go to ``tmp_path``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("inspect_ai", reason='needs Inspect: pip install "pytest-forkd[inspect]"')

from inspect_ai import eval as inspect_eval  # noqa: E402
from inspect_ai.model import get_model  # noqa: E402

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import task as example  # noqa: E402


def test_the_example_runs_offline_as_documented(tmp_path: Path) -> None:
    environment = {name: value for name, value in os.environ.items() if name != "OPENAI_API_KEY"}
    completed = subprocess.run(
        [sys.executable, str(HERE / "task.py"), "--log-dir", str(tmp_path / "logs")],
        capture_output=True,
        text=True,
        env=environment,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "accuracy 1.00 over 8 samples" in completed.stdout


def test_the_task_inside_a_test_with_the_forkd_fixture(forkd_inspect_sandbox: object, tmp_path: Path) -> None:
    [log] = inspect_eval(
        example.factorials(sandbox=forkd_inspect_sandbox),
        model=get_model("mockllm/model", custom_outputs=example.scripted_agent),
        max_samples=4,
        log_dir=str(tmp_path / "logs"),
        display="none",
    )
    assert log.status == "success", log.error
    assert log.results is not None and log.results.scores[0].metrics["accuracy"].value == 1.0
    answers = {sample.id: sample.scores["answer_file"].answer for sample in log.samples or []}
    assert answers == {f"n{n}": str(example.math.factorial(n)) for n in example.NUMBERS}
