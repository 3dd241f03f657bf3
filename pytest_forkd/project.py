"""forkd.yaml: the project file of a test suite that uses pytest-forkd.

A project declares the snapshots its tests start from, default settings and
latency budgets, so that ``pytest`` alone reproduces the same sandboxes on
every machine::

    settings:                 # defaults for the --forkd-* options (lowest precedence)
      snapshot: tools
      backend: diff
      pool: 1
    snapshots:
      tools:                  # built once, cached in the snapshot store under this name
        from: base            # another snapshot, or image:NAME to boot a guest image
        memory_mib: 256
        env: {APP_ENV: test}  # exported to the setup commands, recorded in the snapshot
        files:                # host path (relative to forkd.yaml) -> guest path
          tools/lint.sh: /usr/local/bin/lint
        setup:                # run in the guest in order; the first failure stops the build
          - chmod +x /usr/local/bin/lint
    budgets:                  # see pytest_forkd.budgets
      fork: {p95_ms: 500}

``base`` is built in (the default image booted with its agent ready) and
cannot be redeclared. Every error names the file and the field path, e.g.
``forkd.yaml: snapshots.web.setup[2]: expected a string``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

import yaml

from .budgets import Budget, budgets_from_config
from .errors import ConfigError
from .paths import TAG_PATTERN

PROJECT_FILE: Final = "forkd.yaml"
BASE_SNAPSHOT: Final = "base"
IMAGE_PREFIX: Final = "image:"

#: Keys of the ``settings:`` section; their meaning is in :mod:`pytest_forkd.settings`.
SETTING_KEYS: Final = ("snapshot", "backend", "store", "accel", "pool", "keep_failed")
_TOP_LEVEL_KEYS: Final = ("settings", "snapshots", "budgets")
_SNAPSHOT_KEYS: Final = ("from", "memory_mib", "vcpus", "env", "files", "setup")


@dataclass(frozen=True)
class FileCopy:
    """A host file copied into the guest while a snapshot is built."""

    host_path: Path
    guest_path: str


@dataclass(frozen=True)
class SnapshotRecipe:
    """How to build one named snapshot: start from ``source``, then add files, env and setup."""

    name: str
    source: str
    """Another snapshot's name, or ``image:NAME`` to boot that guest image."""
    memory_mib: int | None = None
    """None: the memory of ``source`` (256 MiB when booting an image)."""
    vcpus: int | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    files: tuple[FileCopy, ...] = ()
    setup: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "env", MappingProxyType(dict(self.env)))

    @property
    def source_image(self) -> str | None:
        """The image booted for this snapshot, or None when it starts from another snapshot."""
        return self.source[len(IMAGE_PREFIX):] if self.source.startswith(IMAGE_PREFIX) else None


@dataclass(frozen=True)
class Project:
    """What forkd.yaml declares; :data:`EMPTY_PROJECT` when there is no file."""

    path: Path | None = None
    snapshots: Mapping[str, SnapshotRecipe] = field(default_factory=dict)
    settings: Mapping[str, Any] = field(default_factory=dict)
    """Validated values of the ``settings:`` section (``store`` is made absolute)."""
    budgets: tuple[Budget, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "snapshots", MappingProxyType(dict(self.snapshots)))
        object.__setattr__(self, "settings", MappingProxyType(dict(self.settings)))

    @property
    def origin(self) -> str:
        """How error messages name this file."""
        return self.path.name if self.path else PROJECT_FILE

    def snapshot_names(self) -> list[str]:
        """Every snapshot name a test may ask for: ``base`` and the declared ones."""
        return [BASE_SNAPSHOT, *sorted(self.snapshots)]


EMPTY_PROJECT: Final = Project()


