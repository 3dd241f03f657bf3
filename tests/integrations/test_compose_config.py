"""Compose files and Dockerfiles read as forkd guests, without VMs: the default service and what forkd makes of it."""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

import pytest

from pytest_forkd.errors import ConfigError
from pytest_forkd.integrations import compose
from pytest_forkd.integrations.compose import ComposeService, ServiceBuild, load_compose
from pytest_forkd.integrations.compose_commands import Healthcheck, ServiceProcess


def write(tmp_path: Path, text: str, name: str = "compose.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def one_line_error(path: Path, *, environ: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as caught:
        load_compose(path, environ=environ or {})
    message = str(caught.value)
    assert "\n" not in message, message
    return message


def test_a_registry_image_with_working_dir_environment_user_and_keys_without_meaning(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        services:
          default:
            image: 127.0.0.1:5000/project:1
            working_dir: /srv/project
            environment:
              - MODE=evaluated
              - EMPTY=
              - FROM_HOST
              - NOT_ON_HOST
            user: agent
            init: true
            command: tail -f /dev/null
            healthcheck: {test: [CMD, "true"], interval: 5s}
            stop_grace_period: 1s
            x-local: true
        """,
    )
    service = load_compose(path, environ={"FROM_HOST": "given"})
    assert service == ComposeService(
        name="default",
        origin="compose.yaml: services.default",
        image="127.0.0.1:5000/project:1",
        working_dir="/srv/project",
        environment=(("MODE", "evaluated"), ("EMPTY", ""), ("FROM_HOST", "given")),
        user="agent",
        network="outbound",
        process=ServiceProcess(command=("tail", "-f", "/dev/null"), healthcheck=Healthcheck(("true",), interval_s=5.0)),
    )
    assert service.ignored == ("init", "stop_grace_period")
    assert service.env == {"MODE": "evaluated", "EMPTY": "", "FROM_HOST": "given"}


def test_environment_as_a_mapping_over_env_files(tmp_path: Path) -> None:
    (tmp_path / "app.env").write_text('# settings\nexport A=from-file\nB="quoted # kept"\nC=plain # comment\nD\n')
    path = write(
        tmp_path,
        """\
        services:
          default:
            image: python:3.12
            env_file: [app.env, {path: missing.env, required: false}]
            environment: {A: overrides, NUMBER: 3, FLAG: true, UNSET_ON_HOST: null}
        """,
    )
    assert load_compose(path, environ={}).env == {
        "A": "overrides",
        "B": "quoted # kept",
        "C": "plain",
        "NUMBER": "3",
        "FLAG": "true",
    }


def test_the_default_service_is_picked_as_inspects_docker_sandbox_picks_it() -> None:
    assert compose.default_service_name({"default": {}}) == "default"
    # x-default wins over a service named default; the last marked one wins among several.
    assert compose.default_service_name({"default": {}, "agent": {"x-default": True}}) == "agent"
    assert compose.default_service_name({"a": {"x-default": True}, "b": {"x-default": True}}) == "b"
    with pytest.raises(ConfigError, match="no default service among 'app'; name the service .* 'x-default: true'"):
        compose.default_service_name({"app": {"image": "x"}})


def test_other_services_are_refused_listing_them(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        services:
          default: {image: alpine}
          db: {image: postgres}
          cache: {image: redis}
        """,
    )
    message = one_line_error(path)
    assert "'cache', 'db'" in message and "of the default service 'default'" in message
    assert "remove them or run this eval with the docker sandbox" in message


def test_a_build_as_a_context_string_or_a_mapping_with_args(tmp_path: Path) -> None:
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "Dockerfile").write_text("FROM base\n")
    (tmp_path / "app" / "eval.Dockerfile").write_text("ARG BASE\nFROM ${BASE}\n")
    path = write(tmp_path, "services:\n  default:\n    build: app\n    image: tagged-as:1\n")
    service = load_compose(path, environ={})
    assert service.image is None  # built: the image name is only the tag Docker would give it
    assert service.build == ServiceBuild(context=tmp_path / "app", dockerfile=tmp_path / "app" / "Dockerfile")

    path = write(
        tmp_path,
        """\
        services:
          default:
            build:
              context: ./app
              dockerfile: eval.Dockerfile
              args: {BASE: "${BASE_IMAGE:-python:3.12}", FROM_HOST: null}
              no_cache: true
        """,
    )
    service = load_compose(path, environ={"FROM_HOST": "h"})
    assert service.build is not None
    assert service.build.dockerfile == tmp_path / "app" / "eval.Dockerfile"
    assert service.build.arguments == {"BASE": "python:3.12", "FROM_HOST": "h"}
    assert service.ignored == ("build.no_cache",)
    assert load_compose(path, environ={"BASE_IMAGE": "127.0.0.1:5000/base:1"}).build.arguments["BASE"] == (  # type: ignore[union-attr]
        "127.0.0.1:5000/base:1"
    )


