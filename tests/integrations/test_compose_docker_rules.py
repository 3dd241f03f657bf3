"""Compose read with Docker's rules, without VMs: networks, x-default, entrypoint and command, healthchecks, YAML.

Each table is a case of Docker Compose's (or Inspect's) documented behaviour;
the VM side (no default route on an internal network, a service's command
serving the sample) is in tests/integrations/test_compose_service_vm.py.
"""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

import pytest

from pytest_forkd.errors import ConfigError
from pytest_forkd.integrations import compose
from pytest_forkd.integrations.compose import load_compose
from pytest_forkd.integrations.compose_commands import Healthcheck, ServiceProcess, only_a_terminal, parse_duration
from pytest_forkd.integrations.compose_keys import HONOURED, NO_MEANING, NOT_HONOURED, UNSUPPORTED
from pytest_forkd.integrations.compose_yaml import load_yaml


def service_of(tmp_path: Path, text: str, environ: dict[str, str] | None = None) -> compose.ComposeService:
    path = tmp_path / "compose.yaml"
    path.write_text(textwrap.dedent(text))
    return load_compose(path, environ=environ or {})


def error_of(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as caught:
        service_of(tmp_path, text)
    message = str(caught.value)
    assert "\n" not in message, message
    return message


# -- networks --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "network"),
    [
        # No networks at all: the project's default network, a bridge that reaches out.
        ("services:\n  default: {image: x}\n", "outbound"),
        # The default network redefined as internal: a service that names no network is on it.
        ("services:\n  default: {image: x}\nnetworks:\n  default: {internal: true}\n", "none"),
        ("services:\n  default: {image: x, networks: [ctf]}\nnetworks:\n  ctf: {internal: true}\n", "none"),
        # Compose's boolean texts, and interpolation, for a typed field.
        ("services:\n  default: {image: x}\nnetworks:\n  default: {internal: 'yes'}\n", "none"),
        ("services:\n  default: {image: x}\nnetworks:\n  default: {internal: '${INTERNAL:-true}'}\n", "none"),
        ("services:\n  default: {image: x}\nnetworks:\n  default: {internal: false}\n", "outbound"),
        # One network reaching out is enough, as for a container on two networks.
        (
            "services:\n  default: {image: x, networks: {ctf: {aliases: [box]}, web: null}}\n"
            "networks:\n  ctf: {internal: true}\n  web: {driver: bridge}\n",
            "outbound",
        ),
        (
            "services:\n  default: {image: x, networks: [a, b]}\nnetworks:\n  a: {internal: true}\n"
            "  b: {internal: true, labels: {k: v}}\n",
            "none",
        ),
        # A bridge without outbound NAT, and a network without IPv4, reach nothing outside.
        (
            "services:\n  default: {image: x}\nnetworks:\n  default:\n    driver_opts:\n"
            "      com.docker.network.bridge.enable_ip_masquerade: 'false'\n",
            "none",
        ),
        ("services:\n  default: {image: x}\nnetworks:\n  default: {enable_ipv4: false}\n", "none"),
        ("services:\n  default: {image: x}\nnetworks:\n  default: {driver: none}\n", "none"),
        # network_mode: Docker's own networks.
        ("services:\n  default: {image: x, network_mode: none}\nnetworks:\n  default: {}\n", "none"),
        (
            "services:\n  default: {image: x, network_mode: bridge}\nnetworks:\n  default: {internal: true}\n",
            "outbound",
        ),
    ],
)
def test_a_service_reaches_out_exactly_when_one_of_its_networks_does(tmp_path: Path, text: str, network: str) -> None:
    assert service_of(tmp_path, text).network == network


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "services:\n  default: {image: x, networks: [ext]}\nnetworks:\n  ext: {external: true}\n",
            "networks.ext.external: a network made outside this file, whose reach forkd cannot know",
        ),
        (
            "services:\n  default: {image: x, networks: [ext]}\nnetworks:\n  ext: {external: {name: shared}}\n",
            "networks.ext.external: a network made outside this file",
        ),
        (
            "services:\n  default: {image: x}\nnetworks:\n  default: {driver: weave}\n",
            "networks.default.driver: forkd knows the reach of Docker's drivers",
        ),
        (
            "services:\n  default: {image: x, networks: [typo]}\nnetworks:\n  ctf: {internal: true}\n",
            "services.default.networks.typo: refers to an undefined network (defined under networks: ctf)",
        ),
        (
            "services:\n  default: {image: x, network_mode: none, networks: [default]}\n",
            "network_mode and networks are mutually exclusive",
        ),
        (
            "services:\n  default: {image: x}\nnetworks:\n  default: {internal: maybe}\n",
            "networks.default.internal: expected true or false, got str 'maybe'",
        ),
        (
            "services:\n  default: {image: x}\nnetworks:\n  default: {interal: true}\n",
            "networks.default.interal: unknown key",
        ),
        ("services:\n  default: {image: x}\nnetworks: [a]\n", "compose.yaml: networks: expected a mapping"),
    ],
)
def test_a_network_forkd_cannot_give_is_refused_never_widened(tmp_path: Path, text: str, expected: str) -> None:
    assert expected in error_of(tmp_path, text)