def load_project(path: Path | str) -> Project:
    """Read and validate forkd.yaml at ``path``; ConfigError names the bad field."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}; fix --forkd-config or create the file") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path.name}: not valid YAML: {exc}") from None
    return parse_project(data, path=path.absolute())


def parse_project(data: object, *, path: Path) -> Project:
    """Validate the loaded YAML ``data`` of the file at ``path`` (relative paths resolve next to it)."""
    origin = path.name
    if data is None:
        return Project(path=path)
    where = _Where(origin)
    mapping = where.mapping(data, "", "a mapping with keys " + ", ".join(_TOP_LEVEL_KEYS))
    where.known_keys(mapping, "", _TOP_LEVEL_KEYS)
    settings = _parse_settings(mapping.get("settings"), where, path.parent)
    snapshots = _parse_snapshots(mapping.get("snapshots"), where, path.parent)
    budgets = tuple(budgets_from_config(mapping.get("budgets"), origin=origin))
    return Project(path=path, snapshots=snapshots, settings=settings, budgets=budgets)


class _Where:
    """Builds ConfigErrors that start with ``<file>: <field path>:``."""

    def __init__(self, origin: str) -> None:
        self.origin = origin

    def error(self, field_path: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.origin}: {field_path}: {problem}" if field_path else f"{self.origin}: {problem}")

    def mapping(self, value: object, field_path: str, expected: str) -> Mapping[Any, Any]:
        if not isinstance(value, Mapping):
            raise self.error(field_path, f"expected {expected}, got {_shown(value)}")
        return value

    def known_keys(self, mapping: Mapping[Any, Any], field_path: str, allowed: tuple[str, ...]) -> None:
        for key in mapping:
            if key not in allowed:
                raise self.error(_join(field_path, key), f"unknown key; valid keys: {', '.join(allowed)}")

    def string(self, value: object, field_path: str) -> str:
        if not isinstance(value, str):
            raise self.error(field_path, f"expected a string, got {_shown(value)}")
        return value

    def positive_int(self, value: object, field_path: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self.error(field_path, f"expected a whole number >= 1, got {_shown(value)}")
        return value

    def name(self, value: object, field_path: str, what: str) -> str:
        text = self.string(value, field_path)
        if not TAG_PATTERN.match(text):
            raise self.error(field_path, f"invalid {what} {text!r}: use 1-64 characters from A-Z a-z 0-9 _ -")
        return text


def _join(field_path: str, key: object) -> str:
    return f"{field_path}.{key}" if field_path else str(key)


def _shown(value: object) -> str:
    return "nothing" if value is None else f"{type(value).__name__} {value!r}"


def _parse_settings(value: object, where: _Where, root: Path) -> dict[str, Any]:
    if value is None:
        return {}
    section = where.mapping(value, "settings", "a mapping of setting name to value")
    where.known_keys(section, "settings", SETTING_KEYS)
    settings: dict[str, Any] = {}
    for key, item in section.items():
        field_path = f"settings.{key}"
        if key == "pool":
            if isinstance(item, bool) or not isinstance(item, int) or item < 0:
                raise where.error(field_path, f"expected a whole number >= 0, got {_shown(item)}")
            settings[key] = item
        elif key == "keep_failed":
            if not isinstance(item, bool):
                raise where.error(field_path, f"expected true or false, got {_shown(item)}")
            settings[key] = item
        elif key == "store":
            settings[key] = (root / where.string(item, field_path)).absolute()
        elif key == "snapshot":
            settings[key] = where.name(item, field_path, "snapshot name")
        else:
            settings[key] = where.string(item, field_path)
    return settings


def _parse_snapshots(value: object, where: _Where, root: Path) -> dict[str, SnapshotRecipe]:
    if value is None:
        return {}
    section = where.mapping(value, "snapshots", "a mapping of snapshot name to recipe")
    recipes: dict[str, SnapshotRecipe] = {}
    for name, body in section.items():
        field_path = f"snapshots.{name}"
        where.name(name, field_path, "snapshot name")
        if name == BASE_SNAPSHOT:
            raise where.error(
                field_path,
                "'base' is built in (the default image, booted and ready) and cannot be redeclared; "
                "give your snapshot another name and write `from: base`",
            )
        recipes[name] = _parse_recipe(name, body, where, field_path, root)
    _check_sources(recipes, where)
    return recipes


def _parse_recipe(name: str, body: object, where: _Where, field_path: str, root: Path) -> SnapshotRecipe:
    if body is None:
        body = {}
    recipe = where.mapping(body, field_path, "a mapping with keys " + ", ".join(_SNAPSHOT_KEYS))
    where.known_keys(recipe, field_path, _SNAPSHOT_KEYS)
    source = where.string(recipe.get("from", BASE_SNAPSHOT), f"{field_path}.from")
    if source.startswith(IMAGE_PREFIX):
        where.name(source[len(IMAGE_PREFIX):], f"{field_path}.from", "image name")
    else:
        where.name(source, f"{field_path}.from", "snapshot name (or image:NAME)")
    memory_mib = recipe.get("memory_mib")
    vcpus = recipe.get("vcpus")
    return SnapshotRecipe(
        name=name,
        source=source,
        memory_mib=None if memory_mib is None else where.positive_int(memory_mib, f"{field_path}.memory_mib"),
        vcpus=None if vcpus is None else where.positive_int(vcpus, f"{field_path}.vcpus"),
        env=_parse_env(recipe.get("env"), where, f"{field_path}.env"),
        files=_parse_files(recipe.get("files"), where, f"{field_path}.files", root),
        setup=_parse_setup(recipe.get("setup"), where, f"{field_path}.setup"),
    )


def _parse_env(value: object, where: _Where, field_path: str) -> dict[str, str]:
    if value is None:
        return {}
    env = where.mapping(value, field_path, "a mapping of variable name to value")
    parsed = {}
    for key, item in env.items():
        if not isinstance(key, str) or not key or "=" in key:
            raise where.error(_join(field_path, key), "expected a variable name without '='")
        if isinstance(item, bool) or not isinstance(item, (str, int, float)):
            raise where.error(_join(field_path, key), f"expected a string or number, got {_shown(item)}")
        parsed[key] = str(item)
    return parsed


def _parse_files(value: object, where: _Where, field_path: str, root: Path) -> tuple[FileCopy, ...]:
    if value is None:
        return ()
    files = where.mapping(value, field_path, "a mapping of host path (relative to forkd.yaml) to guest path")
    copies = []
    for host, guest in files.items():
        item_path = _join(field_path, host)
        host_path = (root / where.string(host, item_path)).absolute()
        if not host_path.is_file():
            raise where.error(item_path, f"no such file {host_path} (host paths are relative to {root})")
        guest_path = where.string(guest, item_path)
        if not guest_path.startswith("/"):
            raise where.error(item_path, f"expected an absolute guest path, got {guest_path!r}")
        copies.append(FileCopy(host_path, guest_path))
    return tuple(copies)


def _parse_setup(value: object, where: _Where, field_path: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise where.error(field_path, f"expected a list of shell commands, got {_shown(value)}")
    return tuple(where.string(command, f"{field_path}[{index}]") for index, command in enumerate(value))


def _check_sources(recipes: Mapping[str, SnapshotRecipe], where: _Where) -> None:
    """Every ``from`` names a known snapshot, and no chain of ``from`` loops."""
    known = [BASE_SNAPSHOT, *sorted(recipes)]
    for recipe in recipes.values():
        if recipe.source_image is None and recipe.source not in known:
            raise where.error(
                f"snapshots.{recipe.name}.from",
                f"unknown snapshot {recipe.source!r}; declared snapshots: {', '.join(known)} "
                "(or use image:NAME to boot a guest image)",
            )
    for recipe in recipes.values():
        chain = [recipe.name]
        current = recipe
        while current.source in recipes:
            if current.source in chain:
                loop = " -> ".join([*chain[chain.index(current.source):], current.source])
                raise where.error(f"snapshots.{recipe.name}.from", f"snapshots start from each other in a loop: {loop}")
            chain.append(current.source)
            current = recipes[current.source]
