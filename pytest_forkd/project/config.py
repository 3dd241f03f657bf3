"""forkd.yaml: the project file of a test suite that uses pytest-forkd.

A project declares the snapshots its tests start from, default settings and
latency budgets, so that ``pytest`` alone reproduces the same sandboxes on
every machine::

    settings:                 # defaults for the --forkd-* options (lowest precedence)
      snapshot: tools
      backend: diff
      pool: 1
      debian_mirror: http://HOST/debian   # where guest images' packages come from (else the host's apt sources)
      keep_failed_count: 5    # kept failed-<test> snapshots beyond the newest 5 are removed
      keep_failed_age: 7d     # and those older than 7 days (s, m, h, d, w; a bare number is days)
      store_max_size: 20GiB   # evict least recently used recipe snapshots past this size (default: no cap)
      pull: missing           # container images: missing (default: a reference pulled before is used
                              # offline), always (ask the registry each run), never (only what is cached)
      insecure_registries: [registry.lan:5000]  # plain HTTP beyond localhost/127.0.0.0/8 (which always may)
    images:                   # guest images built on demand for `from: image:NAME`, cached by content hash
      tools:
        recipe: default       # the built-in recipe, or a recipe file (relative to forkd.yaml)
        packages: [git, jq]   # extra Debian packages (with their dependencies)
        files:                # host file (relative to forkd.yaml) -> guest path, put into the image
          tools/lint.sh: /usr/local/bin/lint
        setup:                # run in the guest after every boot of the image, before a snapshot's setup
          - chmod +x /usr/local/bin/lint
    snapshots:
      tools:                  # built once, cached in the snapshot store under this name
        from: base            # another snapshot, image:NAME to boot a guest image, or a container image:
                              # docker://REF, dockerfile:PATH, oci:DIR[:TAG], oci-archive:FILE, docker-archive:FILE
        memory_mib: 256
        env: {APP_ENV: test}  # exported to the setup commands and to every command of VMs forked from it
        workdir: /srv/app     # working directory of the setup commands and of every later command (created)
        shared: false         # true: one snapshot for every project (the name is global, not per project)
        files:                # host file or directory (relative to forkd.yaml) -> guest path (VM.copy_in)
          tools/lint.sh: /usr/local/bin/lint
          src: /srv/app       # a directory's contents land in /srv/app (modes, links and mtimes kept)
          vendor:             # or with exclusions (glob patterns of names or relative paths)
            to: /srv/vendor
            exclude: ["*.pyc", __pycache__, .git]
        setup:                # run in the guest in order; the first failure stops the build
          - chmod +x /usr/local/bin/lint
      web:
        from: tools
        network:              # none (default: inherited) | outbound | host | [host ports] | mapping
          mode: host          # reach only the allowed host loopback ports, at 10.0.2.100
          allow: [8080]
          forward: [8000]     # guest ports forwarded to free host ports in every child
    budgets:                  # see pytest_forkd.latency.budgets
      fork: {p95_ms: 500}

``base`` is built in (the default image booted with its agent ready); a
project may redeclare it (it then starts from ``image:default`` unless it says
otherwise, and is the project's own). Snapshot names are per project (see
:mod:`pytest_forkd.project.lifecycle`). Every error names the file and the field path, e.g.
``forkd.yaml: snapshots.web.setup[2]: expected a string``, and an unknown key the valid one it
most likely meant (``forkd.yaml: snapshot: unknown key; did you mean 'snapshots'? ...``). A file
with several mistakes fails with one ConfigError listing every one of them, a line each. The valid
keys are data (``_TOP_LEVEL_KEYS``, ``SETTING_KEYS``, ``_SNAPSHOT_KEYS``, ``_IMAGE_KEYS``): a new
key is one more entry there, and its parsing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar

import yaml

from pytest_forkd.engine.network import NetworkSpec, network_spec
from pytest_forkd.errors import ConfigError, ConfigProblems, InvalidArgument, did_you_mean
from pytest_forkd.image.oci.reference import is_reference, parse_reference
from pytest_forkd.image.oci.store import PULL_POLICIES
from pytest_forkd.latency.budgets import Budget, budgets_from_config
from pytest_forkd.paths import BASE_SNAPSHOT as BASE_SNAPSHOT  # re-exported: the project's names for them
from pytest_forkd.paths import PROJECT_FILE as PROJECT_FILE
from pytest_forkd.paths import TAG_PATTERN
from pytest_forkd.sizes import parse_byte_size

if TYPE_CHECKING:
    from pytest_forkd.core.vm import VM

IMAGE_PREFIX: Final = "image:"
_T = TypeVar("_T")

#: Keys of the ``settings:`` section; their meaning is in :mod:`pytest_forkd.project.settings`.
SETTING_KEYS: Final = (
    "snapshot",
    "backend",
    "store",
    "accel",
    "pool",
    "pool_prefill",
    "keep_failed",
    "keep_failed_count",
    "keep_failed_age",
    "store_max_size",
    "debian_mirror",
    "max_output",
    "pull",
    "insecure_registries",
)
_TOP_LEVEL_KEYS: Final = ("settings", "images", "snapshots", "budgets")
_SNAPSHOT_KEYS: Final = ("from", "memory_mib", "vcpus", "env", "workdir", "files", "setup", "shared", "network")
_IMAGE_KEYS: Final = ("recipe", "packages", "files", "setup")
_COPY_KEYS: Final = ("to", "exclude")
#: The image every snapshot boots unless it says ``from: image:NAME``.
DEFAULT_IMAGE: Final = "default"


@dataclass(frozen=True)
class FileCopy:
    """A host file or directory tree copied into the guest while a snapshot is built (with ``VM.copy_in``)."""

    host_path: Path
    guest_path: str
    exclude: tuple[str, ...] = ()
    """Glob patterns left out of a directory (see :mod:`pytest_forkd.core.copy`)."""


class MainProcess(Protocol):
    """A process a snapshot starts last and leaves running, so every VM restored from it has it running.

    How a compose service's main process (a server the agent must reach)
    starts once, in the parent, instead of in every sample. Hashable, as the
    recipe is; the harness that declares it implements it.
    """

    def describe(self) -> Mapping[str, object]:
        """What it runs, as plain JSON: part of the recipe's hash, so a change rebuilds the snapshot."""
        ...

    def start(self, vm: VM, progress: Callable[[str], None]) -> None:
        """Start it in ``vm`` and return once it is ready; SnapshotError (naming its output) if it is not."""
        ...


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
    workdir: str | None = None
    """Working directory of the setup commands and, recorded in the snapshot, of its VMs' commands."""
    shared: bool = False
    """One snapshot under this name for every project, instead of one per project."""
    network: NetworkSpec | None = None
    """None: the network of ``source`` (none when booting an image)."""
    main_process: MainProcess | None = None
    """Started after the setup and left running in the snapshot (not read from forkd.yaml: harnesses set it)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "env", MappingProxyType(dict(self.env)))

    @property
    def source_image(self) -> str | None:
        """The image booted for this snapshot (a name, or a container reference), or None for a snapshot."""
        if is_reference(self.source):
            return self.source
        return self.source[len(IMAGE_PREFIX) :] if self.source.startswith(IMAGE_PREFIX) else None


@dataclass(frozen=True)
class ProjectImage:
    """A guest image declared under ``images:``: a base recipe plus packages, files and setup commands."""

    name: str
    recipe: Path | None = None
    """A recipe file to start from; None: the built-in default recipe."""
    packages: tuple[str, ...] = ()
    files: tuple[FileCopy, ...] = ()
    setup: tuple[str, ...] = ()
    """Run in the guest after every boot of the image, before the booting snapshot's own setup."""