def test_network_settings_a_vm_does_not_give_are_named_as_not_honoured(tmp_path: Path) -> None:
    service = service_of(
        tmp_path,
        """\
        services:
          default:
            image: x
            networks:
              ctf: {ipv4_address: 172.20.0.5, aliases: [target]}
        networks:
          ctf:
            internal: true
            ipam: {config: [{subnet: 172.20.0.0/16}]}
            driver_opts: {com.docker.network.driver.mtu: "1400"}
            name: ctf-net
        """,
    )
    assert service.network == "none"
    assert service.unhonoured == (
        "networks.ctf.driver_opts.com.docker.network.driver.mtu",
        "networks.ctf.ipam",
        "networks.ctf.ipv4_address",
    )
    assert set(service.ignored) == {"networks.ctf.aliases", "networks.ctf.name"}


# -- the default service, as Inspect picks it ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "marked"),
    [
        ("true", True),
        ("1", True),
        ("yes", True),  # YAML 1.2 (Compose's): the text "yes", true for Python
        ("'no'", True),  # non-empty text is true for Inspect, whatever it says
        ("off", True),
        ("[a]", True),
        ("false", False),
        ("0", False),
        ("''", False),
        ("null", False),
        ("[]", False),
    ],
)
def test_x_default_is_true_as_inspect_reads_it(tmp_path: Path, value: str, marked: bool) -> None:
    text = f"services:\n  agent: {{image: x, x-default: {value}}}\n  default: {{image: y}}\n"
    path = tmp_path / "compose.yaml"
    path.write_text(text)
    data = load_yaml(path.read_text())
    assert compose.default_service_name(data["services"]) == ("agent" if marked else "default")


def test_among_several_marked_services_the_last_by_name_wins_as_docker_compose_config_lists_them() -> None:
    services = {"zeta": {"x-default": True}, "alpha": {"x-default": "yes"}, "mid": {"x-default": 0}}
    assert compose.default_service_name(services) == "zeta"
    assert compose.default_service_name({"b": {"x-default": 1}, "a": {"x-default": True}}) == "b"


# -- what is honoured, warned about or refused -----------------------------------------------------------------


def test_every_key_has_one_kind() -> None:
    kinds = [HONOURED, NO_MEANING, NOT_HONOURED, frozenset(UNSUPPORTED)]
    for index, kind in enumerate(kinds):
        for other in kinds[index + 1 :]:
            assert not kind & other, kind & other


def test_keys_that_change_the_sample_are_a_warning_naming_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "warned-compose.yaml"
    path.write_text(
        "services:\n  default:\n    image: x\n    read_only: true\n    tmpfs: [/run]\n    extra_hosts: [db:10.0.0.2]\n"
        "    sysctls: {net.core.somaxconn: 1024}\n    scale: 2\n    labels: {a: b}\n"
    )
    service = load_compose(path, environ={})
    with caplog.at_level(logging.WARNING, logger="pytest_forkd.integrations.compose"):
        compose.log_ignored(service)
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    for key in ("extra_hosts", "read_only", "scale: 2 (one VM per sample)", "sysctls", "tmpfs"):
        assert key in message, message
    assert "labels" not in message  # no meaning for a VM: INFO, not a warning


# -- entrypoint, command, healthcheck --------------------------------------------------------------------------


