"""Inspect evals whose sandbox is a compose file, against real VMs of images from a real local registry.

The compose files name an image the tests push to Debian's docker-registry on
127.0.0.1 with skopeo (:mod:`project_images`), by a bare reference as Docker
reads it, or build one FROM it with podman. The model is Inspect's mockllm,
scripted per conversation (tests/inspect_scripts.py), so every command goes
through Inspect's ``bash()`` tool into the sample's VM. Inspect's own
conformance suite runs against a sample of an image whose user is not root.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from project_images import IMAGE_MARK, IMAGE_MARK_TEXT
from registry import Registry
from support import processes_mentioning

from pytest_forkd.waiting import poll_until

pytest.importorskip("inspect_ai", reason="needs inspect-ai: pip install 'pytest-forkd[inspect]'")

from inspect_ai import Task  # noqa: E402
from inspect_ai import eval as inspect_eval  # noqa: E402
from inspect_ai.dataset import Sample  # noqa: E402
from inspect_ai.solver import generate, use_tools  # noqa: E402
from inspect_ai.tool import bash  # noqa: E402
from inspect_ai.util._sandbox import self_check  # noqa: E402
from inspect_scripts import offline_tokens, outputs_of, scripted_model  # noqa: E402

from pytest_forkd.integrations.inspect_sandbox import ForkdSandboxEnvironment  # noqa: E402
from pytest_forkd.integrations.sessions import SESSIONS  # noqa: E402

pytestmark = pytest.mark.vm

#: A compose file written for docker: a bare registry reference, working_dir, environment, and keys that mean
#: nothing for a VM (accepted, listed once in the log).
COMPOSE = """\
services:
  default:
    image: {image}
    working_dir: /srv/project
    environment:
      - MODE=evaluated
    mem_limit: 512m
    network_mode: none
    init: true
    command: tail -f /dev/null
    stop_grace_period: 1s
    healthcheck: {{test: [CMD, "true"], interval: 5s}}
    cap_add: [SYS_PTRACE]
    x-local: true
"""


@pytest.fixture
def shm_root(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private parent for this test's run directories, on /dev/shm like the real one."""
    root = Path(f"/dev/shm/forkd-compose-{os.getpid()}-{secrets.token_hex(3)}")
    monkeypatch.setenv("FORKD_SHM_DIR", str(root))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    offline_tokens(monkeypatch)


def assert_nothing_left_under(root: Path) -> None:
    poll_until(lambda: processes_mentioning(root) == [], timeout=30, interval=0.1, what=f"processes using {root}")
    assert not root.exists() or os.listdir(root) == []
    assert SESSIONS.keys() == []


def commands_sample(sample_id: str, commands: list[str], **fields: Any) -> Sample:
    import json

    return Sample(id=sample_id, input=json.dumps(commands), **fields)


def run_eval(samples: list[Sample], sandbox: Any, log_dir: Path, **options: Any) -> Any:
    task = Task(dataset=samples, solver=[use_tools(bash(timeout=120)), generate()], sandbox=sandbox)
    [log] = inspect_eval(task, model=scripted_model(), log_dir=str(log_dir), display="none", **options)
    return log


def isolation_commands(sample_id: str) -> list[str]:
    """What each sample runs: where, with what environment, in which image, and whether it sees the others."""
    return [
        "pwd",
        'echo "$MODE $PROJECT $(id -u)"',
        f"cat {IMAGE_MARK}",
        "cat claimed 2>/dev/null || echo unclaimed",
        f"echo {sample_id} > claimed; sleep 2; cat claimed",
        "python3 test_calc.py 2>&1 | tail -1",
    ]


def check_isolated_samples(log: Any) -> None:
    assert log.status == "success", log.error
    assert len(log.samples) == 4
    for sample in log.samples:
        assert sample.error is None, sample.error
        pwd, env, mark, before, claimed, tests = outputs_of(sample)
        assert pwd == "/srv/project\n"  # the compose file's working_dir
        assert env == "evaluated calc 0\n"  # its environment over the image's Env, as root
        assert mark == IMAGE_MARK_TEXT  # the image's own layer
        assert before == "unclaimed\n"  # another sample wrote ./claimed meanwhile: none of it shows here
        assert claimed == f"{sample.id}\n"
        assert tests == "FAILED (failures=1)\n"  # the image's project, bug included


