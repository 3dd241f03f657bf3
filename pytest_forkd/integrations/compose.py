"""Compose files and Dockerfiles read as forkd guests: the one service a sandbox starts a VM of.

Agent evaluations describe their sandbox for Docker: Inspect's
``sandbox=("docker", "compose.yaml")`` or a bare ``Dockerfile``. This module
reads those files the way Docker Compose does and says what forkd makes of
them, as a :class:`ComposeService`: the image (a reference, a bare one read as
Docker reads it) or the Dockerfile build, the working directory, the
environment, the user, and the machine (memory, vCPUs, network).

The service is the *default* one, chosen as Inspect's docker sandbox chooses
it: the last service marked ``x-default: true``, else the one named
``default``. A compose file with other services besides it is refused with a
message that lists them (forkd starts one VM per sample; it never drops a
service silently).

Keys that mean nothing for a VM (``init``, ``command``, ``healthcheck``,
``stop_grace_period``...) are accepted and listed once in the log; those with
a forkd equivalent are applied (``mem_limit``, ``cpus``, ``network_mode``,
``deploy.resources.limits``). Keys whose meaning a VM cannot give (a bind
mount, ``secrets``, ``network_mode: service:...``) fail with one line naming
the key, as does a key Compose itself does not know.

Values are interpolated as Compose interpolates them (``${VAR}``,
``${VAR:-default}``, ``${VAR:?message}``, ``$$``...), from the environment
given (the process's, by default) over the ``.env`` file beside the compose
file.

Plain data and :mod:`yaml` only: no framework is imported, so every harness
(and its tests) can use it.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import yaml

from pytest_forkd.errors import ConfigError

__all__ = [
    "COMPOSE_FILES",
    "ComposeService",
    "ServiceBuild",
    "default_service_name",
    "dockerfile_service",
    "interpolate",
    "is_compose_file",
    "is_dockerfile",
    "load_compose",
    "log_ignored",
    "parse_compose",
]

log = logging.getLogger(__name__)

#: The names Docker Compose (and Inspect) look for, in their order.
COMPOSE_FILES: Final = ("compose.yaml", "compose.yml", "docker-compose.yaml", "docker-compose.yml")
DOCKERFILE: Final = "Dockerfile"
#: The environment file Compose reads for interpolation, beside the compose file.
DOTENV: Final = ".env"

NetworkMode = Literal["none", "outbound"]

#: Service keys forkd applies (their meaning is in :class:`ComposeService`).
HONOURED: Final = frozenset(
    {
        "image",
        "build",
        "working_dir",
        "environment",
        "env_file",
        "user",
        "mem_limit",
        "cpus",
        "network_mode",
        "networks",
        "deploy",
        "platform",
    }
)
#: Service keys that mean nothing for a VM of the default service: accepted, listed once in the log.
NO_MEANING: Final = frozenset(
    {
        "annotations",
        "attach",
        "blkio_config",
        "cap_add",
        "cap_drop",
        "cgroup",
        "cgroup_parent",
        "command",
        "container_name",
        "cpu_count",
        "cpu_percent",
        "cpu_period",
        "cpu_quota",
        "cpu_rt_period",
        "cpu_rt_runtime",
        "cpu_shares",
        "cpuset",
        "credential_spec",
        "develop",
        "device_cgroup_rules",
        "devices",
        "dns",
        "dns_opt",
        "dns_search",
        "domainname",
        "entrypoint",
        "expose",
        "extra_hosts",
        "gpus",
        "group_add",
        "healthcheck",
        "hostname",
        "init",
        "ipc",
        "isolation",
        "labels",
        "label_file",
        "logging",
        "mac_address",
        "mem_reservation",
        "mem_swappiness",
        "memswap_limit",
        "oom_kill_disable",
        "oom_score_adj",
        "pid",
        "pids_limit",
        "ports",
        "privileged",
        "profiles",
        "pull_policy",
        "pull_refresh_after",
        "read_only",
        "restart",
        "runtime",
        "scale",
        "security_opt",
        "shm_size",
        "stdin_open",
        "stop_grace_period",
        "stop_signal",
        "storage_opt",
        "sysctls",
        "tmpfs",
        "tty",
        "ulimits",
        "use_api_socket",
        "userns_mode",
        "uts",
        "volumes",
    }
)
#: Service keys whose meaning a VM cannot give (yet), and what to do instead.
UNSUPPORTED: Final = {
    "configs": "mount the files with the sample's files or COPY them in a Dockerfile",
    "secrets": "mount the files with the sample's files or COPY them in a Dockerfile",
    "depends_on": "forkd starts the default service only; remove the dependency",
    "links": "forkd starts the default service only; remove the link",
    "external_links": "forkd starts the default service only; remove the link",
    "extends": "write the service out in full",
    "volumes_from": "forkd starts the default service only; COPY the files in a Dockerfile",
    "post_start": "run the commands in the sample's setup instead",
    "pre_stop": "remove it (a sample's VM is killed, not stopped)",
    "provider": "give the service an image or a build",
    "models": "remove it",
}
#: Top-level keys of a compose file.
TOP_LEVEL: Final = frozenset({"services", "volumes", "networks", "configs", "secrets", "name", "version", "include"})
#: Keys of a ``build:`` mapping that forkd applies.
BUILD_HONOURED: Final = frozenset({"context", "dockerfile", "args"})
#: Keys of a ``build:`` mapping that change nothing in the image forkd gets (cache and registry settings).
BUILD_NO_MEANING: Final = frozenset(
    {"cache_from", "cache_to", "labels", "network", "no_cache", "pull", "shm_size", "tags", "isolation", "privileged"}
)
#: The one platform forkd runs.
PLATFORM: Final = "linux/amd64"


@dataclass(frozen=True)
class ServiceBuild:
    """``build:`` of a service: a Dockerfile built in a context directory, with build arguments."""

    context: Path
    dockerfile: Path
    """Absolute: ``dockerfile`` of the compose file, relative to the context."""
    args: tuple[tuple[str, str], ...] = ()

    @property
    def arguments(self) -> dict[str, str]:
        return dict(self.args)


@dataclass(frozen=True)
class ComposeService:
    """What forkd makes of the default service of a compose file (or of a Dockerfile).

    Hashable: equal services share one warm parent.
    """

    name: str
    origin: str
    """How messages name it: ``compose.yaml: services.default``."""
    image: str | None = None
    """The image reference as written (after interpolation); a bare one means ``docker://``. None with ``build``."""
    build: ServiceBuild | None = None
    working_dir: str | None = None
    """The samples' working directory (created if the image lacks it); None: the image's ``WorkingDir``."""
    environment: tuple[tuple[str, str], ...] = ()
    """Over the image's ``Env``, in every command."""
    user: str | None = None
    """Who commands run as unless they name a user; None: the image's ``User``."""
    memory_mib: int | None = None
    vcpus: int | None = None
    network: NetworkMode = "outbound"
    ignored: tuple[str, ...] = field(default=(), compare=False)
    """Keys accepted without effect (listed once in the log)."""

    @property
    def env(self) -> dict[str, str]:
        return dict(self.environment)