def test_a_bare_dockerfile_builds_in_its_folder_without_a_network(tmp_path: Path) -> None:
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM base\n")
    service = compose.dockerfile_service(dockerfile)
    assert service.build == ServiceBuild(context=tmp_path, dockerfile=dockerfile)
    assert service.network == "none"
    with pytest.raises(ConfigError, match="no such Dockerfile"):
        compose.dockerfile_service(tmp_path / "missing" / "Dockerfile")


def test_resources_and_network_become_the_vms(tmp_path: Path) -> None:
    path = write(tmp_path, "services:\n  default: {image: x, mem_limit: 1.5g, cpus: 1.5, network_mode: none}\n")
    service = load_compose(path, environ={})
    assert (service.memory_mib, service.vcpus, service.network) == (1536, 2, "none")

    path = write(
        tmp_path,
        """\
        services:
          default:
            image: x
            networks: [inner]
            deploy:
              replicas: 1
              resources:
                limits: {memory: 512M, cpus: "0.5", pids: 100}
                reservations: {memory: 128m}
        networks: {inner: {}}
        """,
    )
    service = load_compose(path, environ={})
    assert (service.memory_mib, service.vcpus, service.network) == (512, 1, "outbound")
    assert set(service.ignored) == {"deploy.replicas", "deploy.resources.reservations"}
    assert service.unhonoured == ("deploy.resources.limits.pids",)
    assert (
        load_compose(write(tmp_path, "services:\n  default: {image: x, mem_limit: 268435456}\n"), environ={}).memory_mib
        == 256
    )


@pytest.mark.parametrize(
    ("service", "expected"),
    [
        (
            "{image: x, mem_limit: lots}",
            "services.default.mem_limit: expected a size such as 512m or 2g, got str 'lots'",
        ),
        ("{image: x, cpus: 0}", "services.default.cpus: expected a number of CPUs"),
        ("{image: x, network_mode: 'service:db'}", "shares another container's network, which a VM cannot"),
        ("{image: x, volumes: ['./src:/srv/src']}", "a VM cannot mount the host folder './src'"),
        ("{image: x, volumes: [{type: bind, source: /etc, target: /host}]}", "cannot mount the host folder '/etc'"),
        ("{image: x, secrets: [token]}", "services.default.secrets: forkd cannot run a VM with this key"),
        ("{image: x, working_dri: /srv}", "services.default.working_dri: unknown key"),
        ("{image: x, working_dir: relative}", "working_dir: expected an absolute path"),
        ("{image: x, platform: linux/arm64}", "forkd runs linux/amd64 images only"),
        ("{command: sleep 1}", "services.default: the service has neither image: nor build:"),
        ("{image: ''}", "services.default.image: expected an image reference"),
        ("{build: {context: ., ssh: [default]}}", "services.default.build.ssh: forkd builds with context"),
        ("{build: {context: ., target: 'two words'}}", "build.target: expected the name of a build stage"),
        ("{build: {context: ., platforms: [linux/arm64]}}", "build.platforms: forkd runs linux/amd64 images only"),
        ("{build: no-such-folder}", "services.default.build.context: no such folder"),
        ("{build: ., environment: [=x]}", "environment[0]: expected a variable name"),
        ("{image: '${IMAGE:?name the image in IMAGE}'}", "required variable IMAGE is missing a value: name the image"),
        ("{image: '${IMAGE'}", "a '${' is not closed"),
        ("{image: x, env_file: missing.env}", "no such env file"),
    ],
)
def test_bad_services_fail_with_one_line_naming_the_key(tmp_path: Path, service: str, expected: str) -> None:
    (tmp_path / "Dockerfile").write_text("FROM base\n")
    message = one_line_error(write(tmp_path, f"services:\n  default: {service}\n"))
    assert message.startswith("compose.yaml: services"), message
    assert expected in message, message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("services: {}\n", "compose.yaml: services: no services"),
        ("- a list\n", "expected a mapping with a services: key"),
        ("services:\n  default: {image: x}\ninclude: [other.yaml]\n", "included compose files are not read"),
        ("services:\n  default: {image: x}\nservice: {}\n", "service: unknown top-level key"),
        ("services:\n  default: [image]\n", "services.default: expected a mapping of service keys"),
        ("services:\n  default: {image: x\n", "compose.yaml: not valid YAML at line"),
    ],
)
def test_bad_files_fail_with_one_line(tmp_path: Path, text: str, expected: str) -> None:
    assert expected in one_line_error(write(tmp_path, text))


