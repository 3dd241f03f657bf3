"""Inspect evals with ``sandbox="forkd"`` against real VMs, driven only through Inspect's public API.

The model is Inspect's ``mockllm/model`` with a scripted answer per
conversation (tests/inspect_scripts.py): it runs each sample's commands with
Inspect's own ``bash()`` tool, so every command goes through the sandbox the
way an agent's would. Inspect's logs go to ``tmp_path``; no network is used.
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import processes_mentioning

from pytest_forkd.waiting import poll_until

inspect_ai = pytest.importorskip("inspect_ai", reason="needs inspect-ai: pip install 'pytest-forkd[inspect]'")

from inspect_ai import Task  # noqa: E402
from inspect_ai import eval as inspect_eval  # noqa: E402
from inspect_ai.dataset import Sample  # noqa: E402
from inspect_ai.solver import generate, use_tools  # noqa: E402
from inspect_ai.tool import bash  # noqa: E402
from inspect_scripts import offline_tokens, outputs_of, scripted_model  # noqa: E402

from pytest_forkd.integrations.inspect_sandbox import ForkdSandboxConfig  # noqa: E402
from pytest_forkd.integrations.sessions import SESSIONS  # noqa: E402

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture
def shm_root(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private parent for this test's run directories, on /dev/shm like the real one."""
    root = Path(f"/dev/shm/forkd-inspect-{os.getpid()}-{secrets.token_hex(3)}")
    monkeypatch.setenv("FORKD_SHM_DIR", str(root))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    offline_tokens(monkeypatch)


def wait_for(predicate: Any, *, what: str, timeout: float = 30) -> None:
    poll_until(predicate, timeout=timeout, interval=0.1, what=what)


def assert_nothing_left_under(root: Path) -> None:
    """No QEMU (or anything) uses the run directories under ``root``, none is left, no session is open."""
    wait_for(lambda: processes_mentioning(root) == [], what=f"processes using {root} to exit")
    assert not root.exists() or os.listdir(root) == []
    assert SESSIONS.keys() == []


def run_eval(task: Task, log_dir: Path, **options: Any) -> Any:
    logs = inspect_eval(task, model=scripted_model(), log_dir=str(log_dir), display="none", **options)
    assert len(logs) == 1
    return logs[0]


def commands_sample(sample_id: str, commands: list[str], **fields: Any) -> Sample:
    return Sample(id=sample_id, input=json.dumps(commands), **fields)


def agent_task(samples: list[Sample], sandbox: Any = "forkd") -> Task:
    return Task(dataset=samples, solver=[use_tools(bash(timeout=120)), generate()], sandbox=sandbox)


def test_eight_samples_four_at_a_time_each_in_its_own_vm(shm_root: Path, tmp_path: Path) -> None:
    samples = [
        commands_sample(
            f"s{index}",
            [
                "cat /root/claimed-by 2>/dev/null || echo unclaimed",
                f"echo s{index} > /root/claimed-by; sleep 2; cat /root/claimed-by",
                "uname -r",
                "cat input.txt /root/setup-ran",
            ],
            files={"input.txt": f"input of s{index}\n"},
            setup=f"echo setup of s{index} > /root/setup-ran",
        )
        for index in range(8)
    ]
    log = run_eval(agent_task(samples), tmp_path / "logs", max_samples=4)

    assert log.status == "success", log.error
    assert log.eval.config.max_samples == 4
    assert len(log.samples) == 8
    for sample in log.samples:
        assert sample.error is None, sample.error
        before, claimed, kernel, files = outputs_of(sample)
        # Another sample's VM wrote /root/claimed-by meanwhile; none of it shows up here.
        assert before.strip() == "unclaimed"
        assert claimed.strip() == sample.id
        assert kernel.strip() != platform.release()
        assert kernel.strip().endswith("-amd64")
        assert files == f"input of {sample.id}\nsetup of {sample.id}\n"
    assert_nothing_left_under(shm_root)


