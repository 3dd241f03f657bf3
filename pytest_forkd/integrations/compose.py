"""Compose files and Dockerfiles read as forkd guests: the one service a sandbox starts a VM of.

Agent evaluations describe their sandbox for Docker: Inspect's
``sandbox=("docker", "compose.yaml")`` or a bare ``Dockerfile``. This module
reads those files the way Docker Compose does and says what forkd makes of
them, as a :class:`ComposeService`: the image (a reference, a bare one read as
Docker reads it) or the Dockerfile build, the working directory, the
environment, the user, the machine (memory, vCPUs), the network its
``networks`` give (:mod:`.compose_networks`), and the main process its
``entrypoint``/``command`` start, with its ``healthcheck``
(:mod:`.compose_commands`).

The service is the *default* one, chosen as Inspect's docker sandbox chooses
it: the last service (in name order, as ``docker compose config`` lists
them) whose ``x-default`` is true as Python reads it, else the one named
``default``. A compose file with other services besides it is refused with a
message that lists them (forkd starts one VM per sample; it never drops a
service silently).

Every key of the service is one of four kinds, each handled openly:

- *honoured*: applied as Docker applies it (:data:`HONOURED`);
- *no meaning for a VM*: about how Docker manages a container (``init``,
  ``restart``, ``labels``...) or already given by a VM (``cap_add``,
  ``privileged``); accepted, listed once in the log at INFO
  (:data:`NO_MEANING`);
- *not honoured*: they change what the sample sees (``read_only``,
  ``cap_drop``, ``hostname``, ``extra_hosts``...) and forkd does not give
  them; accepted, named once in a WARNING (:data:`NOT_HONOURED`);
- *refused*: a meaning a VM cannot give (a bind mount, ``secrets``,
  ``network_mode: service:...``, an external network), or a key Compose does
  not know either: one line naming the key (:data:`UNSUPPORTED`).

Values are read as Compose reads YAML (:mod:`.compose_yaml`) and
interpolated as Compose interpolates them (:mod:`.compose_interpolation`).

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
from typing import Any, Final

import yaml

from pytest_forkd.errors import ConfigError
from pytest_forkd.integrations.compose_commands import ServiceProcess, service_process
from pytest_forkd.integrations.compose_errors import Where, shown
from pytest_forkd.integrations.compose_interpolation import DOTENV, interpolate, read_env_file
from pytest_forkd.integrations.compose_keys import (
    BUILD_HONOURED,
    BUILD_NO_MEANING,
    HONOURED,
    NO_MEANING,
    NOT_HONOURED,
    TOP_LEVEL,
    UNSUPPORTED,
)
from pytest_forkd.integrations.compose_networks import NetworkMode, check_networks, service_network
from pytest_forkd.integrations.compose_yaml import load_yaml

__all__ = [
    "COMPOSE_FILES",
    "ComposeService",
    "NetworkMode",
    "ServiceBuild",
    "default_service_name",
    "dockerfile_service",
    "interpolate",
    "is_compose_file",
    "is_dockerfile",
    "load_compose",
    "log_ignored",
    "parse_compose",
    "read_env_file",
]

log = logging.getLogger(__name__)

#: The names Docker Compose (and Inspect) look for, in their order.
COMPOSE_FILES: Final = ("compose.yaml", "compose.yml", "docker-compose.yaml", "docker-compose.yml")
DOCKERFILE: Final = "Dockerfile"

#: The one platform forkd runs, and the names it goes by.
PLATFORM: Final = "linux/amd64"
PLATFORM_NAMES: Final = frozenset({PLATFORM, "linux/x86_64", "amd64"})


@dataclass(frozen=True)
class ServiceBuild:
    """``build:`` of a service: a Dockerfile built in a context directory, with build arguments and a target.

    What the image is built from: two builds that differ in any field are two
    images (see :func:`pytest_forkd.image.oci.builders.build_dockerfile`).
    """

    context: Path
    dockerfile: Path
    """Absolute: ``dockerfile`` of the compose file, relative to the context."""
    args: tuple[tuple[str, str], ...] = ()
    target: str | None = None
    """The stage of a multi-stage Dockerfile to build (``--target``); None: the last one."""
    platform: str | None = None
    """``linux/amd64`` when the compose file names the platform (the only one forkd runs); None: the builder's."""

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
    """``outbound`` when one of its networks reaches out (see :mod:`.compose_networks`), else ``none``."""
    process: ServiceProcess | None = None
    """The main process (``entrypoint``, ``command``, ``healthcheck``), started in the parent VM before its snapshot;
    None: none at all (a bare Dockerfile, which Inspect runs with ``tail -f /dev/null``)."""
    ignored: tuple[str, ...] = field(default=(), compare=False)
    """Keys accepted without effect (listed once in the log, at INFO)."""
    unhonoured: tuple[str, ...] = field(default=(), compare=False)
    """Keys that change what the sample sees and that forkd does not give (named once in a WARNING)."""

    @property
    def env(self) -> dict[str, str]:
        return dict(self.environment)