_logged: set[tuple[str, tuple[str, ...]]] = set()


def log_ignored(service: ComposeService) -> None:
    """Say once per process and service which of its keys forkd accepted without effect."""
    key = (service.origin, service.ignored)
    if not service.ignored or key in _logged:
        return
    _logged.add(key)
    log.info(f"forkd: {service.origin}: no meaning for a VM, ignored: {', '.join(service.ignored)}")


# -- file names --------------------------------------------------------------------------------------------------


def is_compose_file(name: str) -> bool:
    """Whether a config names a compose file, as Inspect decides (``compose.yaml``, ``*-compose.yaml``...)."""
    base = os.path.basename(name)
    return base in COMPOSE_FILES or bool(re.search(r"[-.]compose\.ya?ml$", base))


def is_dockerfile(name: str) -> bool:
    """Whether a config names a Dockerfile, as Inspect decides (``Dockerfile``, ``x.Dockerfile``, ``Dockerfile.x``)."""
    path = Path(name)
    return path.stem == DOCKERFILE or path.suffix == f".{DOCKERFILE}" or path.name == DOCKERFILE


# -- reading -----------------------------------------------------------------------------------------------------


def load_compose(path: Path | str, *, environ: Mapping[str, str] | None = None) -> ComposeService:
    """The default service of the compose file at ``path``; ConfigError (one line) names what is wrong.

    ``environ``: the variables interpolation reads (default: the process's),
    over those of the ``.env`` file beside the compose file.
    """
    path = Path(path).absolute()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such compose file; fix the sandbox config's path") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the compose file: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
        raise ConfigError(f"{path.name}: not valid YAML{where}: {problem}") from None
    variables = {**read_env_file(path.parent / DOTENV, origin=DOTENV, missing_ok=True)}
    variables.update(os.environ if environ is None else environ)
    return parse_compose(data, base=path.parent, origin=path.name, environ=variables)


