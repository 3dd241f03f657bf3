"""Inspect configs that name a container image (compose.yaml, Dockerfile, ComposeConfig), without VMs.

What the ``forkd`` sandbox reads from them and how a config it cannot run
fails: as the error of each sample that uses it, in forkd's one line, while
the eval goes on. Samples in real VMs of registry images are in
tests/integrations/test_inspect_compose_vm.py.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from inspect_scripts import offline_tokens, scripted_model

from pytest_forkd.errors import ConfigError
from pytest_forkd.integrations.compose import ServiceBuild
from pytest_forkd.integrations.compose_commands import ServiceProcess
from pytest_forkd.integrations.sessions import SESSIONS, ImageGuest

if TYPE_CHECKING:  # bound by inspect_imported below
    from inspect_ai import Task
    from inspect_ai import eval as inspect_eval
    from inspect_ai._eval.loader import resolve_task_sandbox
    from inspect_ai.dataset import Sample
    from inspect_ai.util import ComposeConfig

    from pytest_forkd.integrations import inspect_sandbox
    from pytest_forkd.integrations import inspect_support as support
    from pytest_forkd.integrations.inspect_sandbox import ForkdSandboxEnvironment


@pytest.fixture(autouse=True, scope="module")
def inspect_imported() -> None:
    """Inspect and forkd's sandbox for it, imported when this module's first test runs, not at collection.

    Importing Inspect takes a second: a run that selects none of these tests
    (``-k``, another file) does not pay it. The names become the module's, as
    imports at its top would make them.
    """
    global Task, inspect_eval, resolve_task_sandbox, Sample, ComposeConfig
    global inspect_sandbox, support, ForkdSandboxEnvironment
    pytest.importorskip("inspect_ai", reason="needs inspect-ai: pip install 'pytest-forkd[inspect]'")
    from inspect_ai import Task
    from inspect_ai import eval as inspect_eval
    from inspect_ai._eval.loader import resolve_task_sandbox
    from inspect_ai.dataset import Sample
    from inspect_ai.util import ComposeConfig

    from pytest_forkd.integrations import inspect_sandbox
    from pytest_forkd.integrations import inspect_support as support
    from pytest_forkd.integrations.inspect_sandbox import ForkdSandboxEnvironment


COMPOSE = """\
services:
  default:
    image: 127.0.0.1:5000/project:${TAG:-1}
    working_dir: /srv/project
    environment: {MODE: evaluated}
    user: agent
    mem_limit: 512m
    init: true
    command: tail -f /dev/null
    network_mode: none
