"""The run's forkd settings, from every place a user can set them.

Each setting can come from, highest precedence first: the ``forkd`` marker of
a test (snapshot, backend and memory only), the command line
(``--forkd-snapshot``), the environment (``PYTEST_FORKD_SNAPSHOT``), the ini
file (``forkd_snapshot``), forkd.yaml's ``settings:`` section, and the
built-in default. :class:`Settings` remembers where each value came from so
the report header and error messages can say so.

Resolution is plain data in, plain data out (:func:`resolve`), so it can be
tested without pytest; :func:`from_pytest_config` is the glue that reads a
pytest config.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final, Literal

import pytest

from pytest_forkd.errors import ConfigError, InvalidArgument
from pytest_forkd.guest.wire import DEFAULT_MAX_OUTPUT
from pytest_forkd.paths import BASE_SNAPSHOT, PROJECT_FILE, validate_tag
from pytest_forkd.sizes import parse_byte_size

ENV_PREFIX: Final = "PYTEST_FORKD_"
INI_PREFIX: Final = "forkd_"
OPTION_PREFIX: Final = "--forkd-"

#: Arguments the ``forkd`` marker takes (each overrides its setting for one test).
MARKER_ARGS: Final = ("snapshot", "backend", "memory_mib")
MARKER_HELP: Final = (
    "forkd(snapshot=None, backend=None, memory_mib=None): run this test's forkd_vm in a child of another "
    "snapshot (built if declared in forkd.yaml), take its checkpoints with another storage backend, or give "
    "it another memory size (a variant of the snapshot built for that size)"
)
_TRUE: Final = ("1", "true", "yes", "on")
_FALSE: Final = ("0", "false", "no", "off", "")


def _text(value: str, where: str) -> str:
    return value


def _snapshot_name(value: str, where: str) -> str:
    try:
        return validate_tag(value)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _image_reference(value: str, where: str) -> str:
    """A container image reference, canonical; a bare one means docker:// (``python:3.12-slim``)."""
    from pytest_forkd.image.oci.reference import parse_reference

    try:
        return str(parse_reference(value))
    except InvalidArgument as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _pull_policy(value: str, where: str) -> str:
    from pytest_forkd.image.oci.store import PULL_POLICIES

    if value not in PULL_POLICIES:
        raise ConfigError(f"{where}: expected {', '.join(PULL_POLICIES)}, got {value!r}")
    return value


def _accel(value: str, where: str) -> str:
    from pytest_forkd.engine.host import ACCELS  # the engine loads when a value is checked, not with pytest

    if value not in ACCELS:
        raise ConfigError(f"{where}: expected one of {', '.join(ACCELS)}, got {value!r}")
    return value


def _pool_size(value: str, where: str) -> int:
    try:
        size = int(value)
    except ValueError:
        size = -1
    if size < 0:
        raise ConfigError(f"{where}: expected a whole number >= 0 (0 turns the pool off), got {value!r}")
    return size


def parse_flag(value: str, where: str) -> bool:
    """An on/off setting's text (1/true/yes/on, 0/false/no/off or empty); ConfigError naming ``where`` otherwise."""
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ConfigError(f"{where}: expected one of {', '.join(_TRUE)} or {', '.join(_FALSE[:-1])}, got {value!r}")


def _count(value: str, where: str) -> int:
    from pytest_forkd.project.lifecycle import parse_count

    return parse_count(value, where)


def _age(value: str, where: str) -> float:
    from pytest_forkd.project.lifecycle import parse_age

    return parse_age(value, where)


def _size(value: str, where: str) -> int | None:
    from pytest_forkd.project.lifecycle import parse_size

    return parse_size(value, where)