def dockerfile_service(path: Path | str) -> ComposeService:
    """A bare Dockerfile as Inspect's docker sandbox runs it: built in its folder, without a network."""
    path = Path(path).absolute()
    if not path.is_file():
        raise ConfigError(f"{path}: no such Dockerfile; fix the sandbox config's path")
    return ComposeService(
        name="default",
        origin=path.name,
        build=ServiceBuild(context=path.parent, dockerfile=path),
        network="none",
    )


def parse_compose(
    data: object, *, base: Path, origin: str = "compose.yaml", environ: Mapping[str, str] | None = None
) -> ComposeService:
    """The default service of loaded compose ``data``; relative paths resolve against ``base``."""
    where = _Where(origin)
    variables = dict(os.environ if environ is None else environ)
    if not isinstance(data, Mapping):
        raise where.error("", f"expected a mapping with a services: key, got {_shown(data)}")
    for key in data:
        if not isinstance(key, str) or (key not in TOP_LEVEL and not key.startswith("x-")):
            raise where.error(str(key), "unknown top-level key; a compose file has services, volumes, networks...")
    if "include" in data:
        raise where.error("include", "included compose files are not read by forkd; write the services in this file")
    services = data.get("services")
    if not isinstance(services, Mapping) or not services:
        raise where.error("services", "no services: name the service samples run in (named 'default')")
    name = default_service_name(services, origin)
    others = sorted(str(other) for other in services if other != name)
    if others:
        raise where.error(
            "services",
            f"forkd starts one VM per sample, of the default service {name!r}, and cannot start "
            f"{', '.join(repr(other) for other in others)} beside it; remove "
            f"{'it' if len(others) == 1 else 'them'} or run this eval with the docker sandbox",
        )
    body = services[name]
    field_path = f"services.{name}"
    if body is None:
        body = {}
    if not isinstance(body, Mapping):
        raise where.error(field_path, f"expected a mapping of service keys, got {_shown(body)}")
    body = interpolate(body, variables, where, field_path)
    return _service(str(name), body, where, field_path, base, variables)


def default_service_name(services: Mapping[Any, Any], origin: str = "compose.yaml") -> str:
    """The service samples run in, as Inspect's docker sandbox picks it: ``x-default: true``, else ``default``."""
    marked = [name for name, body in services.items() if isinstance(body, Mapping) and body.get("x-default") is True]
    if marked:
        return str(marked[-1])
    if "default" in services:
        return "default"
    names = ", ".join(repr(str(name)) for name in services)
    raise ConfigError(
        f"{origin}: services: no default service among {names}; name the service samples run in "
        "'default' or mark it with 'x-default: true'"
    )