_logged: set[tuple[str, tuple[str, ...], tuple[str, ...]]] = set()


def log_ignored(service: ComposeService) -> None:
    """Say once per process and service which of its keys forkd accepted without giving them.

    Keys without meaning for a VM go to the log at INFO; keys that change
    what the sample sees and are not honoured get a WARNING naming them,
    which Inspect's display shows by default.
    """
    key = (service.origin, service.ignored, service.unhonoured)
    if key in _logged:
        return
    _logged.add(key)
    if service.ignored:
        log.info(f"forkd: {service.origin}: no meaning for a VM, ignored: {', '.join(service.ignored)}")
    if service.unhonoured:
        log.warning(
            f"forkd: {service.origin}: not honoured (the sample's VM does not get what Docker would give): "
            f"{', '.join(service.unhonoured)}"
        )


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
        data = load_yaml(text)
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
    where = Where(origin)
    variables = dict(os.environ if environ is None else environ)
    if not isinstance(data, Mapping):
        raise where.error("", f"expected a mapping with a services: key, got {shown(data)}")
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
        raise where.error(field_path, f"expected a mapping of service keys, got {shown(body)}")
    body = interpolate(body, variables, where, field_path)
    networks = check_networks(interpolate(data.get("networks"), variables, where, "networks"), where)
    return _service(str(name), body, where, field_path, base, variables, networks)


def default_service_name(services: Mapping[Any, Any], origin: str = "compose.yaml") -> str:
    """The service samples run in, as Inspect's docker sandbox picks it: a true ``x-default``, else ``default``.

    Inspect takes ``x-default`` as Python does (``service.get("x-default")``
    in an ``if``): ``true``, ``1``, ``"yes"`` and even ``"no"`` or
    ``"false"`` (non-empty text) mark a service; ``false``, ``0``, ``""`` and
    null do not. It reads the services from ``docker compose config``, which
    lists them by name, and the last marked one wins.
    """
    marked = [name for name in sorted(services, key=str) if _marked_default(services[name])]
    if marked:
        return str(marked[-1])
    if "default" in services:
        return "default"
    names = ", ".join(repr(str(name)) for name in services)
    raise ConfigError(
        f"{origin}: services: no default service among {names}; name the service samples run in "
        "'default' or mark it with 'x-default: true'"
    )


def _marked_default(body: object) -> bool:
    return isinstance(body, Mapping) and bool(body.get("x-default"))