def test_four_samples_two_at_a_time_in_vms_of_a_registry_image(
    project_image: str, shm_root: Path, tmp_path: Path
) -> None:
    task_dir = tmp_path / "task"
    task_dir.mkdir()
    # A bare reference, as Docker reads it: 127.0.0.1:PORT/forkd-tests/project:1.
    (task_dir / "compose.yaml").write_text(COMPOSE.format(image=project_image))
    samples = [commands_sample(f"s{index}", isolation_commands(f"s{index}")) for index in range(4)]
    log = run_eval(samples, ("forkd", str(task_dir / "compose.yaml")), tmp_path / "logs", max_samples=2)
    check_isolated_samples(log)
    assert log.eval.config.max_samples == 2
    assert_nothing_left_under(shm_root)


BUILD_COMPOSE = """\
services:
  default:
    build:
      context: image
      dockerfile: eval.Dockerfile
      args: {{BASE: "{base}", V: "{v}"}}
    working_dir: /srv/project
    environment: {{MODE: evaluated}}
    network_mode: none
    init: true
"""
#: The build's CMD (no compose command replaces it) runs once in the parent VM: every sample sees what it wrote.
BUILD_DOCKERFILE = """\
ARG BASE
FROM ${BASE}
ARG V
COPY notes.txt /srv/project/notes.txt
RUN echo "$V" > /srv/project/v
ENV BUILT=by-podman
CMD ["bash", "-c", "echo started-$(cat /srv/project/v) > /tmp/cmd-ran; exec sleep infinity"]
"""