def _service(
    name: str, body: Mapping[Any, Any], where: _Where, field_path: str, base: Path, environ: Mapping[str, str]
) -> ComposeService:
    ignored: list[str] = []
    for key in body:
        key_path = f"{field_path}.{key}"
        if not isinstance(key, str):
            raise where.error(key_path, "expected a key name")
        if key.startswith("x-") or key in HONOURED:
            continue
        if key in UNSUPPORTED:
            raise where.error(key_path, f"forkd cannot run a VM with this key; {UNSUPPORTED[key]}")
        if key in NO_MEANING:
            ignored.append(key)
            continue
        raise where.error(key_path, "unknown key; Docker Compose does not know it either (a typo?)")
    _check_volumes(body.get("volumes"), where, f"{field_path}.volumes")
    _check_platform(body.get("platform"), where, f"{field_path}.platform")
    image = body.get("image")
    if image is not None and (not isinstance(image, str) or not image.strip()):
        raise where.error(
            f"{field_path}.image", f"expected an image reference such as python:3.12, got {_shown(image)}"
        )
    build = _build(body.get("build"), where, f"{field_path}.build", base, environ, ignored)
    if image is None and build is None:
        raise where.error(field_path, "the service has neither image: nor build:; give it one")
    memory_mib, vcpus = _resources(body, where, field_path, ignored)
    return ComposeService(
        name=name,
        origin=f"{where.origin}: {field_path}",
        image=None if build is not None else image,
        build=build,
        working_dir=_working_dir(body.get("working_dir"), where, f"{field_path}.working_dir"),
        environment=tuple(_environment(body, where, field_path, base, environ).items()),
        user=_user(body.get("user"), where, f"{field_path}.user"),
        memory_mib=memory_mib,
        vcpus=vcpus,
        network=_network(body, where, field_path, ignored),
        ignored=tuple(sorted(ignored)),
    )


def _build(
    value: object, where: _Where, field_path: str, base: Path, environ: Mapping[str, str], ignored: list[str]
) -> ServiceBuild | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = {"context": value}
    if not isinstance(value, Mapping):
        raise where.error(field_path, f"expected a context folder or a mapping with context:, got {_shown(value)}")
    for key in value:
        if key in BUILD_HONOURED or str(key).startswith("x-"):
            continue
        if key in BUILD_NO_MEANING:
            ignored.append(f"build.{key}")
            continue
        raise where.error(f"{field_path}.{key}", "forkd builds with context, dockerfile and args only; remove this key")
    context_text = value.get("context", ".")
    if not isinstance(context_text, str) or not context_text:
        raise where.error(f"{field_path}.context", f"expected a folder, got {_shown(context_text)}")
    if re.match(r"^[a-z][a-z0-9+.-]*://", context_text) or context_text.startswith("git@"):
        raise where.error(f"{field_path}.context", "a remote build context is not supported; give a local folder")
    context = (base / os.path.expanduser(context_text)).absolute()
    if not context.is_dir():
        raise where.error(f"{field_path}.context", f"no such folder {context} (relative to {base})")
    dockerfile_text = value.get("dockerfile", DOCKERFILE)
    if not isinstance(dockerfile_text, str) or not dockerfile_text:
        raise where.error(f"{field_path}.dockerfile", f"expected a file name, got {_shown(dockerfile_text)}")
    dockerfile = (context / dockerfile_text).absolute()
    if not dockerfile.is_file():
        raise where.error(f"{field_path}.dockerfile", f"no such Dockerfile {dockerfile} (relative to the context)")
    args = _pairs(value.get("args"), where, f"{field_path}.args", environ)
    return ServiceBuild(context=context, dockerfile=dockerfile, args=tuple(args.items()))


def _working_dir(value: object, where: _Where, field_path: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value:
        raise where.error(field_path, f"expected an absolute path such as /srv/app, got {_shown(value)}")
    return value


def _user(value: object, where: _Where, field_path: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)) or not str(value).strip():
        raise where.error(field_path, f"expected a user name or number (USER[:GROUP]), got {_shown(value)}")
    return str(value)