"""


def test_image_configs_are_recognised_and_forkd_yaml_is_not() -> None:
    for config in ("compose.yaml", "task/docker-compose.yml", "ctf-compose.yaml", "Dockerfile", "x.Dockerfile"):
        assert support.is_image_config(config), config
    assert support.is_image_config(ComposeConfig.model_validate({"services": {"default": {"image": "x"}}}))
    for config in (None, "forkd.yaml", support.ForkdSandboxConfig(config="forkd.yaml")):
        assert not support.is_image_config(config), config


def test_a_compose_file_is_read_relative_to_the_task(tmp_path: Path) -> None:
    (tmp_path / "compose.yaml").write_text(COMPOSE)
    sample = support.image_sample("compose.yaml", base=tmp_path, environ={"TAG": "2"})
    assert sample.user == "agent"
    assert sample.guest == ImageGuest(
        reference="docker://127.0.0.1:5000/project:2",
        workdir="/srv/project",
        env=(("MODE", "evaluated"),),
        memory_mib=512,
        network="none",
        process=ServiceProcess(command=("tail", "-f", "/dev/null")),  # started in the parent VM, as its user
        process_user="agent",
    )
    assert sample.guest.origin == "compose.yaml: services.default"
    assert sample.guest.snapshot_name().startswith("image-project_2-")


def test_a_dockerfile_and_a_compose_config_model(tmp_path: Path) -> None:
    (tmp_path / "Dockerfile").write_text("FROM base\n")
    sample = support.image_sample("Dockerfile", base=tmp_path, environ={})
    assert sample.guest.build == ServiceBuild(context=tmp_path, dockerfile=tmp_path / "Dockerfile")
    assert sample.guest.network == "none" and sample.user is None

    model = ComposeConfig.model_validate(
        {"services": {"agent": {"image": "python:3.12", "x-default": True, "environment": ["A=1"]}}}
    )
    sample = support.image_sample(model, base=tmp_path, environ={})
    assert sample.guest.reference == "docker://docker.io/library/python:3.12"
    assert sample.guest.env == (("A", "1"),) and sample.guest.origin == "ComposeConfig: services.agent"


def test_sample_metadata_is_offered_as_inspects_docker_sandbox_offers_it(tmp_path: Path) -> None:
    (tmp_path / "compose.yaml").write_text("services:\n  default: {image: 'x:${SAMPLE_METADATA_IMAGE_TAG}'}\n")
    metadata = {"image tag": "7", "unused": "no"}
    assert support.metadata_environment("compose.yaml", metadata, base=tmp_path) == {"SAMPLE_METADATA_IMAGE_TAG": "7"}
    assert support.metadata_environment("Dockerfile", metadata, base=tmp_path) == {}
    environ = support.metadata_environment("compose.yaml", metadata, base=tmp_path)
    assert support.image_sample("compose.yaml", base=tmp_path, environ=environ).guest.reference == (
        "docker://docker.io/library/x:7"
    )


def test_a_docker_task_run_with_sandbox_forkd_keeps_its_compose_file(tmp_path: Path) -> None:
    """``inspect eval task.py --sandbox forkd`` on a task written for docker: forkd is docker-compatible."""
    task = Task(dataset=[Sample(input="x")], sandbox=("docker", "compose.yaml"))
    resolved = resolve_task_sandbox(task, "forkd")
    assert resolved is not None and resolved.type == "forkd"
    assert isinstance(resolved.config, str) and Path(resolved.config).name == "compose.yaml"


def one_sample(sample_id: str, config: str) -> Sample:
    return Sample(id=sample_id, input="[]", sandbox=("forkd", config))


@pytest.mark.slow  # a real Inspect eval of three samples: seconds
def test_configs_forkd_cannot_run_fail_their_own_samples_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    offline_tokens(monkeypatch)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "two-services-compose.yaml").write_text("services:\n  default: {image: x}\n  db: {image: postgres}\n")
    (tmp_path / "bind-compose.yaml").write_text(
        textwrap.dedent(
            """\
            services:
              default:
                image: x
                volumes: ["./src:/srv/src"]
            """
        )
    )
    (tmp_path / "nodefault-compose.yaml").write_text("services:\n  app: {image: x}\n")
    samples = [
        one_sample("two", "two-services-compose.yaml"),
        one_sample("bind", "bind-compose.yaml"),
        one_sample("nodefault", "nodefault-compose.yaml"),
    ]
    task = Task(dataset=samples, sandbox="forkd")
    [log] = inspect_eval(
        task, model=scripted_model(), log_dir=str(tmp_path / "logs"), display="none", fail_on_error=False
    )
    errors: dict[Any, str] = {sample.id: sample.error.message for sample in log.samples or [] if sample.error}
    assert set(errors) == {"two", "bind", "nodefault"}, errors
    assert "cannot start 'db' beside it" in errors["two"]
    assert "a VM cannot mount the host folder './src'" in errors["bind"]
    assert "no default service among 'app'" in errors["nodefault"]
    for message in errors.values():
        assert "\n" not in message.strip(), message
    assert SESSIONS.keys() == []


def test_a_build_forkd_cannot_find_fails_before_anything_boots(tmp_path: Path) -> None:
    (tmp_path / "compose.yaml").write_text("services:\n  default:\n    build: {context: ., dockerfile: Missing}\n")
    with pytest.raises(ConfigError, match="services.default.build.dockerfile: no such Dockerfile"):
        support.image_sample("compose.yaml", base=tmp_path, environ={})


def test_a_bare_dockerfile_starts_no_main_process_as_inspects_compose_file_for_it_replaces_its_cmd(
    tmp_path: Path,
) -> None:
    (tmp_path / "Dockerfile").write_text('FROM base\nCMD ["python3", "-m", "http.server"]\n')
    assert support.image_sample("Dockerfile", base=tmp_path, environ={}).guest.process is None


@pytest.mark.parametrize(("display", "printed"), [("full", True), ("plain", True), ("none", False)])
def test_build_progress_reaches_inspects_console_during_task_init(
    display: str,
    printed: bool,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Inspect suspends its display around task_init: a build's lines are printed there (not with display none)."""
    monkeypatch.setattr(inspect_sandbox, "display_type", lambda: display)
    with caplog.at_level("DEBUG", logger=inspect_sandbox.__name__):
        inspect_sandbox._progress(announce=True)("podman: STEP 1/3: FROM scratch")
        inspect_sandbox._progress(announce=False)("during a sample: the log only")
    out = capsys.readouterr().out
    assert ("podman: STEP 1/3: FROM scratch" in out) == printed
    assert "during a sample" not in out
    logged = [record.getMessage() for record in caplog.records]
    assert "podman: STEP 1/3: FROM scratch" in logged and "during a sample: the log only" in logged


FAILING_PODMAN = """\
#!/bin/sh
case "$1" in
  build) echo "STEP 1/2: FROM scratch"; echo "STEP 2/2: RUN make" ; echo "Error: the build broke" >&2; exit 1;;
  *) exit 1;;
esac
"""


def test_task_init_of_a_build_prints_the_builders_lines_for_inspects_console(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The lines reach the console from task_init itself (a failing build: no VM starts)."""
    import asyncio

    fake = tmp_path / "bin" / "podman"
    fake.parent.mkdir()
    fake.write_text(FAILING_PODMAN)
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:/usr/bin:/bin")
    monkeypatch.setenv("FORKD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(inspect_sandbox, "display_type", lambda: "full")
    (tmp_path / "Dockerfile").write_text("FROM scratch\nRUN make\n")
    (tmp_path / "compose.yaml").write_text("services:\n  default: {build: ., network_mode: none}\n")
    config = str(tmp_path / "compose.yaml")

    async def init_then_clean_up() -> None:
        await ForkdSandboxEnvironment.task_init("build", config)
        await ForkdSandboxEnvironment.task_cleanup("build", config, True)

    asyncio.run(init_then_clean_up())
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"building dockerfile:{tmp_path / 'Dockerfile'} with podman (context {tmp_path}, key "), (
        out
    )
    assert out[1:3] == ["podman: STEP 1/2: FROM scratch", "podman: STEP 2/2: RUN make"], out
    assert SESSIONS.keys() == []


def test_the_sandbox_reads_its_config_files_as_docker_compatible() -> None:
    assert "compose.yaml" in ForkdSandboxEnvironment.config_files()
    assert ForkdSandboxEnvironment.config_files()[0] == "forkd.yaml"  # forkd's own file wins beside a compose file