@dataclass(frozen=True)
class Project:
    """What forkd.yaml declares; :data:`EMPTY_PROJECT` when there is no file."""

    path: Path | None = None
    snapshots: Mapping[str, SnapshotRecipe] = field(default_factory=dict)
    settings: Mapping[str, Any] = field(default_factory=dict)
    """Validated values of the ``settings:`` section (``store`` is made absolute)."""
    budgets: tuple[Budget, ...] = ()
    images: Mapping[str, ProjectImage] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "snapshots", MappingProxyType(dict(self.snapshots)))
        object.__setattr__(self, "settings", MappingProxyType(dict(self.settings)))
        object.__setattr__(self, "images", MappingProxyType(dict(self.images)))

    @property
    def root(self) -> Path | None:
        """The project's directory (where forkd.yaml is); its real path names the project's snapshots."""
        return self.path.parent if self.path else None

    @property
    def origin(self) -> str:
        """How error messages name this file."""
        return self.path.name if self.path else PROJECT_FILE

    def with_image_snapshot(self, reference: str) -> tuple[Project, str]:
        """This project plus a snapshot of container image ``reference`` booted and ready; and its name.

        What ``--forkd-image`` runs a session on: the snapshot is named after
        the image (``image-python-3.12-slim-<hash>``) and built like any other.
        """
        import hashlib

        from pytest_forkd.paths import sanitize_tag

        last = reference.rstrip("/").rsplit("/", 1)[-1]
        digest = hashlib.sha256(reference.encode()).hexdigest()[:8]
        name = f"image-{sanitize_tag(last)[:44]}-{digest}"
        recipe = SnapshotRecipe(name=name, source=reference)
        return dataclasses.replace(self, snapshots={**self.snapshots, name: recipe}), name

    def snapshot_names(self) -> list[str]:
        """Every snapshot name a test may ask for: ``base`` and the declared ones."""
        return [BASE_SNAPSHOT, *sorted(name for name in self.snapshots if name != BASE_SNAPSHOT)]

    def is_shared(self, name: str) -> bool:
        """Whether snapshot ``name`` lives in the store root, shared by every project.

        The built-in ``base`` (the same everywhere) and snapshots marked
        ``shared: true`` do, and so does everything of a run without forkd.yaml.
        """
        if self.path is None:
            return True
        recipe = self.snapshots.get(name)
        if recipe is None:
            return name == BASE_SNAPSHOT
        return recipe.shared


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
        raise ConfigError(yaml_error_message(path, exc)) from None
    return parse_project(data, path=path.absolute())