def test_builds_of_one_dockerfile_with_other_arguments_are_other_images_and_run_their_cmd(
    project_image: str, registry: Registry, shm_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """V=1, then V=2, then V=1 again: each eval sees its own V; the third builds nothing (nor do Inspect's logs)."""
    if shutil.which("podman") is None:
        pytest.skip("needs podman (apt-get install podman)")
    from pytest_forkd.image.oci.builders import build_tag
    from pytest_forkd.image.oci.store import read_index

    # podman pulls the FROM image over plain HTTP only from a registry it is told is insecure.
    registries = tmp_path / "registries.conf"
    registries.write_text(f'[[registry]]\nlocation = "{registry.host}"\ninsecure = true\n')
    monkeypatch.setenv("CONTAINERS_REGISTRIES_CONF", str(registries))
    task_dir = tmp_path / "task"
    context = task_dir / "image"
    context.mkdir(parents=True)
    (context / "eval.Dockerfile").write_text(BUILD_DOCKERFILE)
    (context / "notes.txt").write_text(f"built {secrets.token_hex(4)}\n")
    (context / ".dockerignore").write_text("logs/\n")
    logs = context / "logs"  # Inspect's logs land in the build context, as when a task's folder is its context
    for v in ("1", "2"):
        (task_dir / f"v{v}-compose.yaml").write_text(BUILD_COMPOSE.format(base=project_image, v=v))

    samples = []
    for index in range(4):
        commands = isolation_commands(f"b{index}")
        samples.append(
            commands_sample(
                f"b{index}", [*commands[:5], "cat notes.txt; echo $BUILT", "cat v /tmp/cmd-ran", commands[5]]
            )
        )
    log = run_eval(samples, ("forkd", str(task_dir / "v1-compose.yaml")), logs, max_samples=2)
    assert log.status == "success", log.error
    notes = (context / "notes.txt").read_text()
    for sample in log.samples:
        assert sample.error is None, sample.error
        outputs = outputs_of(sample)
        assert outputs[:3] == ["/srv/project\n", "evaluated calc 0\n", IMAGE_MARK_TEXT]
        assert outputs[3:5] == ["unclaimed\n", f"{sample.id}\n"]
        assert outputs[5] == notes + "by-podman\n"  # the build's own layer and ENV
        assert outputs[6] == "1\nstarted-1\n"  # its argument, and its CMD, run once in the parent

    for v in ("2", "1"):
        again = run_eval(
            [commands_sample(f"v{v}", ["cat v /tmp/cmd-ran"])], ("forkd", str(task_dir / f"v{v}-compose.yaml")), logs
        )
        assert again.status == "success", again.error
        assert outputs_of(again.samples[0]) == [f"{v}\nstarted-{v}\n"]
    builds = [name for name in read_index() if name.startswith(f"dockerfile:{context / 'eval.Dockerfile'}@")]
    try:
        assert len(builds) == 2, builds  # V=1 and V=2; Inspect's new logs (ignored) built nothing a third time
        assert len(list(logs.glob("*.eval"))) == 3
        assert_nothing_left_under(shm_root)
    finally:  # the builder's storage is the host's: take out this test's tags and the base it pulled
        tags = [build_tag(name.rpartition("@sha256:")[2]) for name in builds]
        subprocess.run(["podman", "rmi", *tags, project_image], capture_output=True, timeout=120)


def test_an_image_that_cannot_be_pulled_fails_its_samples_and_the_others_go_on(
    project_image: str, registry: Registry, shm_root: Path, tmp_path: Path
) -> None:
    good = tmp_path / "good-compose.yaml"
    good.write_text(f"services:\n  default:\n    image: {project_image}\n    network_mode: none\n")
    missing = tmp_path / "missing-compose.yaml"
    missing.write_text(f"services:\n  default:\n    image: {registry.host}/forkd-tests/no-such-image:1\n")
    samples = [
        commands_sample("good-1", ["cat /etc/forkd-project"], sandbox=("forkd", str(good))),
        commands_sample("missing-1", ["true"], sandbox=("forkd", str(missing))),
        commands_sample("missing-2", ["true"], sandbox=("forkd", str(missing))),
        commands_sample("good-2", ["cat /etc/forkd-project"], sandbox=("forkd", str(good))),
    ]
    log = run_eval(samples, "forkd", tmp_path / "logs", max_samples=2, fail_on_error=False)
    by_id = {sample.id: sample for sample in log.samples}
    for name in ("good-1", "good-2"):
        assert by_id[name].error is None, by_id[name].error
        assert outputs_of(by_id[name]) == [IMAGE_MARK_TEXT]
    for name in ("missing-1", "missing-2"):
        error = by_id[name].error
        assert error is not None
        assert "no-such-image" in error.message and "\n" not in error.message.strip(), error.message
    assert_nothing_left_under(shm_root)


# -- Inspect's conformance suite, against a sample of an image whose user is not root ----------------------------


@pytest.fixture(scope="module")
def agent_sample(agent_image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkdSandboxEnvironment]:
    task_dir = tmp_path_factory.mktemp("self-check")
    (task_dir / "compose.yaml").write_text(
        # The default guest memory: the suite writes 50 MiB as a non-root user, streamed into the file in place.
        f"services:\n  default:\n    image: {agent_image}\n    network_mode: none\n    init: true\n"
    )
    config = str(task_dir / "compose.yaml")

    async def start() -> ForkdSandboxEnvironment:
        await ForkdSandboxEnvironment.task_init("self-check", config)
        environments = await ForkdSandboxEnvironment.sample_init("self-check", config, {})
        environment = environments["default"]
        assert isinstance(environment, ForkdSandboxEnvironment)
        return environment

    async def stop(environment: ForkdSandboxEnvironment) -> None:
        await ForkdSandboxEnvironment.sample_cleanup("self-check", config, {"default": environment}, False)
        await ForkdSandboxEnvironment.task_cleanup("self-check", config, True)

    environment = asyncio.run(start())
    try:
        yield environment
    finally:
        asyncio.run(stop(environment))
    assert SESSIONS.keys() == []


def test_the_sample_runs_as_the_images_user_in_its_working_directory(agent_sample: ForkdSandboxEnvironment) -> None:
    assert (agent_sample.workdir, agent_sample.user) == ("/home/agent", "agent")
    who = asyncio.run(agent_sample.exec(["sh", "-c", "id -un; pwd; echo $HOME"]))
    assert who.stdout.split() == ["agent", "/home/agent", "/home/agent"]


@pytest.mark.parametrize("check", self_check.__all__)
def test_inspect_conformance_in_full(check: str, agent_sample: ForkdSandboxEnvironment) -> None:
    asyncio.run(getattr(self_check, check)(agent_sample))