@dataclass(frozen=True)
class Option:
    """One setting: its ``--forkd-NAME`` option, ``forkd_NAME`` ini key and ``PYTEST_FORKD_NAME`` variable."""

    name: str
    help: str
    default: Any
    parse: Callable[[str, str], Any]
    """Turns the text of an env variable, ini value or option into the value; ``where`` names the source."""
    metavar: str | None = None
    is_flag: bool = False
    is_path: bool = False
    ini_type: Literal["string", "bool", "int"] = "string"
    """How pytest reads the ini key (``parser.addini(type=...)``): a flag is ``bool``, a count ``int``, so
    ``[tool.pytest]`` in pyproject.toml takes ``true`` and ``3`` as they are."""

    @property
    def flag(self) -> str:
        return OPTION_PREFIX + self.name.replace("_", "-")

    @property
    def ini_key(self) -> str:
        return INI_PREFIX + self.name

    @property
    def env_var(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def dest(self) -> str:
        return "forkd_" + self.name


OPTIONS: Final = (
    Option(
        "snapshot",
        "snapshot the session's parent VM and the tests' children start from "
        "(default: base, the default image booted and ready; others are declared in forkd.yaml)",
        BASE_SNAPSHOT,
        _snapshot_name,
        metavar="NAME",
    ),
    Option(
        "image",
        "container image the session's parent boots (a snapshot of it, built once): docker://REF or a bare "
        "NAME[:TAG] (Docker Hub, or REGISTRY/NAME), oci:DIR[:TAG], oci-archive:FILE, docker-archive:FILE, "
        "dockerfile:PATH",
        None,
        _image_reference,
        metavar="REF",
    ),
    Option(
        "pull",
        "when container images are pulled: missing (a reference pulled before is used from the cache, "
        "offline), always (ask the registry every run) or never (default: missing)",
        "missing",
        _pull_policy,
        metavar="missing|always|never",
    ),
    Option(
        "backend",
        "storage backend for branches and checkpoints: full, diff, uffd or a third-party one (default: diff)",
        "diff",
        _text,
        metavar="NAME",
    ),
    Option(
        "config",
        f"project file declaring snapshots, settings and budgets (default: {PROJECT_FILE} in the "
        "rootdir, when present)",
        None,
        _text,
        metavar="PATH",
        is_path=True,
    ),
    Option(
        "store",
        "persistent snapshot store directory (default: $FORKD_STORE or the user cache)",
        None,
        _text,
        metavar="DIR",
        is_path=True,
    ),
    Option(
        "accel",
        "accelerator: auto (KVM when it really works, else TCG), kvm or tcg (default: auto)",
        "auto",
        _accel,
        metavar="auto|kvm|tcg",
    ),
    Option(
        "pool",
        "children of the parent kept pre-restored so a test's VM is ready in tens of ms "
        "(default: 1; 0 turns the pool off)",
        1,
        _pool_size,
        metavar="N",
        ini_type="int",
    ),
    Option(
        "pool_prefill",
        "before the first test that needs a VM, restore a pooled child for every test to come "
        "(as many as memory allows), so each test's VM is ready at once; the wait is reported as a session cost",
        False,
        parse_flag,
        is_flag=True,
        ini_type="bool",
    ),
    Option(
        "max_output",
        "bytes of each of stdout and stderr a guest command keeps, its head and tail "
        "(default: 4MiB; units KiB, MiB, GiB)",
        DEFAULT_MAX_OUTPUT,
        parse_byte_size,
        metavar="BYTES",
    ),
    Option(
        "keep_failed",
        "save a failing test's VM as snapshot failed-<test> in the persistent store, to inspect with `forkd shell`",
        False,
        parse_flag,
        is_flag=True,
        ini_type="bool",
    ),
    Option(
        "keep_failed_count",
        "kept failed-<test> snapshots of the project beyond the newest N are removed (default: 5)",
        5,
        _count,
        metavar="N",
        ini_type="int",
    ),
    Option(
        "keep_failed_age",
        "kept failed-<test> snapshots older than AGE are removed, e.g. 7d, 12h (default: 7d)",
        7 * 86400.0,
        _age,
        metavar="AGE",
    ),
    Option(
        "store_max_size",
        "cap on the snapshot store's size, e.g. 20GiB: least recently used recipe "
        "snapshots are evicted (and rebuilt when needed), tagged ones never (default: none)",
        None,
        _size,
        metavar="SIZE",
    ),
)
_BY_NAME: Final = {option.name: option for option in OPTIONS}


def add_options(group: Any, parser: pytest.Parser) -> None:
    """Register every setting's command-line option (in ``group``) and ini key."""
    for option in OPTIONS:
        help_text = f"{option.help}. Also ini {option.ini_key}, env {option.env_var}"
        if option.is_flag:
            group.addoption(option.flag, action="store_true", default=None, dest=option.dest, help=help_text)
        else:
            group.addoption(option.flag, default=None, dest=option.dest, metavar=option.metavar, help=help_text)
        parser.addini(option.ini_key, help=option.help, type=option.ini_type, default=None)


def ini_text(config: pytest.Config, option: Option) -> str:
    """The ini value of ``option`` as the text its parser takes ("" when unset); a bad one names the key.

    pytest converts ``bool`` and ``int`` keys itself (see :func:`add_options`);
    its own error for a bad value does not say which key, so it is replaced.
    """
    try:
        value = config.getini(option.ini_key)
    except (pytest.UsageError, ValueError, TypeError) as exc:
        expected = {"bool": "true or false", "int": "a whole number"}.get(option.ini_type, "a string")
        raise ConfigError(f"ini {option.ini_key}: expected {expected} ({exc}); fix it in the pytest ini file") from None
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@dataclass(frozen=True)
class Settings:
    """The resolved forkd settings of one pytest run."""

    snapshot: str = BASE_SNAPSHOT
    image: str | None = None
    """A container image reference: the session's parent is a snapshot of it (``--forkd-image``)."""
    pull: str = "missing"
    """When container images are pulled again: missing, always or never."""
    backend: str = "diff"
    config: Path | None = None
    """The project file that was read, or None."""
    store: Path | None = None
    """None means the default persistent store (``$FORKD_STORE`` or the user cache)."""
    accel: str = "auto"
    pool: int = 1
    pool_prefill: bool = False
    keep_failed: bool = False
    max_output: int = DEFAULT_MAX_OUTPUT
    """Bytes of each output stream an exec keeps by default (``vm.max_output``)."""
    keep_failed_count: int = 5
    keep_failed_age: float = 7 * 86400.0
    """Seconds."""
    store_max_size: int | None = None
    """Bytes; None: no cap."""
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)
    """Where each value came from: ``--forkd-pool``, ``PYTEST_FORKD_POOL``, ``forkd.yaml``, ``default``..."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sources", MappingProxyType(dict(self.sources)))

    def describe(self, name: str) -> str:
        """``value (from SOURCE)``, for the report header."""
        return f"{getattr(self, name)} (from {self.sources.get(name, 'default')})"


@dataclass(frozen=True)
class VMChoice:
    """What one test's VM is made from: the run's settings with the test's ``forkd`` marker applied."""

    snapshot: str
    backend: str
    memory_mib: int | None = None
    """None: the snapshot's own memory size."""