def yaml_error_message(path: Path, exc: yaml.YAMLError) -> str:
    """One line for a YAML syntax error: the file and line, what the parser found, and the fix."""
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
    context = getattr(exc, "context", None)
    context_mark = getattr(exc, "context_mark", None)
    if context and context_mark is not None and mark is not None and context_mark.line != mark.line:
        problem += f" ({' '.join(str(context).split())} that starts on line {context_mark.line + 1})"
    return (
        f"{path.name}: not valid YAML{where}: {problem}; fix the indentation or quoting there "
        "(a value holding ': ', ' #' or an unmatched quote needs quotes of its own)"
    )


def parse_project(data: object, *, path: Path) -> Project:
    """Validate the loaded YAML ``data`` of the file at ``path`` (relative paths resolve next to it).

    Every section is checked even after a mistake, so one ConfigError lists every mistake of the file.
    """
    origin = path.name
    if data is None:
        return Project(path=path)
    where = _Where(origin)
    mapping = where.mapping(data, "", "a mapping with keys " + ", ".join(_TOP_LEVEL_KEYS))
    where.known_keys(mapping, "", _TOP_LEVEL_KEYS)
    settings: dict[str, Any] = where.attempt(lambda: _parse_settings(mapping.get("settings"), where, path.parent), {})
    images: dict[str, ProjectImage] = where.attempt(
        lambda: _parse_images(mapping.get("images"), where, path.parent), {}
    )
    snapshots: dict[str, SnapshotRecipe] = where.attempt(
        lambda: _parse_snapshots(mapping.get("snapshots"), where, path.parent), {}
    )
    budgets: list[Budget] = where.attempt(lambda: budgets_from_config(mapping.get("budgets"), origin=origin), [])
    where.problems.raise_all()
    return Project(path=path, snapshots=snapshots, settings=settings, budgets=tuple(budgets), images=images)