def test_command_and_entrypoint_are_read_as_compose_reads_them(tmp_path: Path) -> None:
    service = service_of(
        tmp_path,
        """\
        services:
          default:
            image: x
            entrypoint: ["/entry.sh", "--verbose"]
            command: 'python3 -m http.server 8000 --bind "127.0.0.1"'
            tty: true
        """,
    )
    assert service.process == ServiceProcess(
        entrypoint=("/entry.sh", "--verbose"),
        command=("python3", "-m", "http.server", "8000", "--bind", "127.0.0.1"),  # split into words, no shell
        interactive=True,
    )
    empty = service_of(tmp_path, "services:\n  default: {image: x, entrypoint: '', command: []}\n").process
    assert empty == ServiceProcess(entrypoint=(), command=())
    assert service_of(tmp_path, "services:\n  default: {image: x}\n").process == ServiceProcess()


@pytest.mark.parametrize(
    ("process", "image_entrypoint", "image_cmd", "argv"),
    [
        # The image's own ENTRYPOINT and CMD, when the compose file names neither.
        (
            ServiceProcess(),
            ["/docker-entrypoint.sh"],
            ["nginx", "-g", "daemon off;"],
            ("/docker-entrypoint.sh", "nginx", "-g", "daemon off;"),
        ),
        # command: replaces CMD and keeps ENTRYPOINT.
        (ServiceProcess(command=("serve",)), ["/entry"], ["default-cmd"], ("/entry", "serve")),
        # entrypoint: replaces ENTRYPOINT and drops the image's CMD.
        (ServiceProcess(entrypoint=("/other",)), ["/entry"], ["default-cmd"], ("/other",)),
        (ServiceProcess(entrypoint=("/other",), command=("a",)), ["/entry"], ["b"], ("/other", "a")),
        # Empty values clear the image's.
        (
            ServiceProcess(entrypoint=(), command=("tail", "-f", "/dev/null")),
            ["/entry"],
            [],
            ("tail", "-f", "/dev/null"),
        ),
        (ServiceProcess(command=()), [], ["python3", "app.py"], ()),
        # A shell form written in a Dockerfile is in the image config as /bin/sh -c.
        (
            ServiceProcess(),
            [],
            ["/bin/sh", "-c", "python3 -m http.server"],
            ("/bin/sh", "-c", "python3 -m http.server"),
        ),
        # An image whose own CMD is a bare shell or interpreter waits for a terminal: not started...
        (ServiceProcess(), [], ["bash"], ()),
        (ServiceProcess(), [], ["/bin/sh"], ()),
        (ServiceProcess(), [], ["python3"], ()),
        (ServiceProcess(), [], ["python3.12", "-i"], ()),
        # ...unless the service gives it a terminal, or names it itself.
        (ServiceProcess(interactive=True), [], ["bash"], ("bash",)),
        (ServiceProcess(command=("bash",)), [], ["sh"], ("bash",)),
        (ServiceProcess(), [], [], ()),
    ],
)
def test_the_main_process_is_the_one_docker_would_start(
    process: ServiceProcess, image_entrypoint: list[str], image_cmd: list[str], argv: tuple[str, ...]
) -> None:
    assert process.argv(image_entrypoint, image_cmd) == argv


def test_a_shell_is_only_a_terminal_without_a_script() -> None:
    assert only_a_terminal(["bash", "-l"]) and only_a_terminal(["/usr/bin/zsh"])
    assert not only_a_terminal(["bash", "-c", "serve"]) and not only_a_terminal(["python3", "app.py"])
    assert not only_a_terminal(["nginx"]) and not only_a_terminal([])


@pytest.mark.parametrize(
    ("healthcheck", "expected"),
    [
        ("{test: [CMD, curl, -f, 'http://127.0.0.1']}", Healthcheck(("curl", "-f", "http://127.0.0.1"))),
        (
            "{test: [CMD-SHELL, 'curl -f localhost || exit 1']}",
            Healthcheck(("/bin/sh", "-c", "curl -f localhost || exit 1")),
        ),
        ("{test: 'pg_isready'}", Healthcheck(("/bin/sh", "-c", "pg_isready"))),
        (
            "{test: [CMD, 'true'], interval: 1m30s, timeout: 500ms, retries: 5, start_period: 10s, start_interval: 1s}",
            Healthcheck(
                ("true",), interval_s=90.0, timeout_s=0.5, retries=5, start_period_s=10.0, start_interval_s=1.0
            ),
        ),
        ("{test: [NONE]}", None),
        ("{test: [CMD, 'true'], disable: true}", None),
    ],
)
def test_healthchecks_as_docker_reads_them(tmp_path: Path, healthcheck: str, expected: Healthcheck | None) -> None:
    service = service_of(tmp_path, f"services:\n  default:\n    image: x\n    healthcheck: {healthcheck}\n")
    assert service.process is not None and service.process.healthcheck == expected