def config_path(cli: str | None, env: Mapping[str, str], ini: str, rootdir: Path) -> tuple[Path | None, str]:
    """The project file to read and where that choice came from.

    An explicitly named file must exist; the default ``forkd.yaml`` in the
    rootdir is optional.
    """
    option = _BY_NAME["config"]
    for value, source, base in (
        (cli, option.flag, Path.cwd()),
        (env.get(option.env_var) or None, option.env_var, Path.cwd()),
        (ini or None, f"ini {option.ini_key}", rootdir),
    ):
        if value:
            path = (base / value).absolute()
            if not path.is_file():
                raise ConfigError(f"{source}: no such file {path}; fix the path or remove the setting")
            return path, source
    default = rootdir / PROJECT_FILE
    return (default, "rootdir") if default.is_file() else (None, "default")


def resolve(
    *,
    cli: Mapping[str, Any],
    env: Mapping[str, str],
    ini: Mapping[str, str],
    project_settings: Mapping[str, Any],
    backends: Callable[[], list[str]],
    rootdir: Path,
    config: Path | None = None,
    config_source: str = "default",
    project_origin: str = PROJECT_FILE,
) -> Settings:
    """Combine the sources (CLI > env > ini > forkd.yaml > default) into validated settings.

    ``cli`` holds option values by setting name (None = not given), ``ini``
    the raw ini strings ("" = not set), ``project_settings`` forkd.yaml's
    validated ``settings:`` section; ``backends()`` returns the registered
    storage backend ids (loading them costs tens of ms, so it is only called
    to check a backend the user named). Relative store paths resolve against the working directory
    (CLI, env) or the rootdir (ini); forkd.yaml already made its own absolute.
    """
    values: dict[str, Any] = {"config": config}
    sources: dict[str, str] = {"config": config_source}
    for option in OPTIONS:
        if option.name == "config":
            continue
        value, source = option.default, "default"
        cli_value = cli.get(option.name)
        if cli_value is not None:
            value = cli_value if option.is_flag else option.parse(str(cli_value), option.flag)
            source = option.flag
        elif env.get(option.env_var, "") != "":
            value, source = option.parse(env[option.env_var], option.env_var), option.env_var
        elif ini.get(option.name, "") != "":
            value = option.parse(ini[option.name], f"ini {option.ini_key}")
            source = f"ini {option.ini_key}"
        elif option.name in project_settings:
            source = f"{project_origin} settings.{option.name}"
            value = project_settings[option.name]
            if isinstance(value, str) and not option.is_path:
                value = option.parse(value, source)
        if option.is_path and isinstance(value, str):
            value = ((rootdir if source.startswith("ini ") else Path.cwd()) / value).absolute()
        values[option.name], sources[option.name] = value, source
    if sources["backend"] != "default":
        check_backend(values["backend"], backends(), sources["backend"])
    if values["image"] is not None and sources["snapshot"] != "default":
        raise ConfigError(
            f"{sources['image']} and {sources['snapshot']} both name what the session starts from; give one "
            "(a snapshot in forkd.yaml can start from an image: `from: docker://...`)"
        )
    return Settings(**values, sources=sources)