def _service(
    name: str,
    body: Mapping[Any, Any],
    where: Where,
    field_path: str,
    base: Path,
    environ: Mapping[str, str],
    networks: Mapping[str, Any],
) -> ComposeService:
    ignored: list[str] = []
    unhonoured: list[str] = []
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
        elif key in NOT_HONOURED:
            unhonoured.append(key)
        else:
            raise where.error(key_path, "unknown key; Docker Compose does not know it either (a typo?)")
    _check_volumes(body.get("volumes"), where, f"{field_path}.volumes")
    platform = _platform(body.get("platform"), where, f"{field_path}.platform")
    _check_scale(body.get("scale"), where, f"{field_path}.scale", unhonoured)
    image = body.get("image")
    if image is not None and (not isinstance(image, str) or not image.strip()):
        raise where.error(f"{field_path}.image", f"expected an image reference such as python:3.12, got {shown(image)}")
    build = _build(body.get("build"), where, f"{field_path}.build", base, environ, ignored, platform)
    if image is None and build is None:
        raise where.error(field_path, "the service has neither image: nor build:; give it one")
    memory_mib, vcpus = _resources(body, where, field_path, ignored, unhonoured)
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
        network=service_network(body, networks, where, field_path, ignored=ignored, unhonoured=unhonoured),
        process=service_process(body, where, field_path, unhonoured=unhonoured),
        ignored=tuple(sorted(ignored)),
        unhonoured=tuple(sorted(unhonoured)),
    )