class _Where:
    """Builds ConfigErrors that start with ``<file>: <field path>:``, and gathers the file's mistakes."""

    def __init__(self, origin: str) -> None:
        self.origin = origin
        self.problems = ConfigProblems()

    def error(self, field_path: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.origin}: {field_path}: {problem}" if field_path else f"{self.origin}: {problem}")

    def attempt(self, check: Callable[[], _T], fallback: _T) -> _T:
        """``check()``, or ``fallback`` when it finds a mistake (recorded, and the file's checking goes on)."""
        return self.problems.attempt(check, fallback)

    def collect(self) -> AbstractContextManager[None]:
        """Record a mistake the block raises and go on after the block."""
        return self.problems.collect()

    def mapping(self, value: object, field_path: str, expected: str) -> Mapping[Any, Any]:
        if not isinstance(value, Mapping):
            raise self.error(field_path, f"expected {expected}, got {_shown(value)}")
        return value

    def known_keys(self, mapping: Mapping[Any, Any], field_path: str, allowed: tuple[str, ...]) -> None:
        """Record every key of ``mapping`` not in ``allowed``, with the valid key it most likely meant."""
        for key in mapping:
            if key not in allowed:
                problem = f"unknown key; {did_you_mean(key, allowed)}valid keys: {', '.join(allowed)}"
                self.problems.add(str(self.error(_join(field_path, key), problem)))

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
        if not TAG_PATTERN.fullmatch(text):
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
        if key in SETTING_KEYS:
            with where.collect():
                settings[key] = _setting_value(key, item, where, root)
    return settings


def _setting_value(key: str, item: object, where: _Where, root: Path) -> Any:
    """The value of ``settings.KEY``; a ConfigError naming the field when it is not a valid one."""
    field_path = f"settings.{key}"
    if key == "pool":
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise where.error(field_path, f"expected a whole number >= 0, got {_shown(item)}")
        return item
    if key in ("keep_failed", "pool_prefill"):
        if not isinstance(item, bool):
            raise where.error(field_path, f"expected true or false, got {_shown(item)}")
        return item
    if key in ("keep_failed_count", "keep_failed_age", "store_max_size"):
        from pytest_forkd.project import lifecycle

        parse = {
            "keep_failed_count": lifecycle.parse_count,
            "keep_failed_age": lifecycle.parse_age,
            "store_max_size": lifecycle.parse_size,
        }[key]
        return parse(item, f"{where.origin}: {field_path}")
    if key == "store":
        return (root / where.string(item, field_path)).absolute()
    if key == "snapshot":
        return where.name(item, field_path, "snapshot name")
    if key == "max_output":
        return parse_byte_size(item, f"{where.origin}: {field_path}")
    if key == "pull":
        if item not in PULL_POLICIES:
            raise where.error(field_path, f"expected one of {', '.join(PULL_POLICIES)}, got {_shown(item)}")
        return item
    if key == "insecure_registries":
        if not isinstance(item, list) or not all(isinstance(host, str) and host for host in item):
            raise where.error(field_path, f"expected a list of registry hosts (HOST[:PORT]), got {_shown(item)}")
        return tuple(item)
    return where.string(item, field_path)


def _container_source(source: str, where: _Where, field_path: str, root: Path) -> str:
    """The canonical text of a container reference in ``from:``; a local path is relative to forkd.yaml."""
    for prefix in ("oci-archive:", "docker-archive:", "dockerfile:", "oci:"):
        rest = source[len(prefix) :]
        if source.startswith(prefix) and rest and not rest.startswith(("/", "~")):
            source = f"{prefix}{root.absolute()}/{rest}"
            break
    try:
        return str(parse_reference(source, bare=None))
    except InvalidArgument as exc:
        raise where.error(field_path, str(exc)) from None