def _environment(
    body: Mapping[Any, Any], where: _Where, field_path: str, base: Path, environ: Mapping[str, str]
) -> dict[str, str]:
    """``env_file`` first, then ``environment`` over it, as Compose merges them."""
    merged: dict[str, str] = {}
    env_files = body.get("env_file")
    if env_files is not None:
        entries = env_files if isinstance(env_files, list) else [env_files]
        for index, entry in enumerate(entries):
            entry_path = f"{field_path}.env_file[{index}]" if isinstance(env_files, list) else f"{field_path}.env_file"
            required = True
            if isinstance(entry, Mapping):
                required = entry.get("required", True) is not False
                entry = entry.get("path")
            if not isinstance(entry, str) or not entry:
                raise where.error(entry_path, f"expected a file name, got {_shown(entry)}")
            path = (base / os.path.expanduser(entry)).absolute()
            merged.update(read_env_file(path, origin=f"{where.origin}: {entry_path}", missing_ok=not required))
    merged.update(_pairs(body.get("environment"), where, f"{field_path}.environment", environ))
    return merged


def _pairs(value: object, where: _Where, field_path: str, environ: Mapping[str, str]) -> dict[str, str]:
    """``environment:``/``args:``: a list of ``KEY=VALUE`` or a mapping; a key without a value comes from ``environ``.

    As in Compose, a key whose value is left out takes the value it has in
    the environment, and is left out when the environment has none.
    """
    if value is None:
        return {}
    pairs: dict[str, str] = {}
    if isinstance(value, list):
        for index, item in enumerate(value):
            if not isinstance(item, str) or not item:
                raise where.error(f"{field_path}[{index}]", f"expected KEY=VALUE, got {_shown(item)}")
            key, sep, text = item.partition("=")
            _check_name(key, where, f"{field_path}[{index}]")
            if sep:
                pairs[key] = text
            elif key in environ:
                pairs[key] = environ[key]
        return pairs
    if isinstance(value, Mapping):
        for key, item in value.items():
            _check_name(key, where, f"{field_path}.{key}")
            if item is None:
                if key in environ:
                    pairs[key] = environ[key]
            elif isinstance(item, bool):
                pairs[key] = "true" if item else "false"
            elif isinstance(item, (str, int, float)):
                pairs[key] = str(item)
            else:
                raise where.error(f"{field_path}.{key}", f"expected a string or number, got {_shown(item)}")
        return pairs
    raise where.error(field_path, f"expected a list of KEY=VALUE or a mapping, got {_shown(value)}")


def _check_name(key: object, where: _Where, field_path: str) -> None:
    if not isinstance(key, str) or not key or "=" in key or "\0" in key:
        raise where.error(field_path, f"expected a variable name, got {_shown(key)}")


def _resources(
    body: Mapping[Any, Any], where: _Where, field_path: str, ignored: list[str]
) -> tuple[int | None, int | None]:
    """Memory in MiB and vCPUs from ``mem_limit``/``cpus``, else ``deploy.resources.limits``."""
    memory = body.get("mem_limit")
    cpus = body.get("cpus")
    memory_path, cpus_path = f"{field_path}.mem_limit", f"{field_path}.cpus"
    deploy = body.get("deploy")
    if deploy is not None:
        if not isinstance(deploy, Mapping):
            raise where.error(f"{field_path}.deploy", f"expected a mapping, got {_shown(deploy)}")
        for key in deploy:
            if key != "resources":
                ignored.append(f"deploy.{key}")
        resources = deploy.get("resources") or {}
        limits = resources.get("limits") if isinstance(resources, Mapping) else None
        if isinstance(resources, Mapping) and "reservations" in resources:
            ignored.append("deploy.resources.reservations")
        if isinstance(limits, Mapping):
            if memory is None and limits.get("memory") is not None:
                memory, memory_path = limits["memory"], f"{field_path}.deploy.resources.limits.memory"
            if cpus is None and limits.get("cpus") is not None:
                cpus, cpus_path = limits["cpus"], f"{field_path}.deploy.resources.limits.cpus"
            for key in limits:
                if key not in ("memory", "cpus"):
                    ignored.append(f"deploy.resources.limits.{key}")
    memory_mib = (
        None if memory is None else max(1, math.ceil(parse_compose_size(memory, where, memory_path) / (1 << 20)))
    )
    vcpus = None
    if cpus is not None:
        try:
            amount = float(cpus)
        except (TypeError, ValueError):
            amount = -1.0
        if isinstance(cpus, bool) or not math.isfinite(amount) or amount <= 0:
            raise where.error(cpus_path, f"expected a number of CPUs such as 2 or 0.5, got {_shown(cpus)}")
        vcpus = max(1, math.ceil(amount))
    return memory_mib, vcpus