def test_a_healthchecks_deadline_is_dockers_start_period_then_its_retries() -> None:
    assert Healthcheck(("true",)).deadline_s == 3 * (30 + 30)
    assert Healthcheck(("true",), interval_s=2, timeout_s=1, retries=4, start_period_s=5).deadline_s == 5 + 1 + 4 * 3
    assert parse_duration("1h2m3.5s") == 3723.5 and parse_duration("0") == 0.0
    assert parse_duration("10") is None and parse_duration("5 minutes") is None and parse_duration(5) is None


@pytest.mark.parametrize(
    ("service", "expected"),
    [
        ("{image: x, command: 'echo \"unclosed'}", "services.default.command: cannot split"),
        ("{image: x, command: [serve, {port: 1}]}", "services.default.command[1]: expected a word"),
        ("{image: x, entrypoint: 5}", "services.default.entrypoint: expected a list of words or a string"),
        ("{image: x, healthcheck: {test: [CURL, x]}}", "healthcheck.test: expected [CMD, program, args...]"),
        ("{image: x, healthcheck: {test: [CMD-SHELL, a, b]}}", "healthcheck.test: expected [CMD, program"),
        ("{image: x, healthcheck: {test: [CMD, 'true'], interval: 5}}", "healthcheck.interval: expected a duration"),
        ("{image: x, healthcheck: {test: [CMD, 'true'], retries: -1}}", "healthcheck.retries: expected a whole number"),
        ("{image: x, healthcheck: {tset: [CMD, 'true']}}", "healthcheck.tset: unknown key"),
        ("{image: x, tty: sometimes}", "services.default.tty: expected true or false"),
        ("{image: x, scale: many}", "services.default.scale: expected a whole number"),
    ],
)
def test_bad_commands_and_healthchecks_fail_with_one_line(tmp_path: Path, service: str, expected: str) -> None:
    assert expected in error_of(tmp_path, f"services:\n  default: {service}\n")


def test_a_healthcheck_without_test_is_named_as_not_honoured(tmp_path: Path) -> None:
    service = service_of(tmp_path, "services:\n  default: {image: x, healthcheck: {interval: 5s}}\n")
    assert service.process is not None and service.process.healthcheck is None
    assert service.unhonoured == ("healthcheck without test (the image's HEALTHCHECK is not run)",)


# -- YAML as Compose reads it --------------------------------------------------------------------------------


def test_scalars_are_yaml_1_2_as_in_compose(tmp_path: Path) -> None:
    service = service_of(
        tmp_path,
        """\
        services:
          default:
            image: x
            environment: {DEBUG: yes, MODE: 0755, TIME: 1:30, FLAG: true, DAY: 2001-12-14, OFF: off}
        """,
    )
    assert service.env == {
        "DEBUG": "yes",
        "MODE": "755",
        "TIME": "1:30",
        "FLAG": "true",
        "DAY": "2001-12-14",
        "OFF": "off",
    }


def test_the_inspect_page_lists_every_key_under_what_forkd_does_with_it() -> None:
    page = (Path(__file__).parents[2] / "docs" / "frameworks" / "inspect.md").read_text()
    listed = {
        line.split(":", 1)[0].removeprefix("- "): {word.strip("` ,") for word in line.split(":", 1)[1].split()}
        for line in page.splitlines()
        if line.startswith(("- honoured:", "- not honoured", "- no meaning", "- refused:"))
    }
    assert listed == {
        "honoured": set(HONOURED),
        "not honoured (a warning)": set(NOT_HONOURED),
        "no meaning for a VM (the log)": set(NO_MEANING),
        "refused": set(UNSUPPORTED),
    }