def _parse_snapshots(value: object, where: _Where, root: Path) -> dict[str, SnapshotRecipe]:
    if value is None:
        return {}
    section = where.mapping(value, "snapshots", "a mapping of snapshot name to recipe")
    recipes: dict[str, SnapshotRecipe] = {}
    for name, body in section.items():
        field_path = f"snapshots.{name}"
        with where.collect():
            where.name(name, field_path, "snapshot name")
            recipes[name] = _parse_recipe(name, body, where, field_path, root)
    _check_sources(recipes, where, declared={name for name in section if isinstance(name, str)})
    return recipes


def _parse_recipe(name: str, body: object, where: _Where, field_path: str, root: Path) -> SnapshotRecipe:
    if body is None:
        body = {}
    recipe = where.mapping(body, field_path, "a mapping with keys " + ", ".join(_SNAPSHOT_KEYS))
    where.known_keys(recipe, field_path, _SNAPSHOT_KEYS)
    default_source = IMAGE_PREFIX + DEFAULT_IMAGE if name == BASE_SNAPSHOT else BASE_SNAPSHOT
    memory_mib, vcpus = recipe.get("memory_mib"), recipe.get("vcpus")
    # Each field is checked even when another is wrong; a wrong one stands in as its default.
    return SnapshotRecipe(
        name=name,
        source=where.attempt(
            lambda: _parse_source(recipe.get("from", default_source), where, f"{field_path}.from", root),
            default_source,
        ),
        memory_mib=None
        if memory_mib is None
        else where.attempt(lambda: where.positive_int(memory_mib, f"{field_path}.memory_mib"), None),
        vcpus=None if vcpus is None else where.attempt(lambda: where.positive_int(vcpus, f"{field_path}.vcpus"), None),
        env=where.attempt(lambda: _parse_env(recipe.get("env"), where, f"{field_path}.env"), {}),
        files=where.attempt(lambda: _parse_files(recipe.get("files"), where, f"{field_path}.files", root), ()),
        setup=where.attempt(lambda: _parse_setup(recipe.get("setup"), where, f"{field_path}.setup"), ()),
        workdir=where.attempt(lambda: _parse_workdir(recipe.get("workdir"), where, f"{field_path}.workdir"), None),
        shared=where.attempt(lambda: _parse_flag(recipe.get("shared", False), where, f"{field_path}.shared"), False),
        network=where.attempt(lambda: _parse_network(recipe, where, f"{field_path}.network"), None),
    )


def _parse_source(value: object, where: _Where, field_path: str, root: Path) -> str:
    """``from:``: a snapshot's name, ``image:NAME``, or a container reference (made canonical)."""
    source = where.string(value, field_path)
    if source.startswith(IMAGE_PREFIX):
        where.name(source[len(IMAGE_PREFIX) :], field_path, "image name")
    elif is_reference(source):
        source = _container_source(source, where, field_path, root)
    else:
        where.name(source, field_path, "snapshot name (or image:NAME)")
    return source


def _parse_network(recipe: Mapping[Any, Any], where: _Where, field_path: str) -> NetworkSpec | None:
    if "network" not in recipe:
        return None
    try:
        return network_spec(recipe["network"], field_path)
    except InvalidArgument as exc:
        raise ConfigError(f"{where.origin}: {exc}") from None


def _parse_workdir(value: object, where: _Where, field_path: str) -> str | None:
    if value is None:
        return None
    text = where.string(value, field_path)
    if not text.startswith("/") or "\0" in text:
        raise where.error(field_path, f"expected an absolute guest path such as /srv/app, got {text!r}")
    return text


def _parse_flag(value: object, where: _Where, field_path: str) -> bool:
    if not isinstance(value, bool):
        raise where.error(field_path, f"expected true or false, got {_shown(value)}")
    return value