def check_backend(backend: str, backends: list[str], where: str) -> str:
    """``backend`` if it is a registered storage backend id; ConfigError listing them otherwise."""
    if backend not in backends:
        raise ConfigError(
            f"{where}: unknown storage backend {backend!r}; registered backends: {', '.join(backends) or 'none'}"
        )
    return backend


def choose_vm(
    settings: Settings,
    marker_args: tuple[Any, ...],
    marker_kwargs: Mapping[str, Any],
    *,
    backends: list[str],
    test: str,
) -> VMChoice:
    """Apply a test's ``forkd(...)`` marker (None when absent: pass empty args) to the settings."""
    where = f"forkd marker on {test}"
    if marker_args:
        raise ConfigError(f"{where}: takes keyword arguments only, e.g. forkd(snapshot='tools')")
    unknown = sorted(set(marker_kwargs) - set(MARKER_ARGS))
    if unknown:
        raise ConfigError(
            f"{where}: unknown argument(s) {', '.join(unknown)}; valid arguments: {', '.join(MARKER_ARGS)}"
        )
    snapshot = marker_kwargs.get("snapshot")
    backend = marker_kwargs.get("backend")
    memory_mib = marker_kwargs.get("memory_mib")
    if snapshot is not None:
        _snapshot_name(snapshot, f"{where}: snapshot")
    if backend is not None:
        check_backend(backend, backends, f"{where}: backend")
    if memory_mib is not None and (isinstance(memory_mib, bool) or not isinstance(memory_mib, int) or memory_mib < 64):
        raise ConfigError(f"{where}: memory_mib: expected a whole number of MiB >= 64, got {memory_mib!r}")
    return VMChoice(snapshot=snapshot or settings.snapshot, backend=backend or settings.backend, memory_mib=memory_mib)


def project_file(config: pytest.Config) -> tuple[Path | None, str]:
    """The project file of a pytest run (``--forkd-config``, env, ini, or forkd.yaml in the rootdir)."""
    option = _BY_NAME["config"]
    return config_path(config.getoption(option.dest), os.environ, ini_text(config, option), Path(config.rootpath))


def from_pytest_config(
    config: pytest.Config,
    project_settings: Mapping[str, Any],
    *,
    config_file: Path | None,
    config_source: str,
    backends: Callable[[], list[str]],
) -> Settings:
    """Resolve the settings of a pytest run (command line, environment, ini file, forkd.yaml)."""
    return resolve(
        cli={option.name: config.getoption(option.dest) for option in OPTIONS if option.name != "config"},
        env=os.environ,
        ini={option.name: ini_text(config, option) for option in OPTIONS if option.name != "config"},
        project_settings=project_settings,
        backends=backends,
        rootdir=Path(config.rootpath),
        config=config_file,
        config_source=config_source,
        project_origin=config_file.name if config_file else PROJECT_FILE,
    )