def test_a_crashed_sample_vm_fails_that_sample_with_its_console_and_the_others_complete(
    shm_root: Path, tmp_path: Path
) -> None:
    samples = [commands_sample(f"ok{index}", ["echo fine"]) for index in range(3)]
    samples.insert(1, commands_sample("crash", ["echo c > /proc/sysrq-trigger", "echo unreachable"]))
    log = run_eval(agent_task(samples), tmp_path / "logs", max_samples=4, fail_on_error=False)

    by_id = {sample.id: sample for sample in log.samples}
    crashed = by_id.pop("crash")
    assert crashed.error is not None
    assert "GuestCrashed" in crashed.error.traceback
    assert "Kernel panic" in crashed.error.message
    for sample in by_id.values():
        assert sample.error is None, sample.error
        assert outputs_of(sample) == ["fine\n"]
    assert_nothing_left_under(shm_root)


@pytest.fixture(scope="module")
def project_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("inspect-store")


def test_a_forkd_yaml_config_selects_the_project_snapshot(
    shm_root: Path, tmp_path: Path, project_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "forkd.yaml").write_text(
        textwrap.dedent(
            f"""\
            settings:
              snapshot: prepared
              store: {project_store}
            snapshots:
              prepared:
                from: base
                workdir: /srv/app
                env: {{APP_MODE: evaluated}}
                setup:
                  - echo prepared by forkd.yaml > /srv/app/marker
              other:
                from: base
                setup:
                  - echo other > /root/other
            """
        )
    )
    monkeypatch.delenv("PYTEST_FORKD_SNAPSHOT", raising=False)
    samples = [commands_sample("one", ["pwd", "cat marker", "echo $APP_MODE"])]
    log = run_eval(agent_task(samples, sandbox=("forkd", str(project / "forkd.yaml"))), tmp_path / "logs")
    assert log.status == "success", log.error
    assert outputs_of(log.samples[0]) == ["/srv/app\n", "prepared by forkd.yaml\n", "evaluated\n"]

    # A config model names another snapshot of the same file.
    other = ForkdSandboxConfig(config=str(project / "forkd.yaml"), snapshot="other")
    log = run_eval(agent_task([commands_sample("two", ["cat /root/other"])], sandbox=("forkd", other)), tmp_path / "l2")
    assert log.status == "success", log.error
    assert outputs_of(log.samples[0]) == ["other\n"]
    assert_nothing_left_under(shm_root)


INTERRUPTED_EVAL = """
import json, sys
sys.path.insert(0, {tests!r})
from inspect_scripts import scripted_model
import inspect_ai.model._model as model_module
model_module.count_text_tokens = lambda text: max(1, len(text) // 4)
from inspect_ai import Task, eval as inspect_eval
from inspect_ai.dataset import Sample
from inspect_ai.solver import generate, use_tools
from inspect_ai.tool import bash

samples = [Sample(id=f"s{{i}}", input=json.dumps(["echo started; sleep 300"])) for i in range(3)]
task = Task(dataset=samples, solver=[use_tools(bash()), generate()], sandbox="forkd")
print("starting", flush=True)
logs = inspect_eval(task, model=scripted_model(), log_dir={logs!r}, display="none", max_samples=3)
print("statuses=" + ",".join(log.status for log in logs), flush=True)
"""


def test_an_eval_interrupted_with_ctrl_c_leaves_no_vm(shm_root: Path, tmp_path: Path) -> None:
    script = tmp_path / "interrupted.py"
    script.write_text(INTERRUPTED_EVAL.format(tests=str(TESTS), logs=str(tmp_path / "logs")))
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        # Interrupt once the samples' VMs are up: three QEMU processes of this run at least.
        wait_for(lambda: len(processes_mentioning(shm_root)) >= 3, what="three sample VMs to run", timeout=240)
        process.send_signal(signal.SIGINT)
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        output = process.stdout.read().decode(errors="replace") if process.stdout else ""
    # Inspect absorbs the interruption and returns (the cancelled eval's log, if it wrote one).
    assert "statuses=" in output, output
    assert "success" not in output, output
    assert_nothing_left_under(shm_root)