def _parse_images(value: object, where: _Where, root: Path) -> dict[str, ProjectImage]:
    if value is None:
        return {}
    section = where.mapping(value, "images", "a mapping of image name to image description")
    images = {}
    for name, body in section.items():
        with where.collect():
            images[name] = _parse_image(name, body, where, root)
    return images


def _parse_image(name: str, body: object, where: _Where, root: Path) -> ProjectImage:
    field_path = f"images.{name}"
    where.name(name, field_path, "image name")
    if name == DEFAULT_IMAGE:
        raise where.error(
            field_path,
            f"the image name {DEFAULT_IMAGE!r} is the built-in image and cannot be "
            "redeclared; give yours another name and boot it with `from: image:NAME`",
        )
    body = {} if body is None else body
    spec = where.mapping(body, field_path, "a mapping with keys " + ", ".join(_IMAGE_KEYS))
    where.known_keys(spec, field_path, _IMAGE_KEYS)
    return ProjectImage(
        name=name,
        recipe=where.attempt(
            lambda: _parse_image_recipe(spec.get("recipe", DEFAULT_IMAGE), where, field_path, root), None
        ),
        packages=where.attempt(lambda: _parse_packages(spec.get("packages"), where, f"{field_path}.packages"), ()),
        files=where.attempt(
            lambda: _parse_files(spec.get("files"), where, f"{field_path}.files", root, directories=False), ()
        ),
        setup=where.attempt(lambda: _parse_setup(spec.get("setup"), where, f"{field_path}.setup"), ()),
    )


def _parse_image_recipe(value: object, where: _Where, field_path: str, root: Path) -> Path | None:
    """``recipe:`` of an image: None for the built-in default, else the recipe file (relative to forkd.yaml)."""
    recipe_text = where.string(value, f"{field_path}.recipe")
    if recipe_text == DEFAULT_IMAGE:
        return None
    recipe_path = (root / recipe_text).absolute()
    if not recipe_path.is_file():
        raise where.error(
            f"{field_path}.recipe",
            f"no such recipe file {recipe_path} (paths are relative to {root}); or write `recipe: default`",
        )
    return recipe_path


def _parse_packages(value: object, where: _Where, field_path: str) -> tuple[str, ...]:
    import re

    if value is None:
        return ()
    if not isinstance(value, list):
        raise where.error(field_path, f"expected a list of Debian package names, got {_shown(value)}")
    packages = []
    for index, item in enumerate(value):
        with where.collect():
            name = where.string(item, f"{field_path}[{index}]")
            if not re.fullmatch(r"[a-z0-9][a-z0-9+.-]+(:[a-z0-9-]+)?", name):
                raise where.error(
                    f"{field_path}[{index}]",
                    f"{name!r} is not a Debian package name (lower-case letters, "
                    "digits and + . -, e.g. jq or python3-yaml)",
                )
            packages.append(name)
    return tuple(packages)


def _parse_env(value: object, where: _Where, field_path: str) -> dict[str, str]:
    if value is None:
        return {}
    env = where.mapping(value, field_path, "a mapping of variable name to value")
    parsed = {}
    for key, item in env.items():
        if not isinstance(key, str) or not key or "=" in key:
            where.problems.add(str(where.error(_join(field_path, key), "expected a variable name without '='")))
        elif isinstance(item, bool) or not isinstance(item, (str, int, float)):
            problem = f"expected a string or number, got {_shown(item)}"
            where.problems.add(str(where.error(_join(field_path, key), problem)))
        else:
            parsed[key] = str(item)
    return parsed


def _parse_files(
    value: object, where: _Where, field_path: str, root: Path, *, directories: bool = True
) -> tuple[FileCopy, ...]:
    """``files:``: host path -> guest path, or -> ``{to: guest path, exclude: [patterns]}`` for a directory.

    ``directories``: whether a host directory may be given (a snapshot's
    files are copied in with copy_in; an image's are put into its initramfs
    one by one).
    """
    if value is None:
        return ()
    files = where.mapping(value, field_path, "a mapping of host path (relative to forkd.yaml) to guest path")
    copies = []
    for host, guest in files.items():
        with where.collect():
            copies.append(_parse_copy(host, guest, where, _join(field_path, host), root, directories=directories))
    return tuple(copies)