def test_a_missing_compose_file_names_its_path(tmp_path: Path) -> None:
    assert f"{tmp_path / 'compose.yaml'}: no such compose file" in one_line_error(tmp_path / "compose.yaml")


def test_interpolation_as_compose_does_it(tmp_path: Path) -> None:
    environ = {"SET": "value", "EMPTY": ""}
    cases = {
        "$SET-${SET}": "value-value",
        "${UNSET:-fallback} ${EMPTY:-fallback} ${EMPTY-kept}": "fallback fallback ",
        "${SET:+alt} ${EMPTY:+alt} ${EMPTY+alt} ${UNSET+alt}": "alt  alt ",
        "cost: $$5 and $$SET": "cost: $5 and $SET",
        "${UNSET:-${SET}/nested}": "value/nested",
        "${UNSET}": "",
        "a lone $ stays": "a lone $ stays",
    }
    for text, expected in cases.items():
        assert compose.interpolate(text, environ, "compose.yaml") == expected, text
    assert compose.interpolate({"k": ["$SET", 1, None]}, environ, "c") == {"k": ["value", 1, None]}


def test_the_dotenv_beside_the_compose_file_is_read_under_the_environment(tmp_path: Path) -> None:
    (tmp_path / ".env").write_text("TAG=from-dotenv\nREGISTRY=127.0.0.1:5000\n")
    path = write(tmp_path, "services:\n  default:\n    image: ${REGISTRY}/project:${TAG}\n")
    assert load_compose(path, environ={}).image == "127.0.0.1:5000/project:from-dotenv"
    assert load_compose(path, environ={"TAG": "2"}).image == "127.0.0.1:5000/project:2"


def test_config_names_are_recognised_as_inspect_recognises_them() -> None:
    assert all(compose.is_compose_file(name) for name in ("compose.yaml", "x/docker-compose.yml", "ctf-compose.yaml"))
    assert not compose.is_compose_file("forkd.yaml")
    assert all(
        compose.is_dockerfile(name) for name in ("Dockerfile", "a/Dockerfile", "eval.Dockerfile", "Dockerfile.gpu")
    )
    assert not compose.is_dockerfile("forkd.yaml")


def test_equal_services_are_one_key_whatever_they_ignored() -> None:
    one = ComposeService(name="default", origin="a", image="x", ignored=("init",))
    other = ComposeService(name="default", origin="a", image="x", ignored=())
    assert one == other and hash(one) == hash(other)


def test_keys_without_meaning_are_listed_once_in_the_log(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write(
        tmp_path,
        "services:\n  default: {image: x, init: true, restart: always, command: sleep 1, read_only: true,"
        " hostname: box, cap_drop: [ALL]}\n",
        name="once-compose.yaml",
    )
    service = load_compose(path, environ={})
    with caplog.at_level(logging.INFO, logger="pytest_forkd.integrations.compose"):
        compose.log_ignored(service)
        compose.log_ignored(load_compose(path, environ={}))
    lines = [(record.levelname, record.getMessage()) for record in caplog.records]
    assert lines == [
        ("INFO", "forkd: once-compose.yaml: services.default: no meaning for a VM, ignored: init, restart"),
        (
            "WARNING",
            "forkd: once-compose.yaml: services.default: not honoured (the sample's VM does not get what Docker "
            "would give): cap_drop, hostname, read_only",
        ),
    ]