_COMPOSE_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(?:i?b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}


def parse_compose_size(value: object, where: _Where, field_path: str) -> int:
    """A byte size as Docker reads ``mem_limit``: ``536870912``, ``512m``, ``2g``, ``1.5gb`` (powers of 1024)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str):
        match = _COMPOSE_SIZE.match(value)
        if match:
            size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
            if size > 0:
                return size
    raise where.error(field_path, f"expected a size such as 512m or 2g, got {_shown(value)}")


def _network(body: Mapping[Any, Any], where: _Where, field_path: str, ignored: list[str]) -> NetworkMode:
    """``network_mode: none`` gives no network card; anything a container would reach the outside with, outbound.

    A container without ``network_mode`` is on Docker's bridge network,
    which reaches whatever the host reaches: forkd's ``outbound`` mode.
    """
    mode = body.get("network_mode")
    if "networks" in body:
        ignored.append("networks")
    if mode is None or mode in ("bridge", "default"):
        return "outbound"
    if mode == "none":
        return "none"
    if mode == "host":
        ignored.append("network_mode: host (the VM reaches the host's loopback at 10.0.2.2)")
        return "outbound"
    if isinstance(mode, str) and mode.startswith(("service:", "container:")):
        raise where.error(
            f"{field_path}.network_mode", f"{mode!r} shares another container's network, which a VM cannot; remove it"
        )
    raise where.error(f"{field_path}.network_mode", f"expected none, bridge or host, got {_shown(mode)}")


def _check_volumes(value: object, where: _Where, field_path: str) -> None:
    """Named and anonymous volumes start empty, as in a fresh VM; a bind mount of a host path cannot be had."""
    if value is None:
        return
    if not isinstance(value, list):
        raise where.error(field_path, f"expected a list of volumes, got {_shown(value)}")
    for index, item in enumerate(value):
        source = ""
        if isinstance(item, str):
            parts = item.split(":")
            source = parts[0] if len(parts) > 1 else ""
            bind = source.startswith(("/", ".", "~"))
        elif isinstance(item, Mapping):
            source = str(item.get("source") or "")
            bind = item.get("type") == "bind"
        else:
            raise where.error(f"{field_path}[{index}]", f"expected a volume, got {_shown(item)}")
        if bind:
            raise where.error(
                f"{field_path}[{index}]",
                f"a VM cannot mount the host folder {source!r}; COPY it in a Dockerfile or give it as sample files",
            )


def _check_platform(value: object, where: _Where, field_path: str) -> None:
    if value is not None and value not in (PLATFORM, "linux/x86_64", "amd64"):
        raise where.error(field_path, f"forkd runs {PLATFORM} images only, not {_shown(value)}")


# -- .env files --------------------------------------------------------------------------------------------------

_ENV_LINE = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_.-]*)\s*(?:=\s*(.*?))?\s*$")


def read_env_file(path: Path, *, origin: str, missing_ok: bool = False) -> dict[str, str]:
    """``KEY=VALUE`` lines as Compose reads an env file: ``#`` comments, ``export``, quoted values."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if missing_ok:
            return {}
        raise ConfigError(f"{origin}: no such env file {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"{origin}: cannot read the env file {path}: {getattr(exc, 'strerror', None) or exc}"
        ) from None
    values: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = _ENV_LINE.match(line)
        if match is None:
            raise ConfigError(f"{origin}: {path.name} line {number}: expected KEY=VALUE, got {line.strip()[:80]!r}")
        key, value = match.group(1), match.group(2)
        if value is None:
            continue
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
            if match.group(2)[0] == '"':
                value = value.replace("\\n", "\n").replace('\\"', '"').replace("\\\\", "\\")
        else:
            value = re.sub(r"\s+#.*$", "", value)
        values[key] = value
    return values