def _parse_copy(
    host: object, guest: object, where: _Where, item_path: str, root: Path, *, directories: bool
) -> FileCopy:
    """One entry of ``files:``: ``host: guest``, or ``host: {to: guest, exclude: [patterns]}`` for a directory."""
    host_path = (root / where.string(host, item_path)).absolute()
    exclude: tuple[str, ...] = ()
    if isinstance(guest, Mapping) and directories:
        unknown = sorted(str(key) for key in guest if key not in _COPY_KEYS)
        if unknown:
            raise where.error(
                _join(item_path, unknown[0]),
                f"unknown key; {did_you_mean(unknown[0], _COPY_KEYS)}a copy takes 'to' and 'exclude'",
            )
        if "to" not in guest:
            raise where.error(item_path, "missing 'to': the guest path to copy to")
        raw_exclude = guest.get("exclude") or []
        if not isinstance(raw_exclude, list):
            raise where.error(
                _join(item_path, "exclude"), f"expected a list of glob patterns, got {_shown(raw_exclude)}"
            )
        exclude = tuple(
            where.string(pattern, f"{_join(item_path, 'exclude')}[{index}]")
            for index, pattern in enumerate(raw_exclude)
        )
        guest = guest["to"]
        item_path = _join(item_path, "to")
    if not host_path.exists() and not host_path.is_symlink():
        raise where.error(item_path, f"no such file or directory {host_path} (host paths are relative to {root})")
    if host_path.is_dir() and not directories:
        raise where.error(
            item_path,
            f"{host_path} is a directory; an image's files are single files (list them "
            "one by one), while a snapshot's files: may name whole directories",
        )
    if not (host_path.is_dir() or host_path.is_file()):
        raise where.error(item_path, f"{host_path} is neither a regular file nor a directory")
    guest_path = where.string(guest, item_path)
    if not guest_path.startswith("/"):
        raise where.error(item_path, f"expected an absolute guest path, got {guest_path!r}")
    return FileCopy(host_path, guest_path, exclude)


def _parse_setup(value: object, where: _Where, field_path: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise where.error(field_path, f"expected a list of shell commands, got {_shown(value)}")
    return tuple(where.string(command, f"{field_path}[{index}]") for index, command in enumerate(value))


def _check_sources(recipes: Mapping[str, SnapshotRecipe], where: _Where, *, declared: set[str]) -> None:
    """Every ``from`` names a declared snapshot, and no chain of ``from`` loops (each loop reported once).

    ``declared`` holds every name under ``snapshots:``, those with mistakes of their own too, so that
    a snapshot starting from one of them is not reported as well.
    """
    known = [BASE_SNAPSHOT, *sorted(name for name in declared if name != BASE_SNAPSHOT)]
    for recipe in recipes.values():
        if recipe.source_image is None and recipe.source not in known:
            problem = (
                f"unknown snapshot {recipe.source!r}; {did_you_mean(recipe.source, known)}declared snapshots: "
                f"{', '.join(known)} (or use image:NAME to boot a guest image)"
            )
            where.problems.add(str(where.error(f"snapshots.{recipe.name}.from", problem)))
    reported: set[frozenset[str]] = set()
    for recipe in recipes.values():
        chain = [recipe.name]
        current = recipe
        while current.source in recipes:
            if current.source in chain:
                members = chain[chain.index(current.source) :]
                if frozenset(members) not in reported:
                    reported.add(frozenset(members))
                    loop = " -> ".join([*members, current.source])
                    problem = f"snapshots start from each other in a loop: {loop}"
                    where.problems.add(str(where.error(f"snapshots.{recipe.name}.from", problem)))
                break
            chain.append(current.source)
            current = recipes[current.source]