def _build(
    value: object,
    where: Where,
    field_path: str,
    base: Path,
    environ: Mapping[str, str],
    ignored: list[str],
    platform: str | None,
) -> ServiceBuild | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = {"context": value}
    if not isinstance(value, Mapping):
        raise where.error(field_path, f"expected a context folder or a mapping with context:, got {shown(value)}")
    for key in value:
        if key in BUILD_HONOURED or str(key).startswith("x-"):
            continue
        if key in BUILD_NO_MEANING:
            ignored.append(f"build.{key}")
            continue
        raise where.error(
            f"{field_path}.{key}",
            "forkd builds with context, dockerfile, args, target and platforms only; remove this key",
        )
    context_text = value.get("context", ".")
    if not isinstance(context_text, str) or not context_text:
        raise where.error(f"{field_path}.context", f"expected a folder, got {shown(context_text)}")
    if re.match(r"^[a-z][a-z0-9+.-]*://", context_text) or context_text.startswith("git@"):
        raise where.error(f"{field_path}.context", "a remote build context is not supported; give a local folder")
    context = (base / os.path.expanduser(context_text)).absolute()
    if not context.is_dir():
        raise where.error(f"{field_path}.context", f"no such folder {context} (relative to {base})")
    dockerfile_text = value.get("dockerfile", DOCKERFILE)
    if not isinstance(dockerfile_text, str) or not dockerfile_text:
        raise where.error(f"{field_path}.dockerfile", f"expected a file name, got {shown(dockerfile_text)}")
    dockerfile = (context / dockerfile_text).absolute()
    if not dockerfile.is_file():
        raise where.error(f"{field_path}.dockerfile", f"no such Dockerfile {dockerfile} (relative to the context)")
    args = _pairs(value.get("args"), where, f"{field_path}.args", environ)
    target = value.get("target")
    if target is not None and (not isinstance(target, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", target)):
        raise where.error(f"{field_path}.target", f"expected the name of a build stage, got {shown(target)}")
    platforms = value.get("platforms")
    if platforms is not None:
        if not isinstance(platforms, list) or not all(isinstance(item, str) for item in platforms):
            raise where.error(f"{field_path}.platforms", f"expected a list of platforms, got {shown(platforms)}")
        if not PLATFORM_NAMES.intersection(platforms):
            raise where.error(f"{field_path}.platforms", f"forkd runs {PLATFORM} images only; add {PLATFORM}")
        platform = PLATFORM
    return ServiceBuild(
        context=context, dockerfile=dockerfile, args=tuple(args.items()), target=target, platform=platform
    )


def _working_dir(value: object, where: Where, field_path: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value:
        raise where.error(field_path, f"expected an absolute path such as /srv/app, got {shown(value)}")
    return value


def _user(value: object, where: Where, field_path: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)) or not str(value).strip():
        raise where.error(field_path, f"expected a user name or number (USER[:GROUP]), got {shown(value)}")
    return str(value)


def _environment(
    body: Mapping[Any, Any], where: Where, field_path: str, base: Path, environ: Mapping[str, str]
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
                raise where.error(entry_path, f"expected a file name, got {shown(entry)}")
            path = (base / os.path.expanduser(entry)).absolute()
            merged.update(read_env_file(path, origin=f"{where.origin}: {entry_path}", missing_ok=not required))
    merged.update(_pairs(body.get("environment"), where, f"{field_path}.environment", environ))
    return merged


def _pairs(value: object, where: Where, field_path: str, environ: Mapping[str, str]) -> dict[str, str]:
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
                raise where.error(f"{field_path}[{index}]", f"expected KEY=VALUE, got {shown(item)}")
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
                raise where.error(f"{field_path}.{key}", f"expected a string or number, got {shown(item)}")
        return pairs
    raise where.error(field_path, f"expected a list of KEY=VALUE or a mapping, got {shown(value)}")


def _check_name(key: object, where: Where, field_path: str) -> None:
    if not isinstance(key, str) or not key or "=" in key or "\0" in key:
        raise where.error(field_path, f"expected a variable name, got {shown(key)}")


def _resources(
    body: Mapping[Any, Any], where: Where, field_path: str, ignored: list[str], unhonoured: list[str]
) -> tuple[int | None, int | None]:
    """Memory in MiB and vCPUs from ``mem_limit``/``cpus``, else ``deploy.resources.limits``."""
    memory = body.get("mem_limit")
    cpus = body.get("cpus")
    memory_path, cpus_path = f"{field_path}.mem_limit", f"{field_path}.cpus"
    deploy = body.get("deploy")
    if deploy is not None:
        if not isinstance(deploy, Mapping):
            raise where.error(f"{field_path}.deploy", f"expected a mapping, got {shown(deploy)}")
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
                    unhonoured.append(f"deploy.resources.limits.{key}")
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
            raise where.error(cpus_path, f"expected a number of CPUs such as 2 or 0.5, got {shown(cpus)}")
        vcpus = max(1, math.ceil(amount))
    return memory_mib, vcpus


_COMPOSE_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(?:i?b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}


def parse_compose_size(value: object, where: Where, field_path: str) -> int:
    """A byte size as Docker reads ``mem_limit``: ``536870912``, ``512m``, ``2g``, ``1.5gb`` (powers of 1024)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str):
        match = _COMPOSE_SIZE.match(value)
        if match:
            size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
            if size > 0:
                return size
    raise where.error(field_path, f"expected a size such as 512m or 2g, got {shown(value)}")


def _check_volumes(value: object, where: Where, field_path: str) -> None:
    """Named and anonymous volumes start empty, as in a fresh VM; a bind mount of a host path cannot be had."""
    if value is None:
        return
    if not isinstance(value, list):
        raise where.error(field_path, f"expected a list of volumes, got {shown(value)}")
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
            raise where.error(f"{field_path}[{index}]", f"expected a volume, got {shown(item)}")
        if bind:
            raise where.error(
                f"{field_path}[{index}]",
                f"a VM cannot mount the host folder {source!r}; COPY it in a Dockerfile or give it as sample files",
            )


def _platform(value: object, where: Where, field_path: str) -> str | None:
    """``platform:``: None when unset, else :data:`PLATFORM` (the only one forkd runs); ConfigError for another."""
    if value is None:
        return None
    if value not in PLATFORM_NAMES:
        raise where.error(field_path, f"forkd runs {PLATFORM} images only, not {shown(value)}")
    return PLATFORM


def _check_scale(value: object, where: Where, field_path: str, unhonoured: list[str]) -> None:
    """``scale: 1`` is what forkd does anyway; more containers of the service are not started."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise where.error(field_path, f"expected a whole number of containers, got {shown(value)}")
    if value != 1:
        unhonoured.append(f"scale: {value} (one VM per sample)")