# -- interpolation ---------------------------------------------------------------------------------------------

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BRACED = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])(.*))?", re.DOTALL)


def interpolate(value: Any, environ: Mapping[str, str], where: _Where | str, field_path: str = "") -> Any:
    """``value`` (a loaded YAML tree) with ``$VAR``, ``${VAR}``, ``${VAR:-default}``... replaced as Compose does.

    ``${VAR-d}``/``${VAR:-d}``: ``d`` when unset (or empty); ``${VAR?m}``/
    ``${VAR:?m}``: ConfigError with ``m`` when unset (or empty);
    ``${VAR+r}``/``${VAR:+r}``: ``r`` when set (and not empty); ``$$`` is a
    ``$``. Keys are not interpolated, values of every depth are.
    """
    place = where if isinstance(where, _Where) else _Where(where)
    if isinstance(value, str):
        return _interpolate_text(value, environ, place, field_path)
    if isinstance(value, Mapping):
        return {
            key: interpolate(item, environ, place, f"{field_path}.{key}" if field_path else str(key))
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [interpolate(item, environ, place, f"{field_path}[{index}]") for index, item in enumerate(value)]
    return value


def _interpolate_text(text: str, environ: Mapping[str, str], where: _Where, field_path: str) -> str:
    out: list[str] = []
    index = 0
    while index < len(text):
        char = text[index]
        if char != "$":
            out.append(char)
            index += 1
            continue
        following = text[index + 1 : index + 2]
        if following == "$":
            out.append("$")
            index += 2
        elif following == "{":
            end = _closing_brace(text, index + 2)
            if end < 0:
                raise where.error(field_path, f"invalid interpolation in {text!r}: a '${{' is not closed")
            out.append(_substitute(text[index + 2 : end], text, environ, where, field_path))
            index = end + 1
        else:
            match = _NAME.match(text, index + 1)
            if match is None:
                out.append("$")
                index += 1
            else:
                out.append(environ.get(match.group(), ""))
                index = match.end()
    return "".join(out)


def _closing_brace(text: str, start: int) -> int:
    depth = 1
    index = start
    while index < len(text):
        if text.startswith("${", index):
            depth += 1
            index += 2
            continue
        if text[index] == "}":
            depth -= 1
            if depth == 0:
                return index
        index += 1
    return -1


def _substitute(body: str, text: str, environ: Mapping[str, str], where: _Where, field_path: str) -> str:
    match = _BRACED.fullmatch(body)
    if match is None:
        raise where.error(
            field_path, f"invalid interpolation ${{{body}}} in {text!r}: expected ${{NAME}} or ${{NAME:-default}}"
        )
    name, operator, argument = match.group(1), match.group(2), match.group(3) or ""
    value = environ.get(name)
    if operator is None:
        return value or ""
    empty_counts = operator.startswith(":")
    unset = value is None or (empty_counts and value == "")
    if operator.endswith("-"):
        return _interpolate_text(argument, environ, where, field_path) if unset else str(value)
    if operator.endswith("?"):
        if unset:
            message = _interpolate_text(argument, environ, where, field_path) or f"set {name}"
            raise where.error(field_path, f"required variable {name} is missing a value: {message}")
        return str(value)
    return "" if unset else _interpolate_text(argument, environ, where, field_path)


# -- messages ----------------------------------------------------------------------------------------------------


class _Where:
    """Builds ConfigErrors that start with ``<file>: <field path>:``."""

    def __init__(self, origin: str) -> None:
        self.origin = origin

    def error(self, field_path: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.origin}: {field_path}: {problem}" if field_path else f"{self.origin}: {problem}")


def _shown(value: object) -> str:
    text = repr(value)
    return "nothing" if value is None else f"{type(value).__name__} {text if len(text) <= 80 else text[:77] + '...'}"
