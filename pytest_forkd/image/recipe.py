"""Image recipes: what goes into a guest image, read from YAML and validated.

A recipe names a pinned Debian release (``release: bookworm``), a kernel
package, root packages (their dependency closure is computed by the builder
from that release's index), packages to drop from that closure, host files to
copy in, extra kernel arguments and environment variables for the agent.

Every error names the recipe file and the field path (``files[1].dest``) and
says what was expected, because a recipe is written by hand and the user must
be able to fix it without reading this code.

A user recipe extends the built-in default one (``default.yaml``): its
packages, excludes, files and kernel arguments are appended to the default's
and its env entries override the default's. ``extends: none`` starts from
scratch instead.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import yaml

from ..errors import ConfigError
from ..paths import validate_tag

DEFAULT_RECIPE_PATH = Path(__file__).with_name("default.yaml")

SUPPORTED_BASES = ("debian",)
EXTENDS_CHOICES = ("default", "none")
ALLOWED_KEYS = frozenset(
    {"name", "base", "release", "extends", "kernel", "packages", "exclude", "files", "kernel_args", "env"}
)
FILE_KEYS = frozenset({"src", "dest", "mode"})
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Debian package names (policy 5.6.1), optionally with an architecture qualifier.
PACKAGE_NAME = re.compile(r"^[a-z0-9][a-z0-9+.-]+(:[a-z0-9-]+)?$")
# A Debian codename (bookworm, trixie) or suite (stable, testing); the mirror says whether it exists.
RELEASE_NAME = re.compile(r"^[a-z][a-z0-9-]{1,31}$")
DEFAULT_RELEASE = "bookworm"


@dataclass(frozen=True)
class FileSpec:
    """One host file copied into the guest at build time."""

    src: Path
    dest: str
    mode: int | None = None

    def content_digest(self) -> str:
        """sha256 of the host file, so editing it changes the image key."""
        return hashlib.sha256(self.src.read_bytes()).hexdigest()


@dataclass(frozen=True)
class Recipe:
    """A validated recipe, already merged with the default one when it extends it."""

    name: str | None
    base: str
    kernel: str
    packages: tuple[str, ...]
    exclude: tuple[str, ...] = ()
    release: str = DEFAULT_RELEASE
    files: tuple[FileSpec, ...] = ()
    kernel_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}), hash=False)
    source: Path | None = None

    def normalized(self) -> dict[str, Any]:
        """The recipe as plain data that determines the image's content.

        The name and the recipe file's location are left out on purpose: the
        same content built under two names is one image. Copied files are
        represented by their content digest, so editing one changes the key.
        """
        return {
            "base": self.base,
            "release": self.release,
            "kernel": self.kernel,
            "packages": sorted(set(self.packages)),
            "exclude": sorted(set(self.exclude)),
            "files": [{"dest": spec.dest, "mode": spec.mode, "sha256": spec.content_digest()} for spec in self.files],
            "kernel_args": list(self.kernel_args),
            "env": dict(sorted(self.env.items())),
        }


def load_default_recipe() -> Recipe:
    """The built-in recipe of the ``default`` image."""
    return _parse(_read_yaml(DEFAULT_RECIPE_PATH), DEFAULT_RECIPE_PATH, parent=None)


def load_recipe(path: Path | str) -> Recipe:
    """Read and validate a user recipe, merged with the default unless ``extends: none``."""
    path = Path(path).resolve()
    document = _read_yaml(path)
    extends = document.get("extends", "default") if isinstance(document, dict) else "default"
    parent = load_default_recipe() if extends == "default" else None
    return _parse(document, path, parent=parent)


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"recipe file {path} does not exist; check the --recipe path") from None
    except OSError as exc:
        raise ConfigError(f"cannot read recipe file {path}: {exc.strerror}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path.name}: not valid YAML: {exc}") from None


class _Fields:
    """Type checks that report ``file: field.path: expected ..., got ...``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def error(self, where: str, message: str) -> ConfigError:
        return ConfigError(f"{self.path.name}: {where}: {message}")

    def expect_str(self, value: Any, where: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.error(where, f"expected a non-empty string, got {value!r}")
        return value

    def expect_list(self, value: Any, where: str) -> list[Any]:
        if not isinstance(value, list):
            raise self.error(where, f"expected a list, got {type(value).__name__} {value!r}")
        return value

    def package_name(self, value: Any, where: str) -> str:
        name = self.expect_str(value, where)
        if not PACKAGE_NAME.match(name):
            raise self.error(where, f"expected a Debian package name, got {name!r}")
        return name

    def package_names(self, value: Any, where: str) -> tuple[str, ...]:
        return tuple(
            self.package_name(item, f"{where}[{index}]") for index, item in enumerate(self.expect_list(value, where))
        )


def _parse(document: Any, path: Path, parent: Recipe | None) -> Recipe:
    fields = _Fields(path)
    if not isinstance(document, dict):
        raise ConfigError(
            f"{path.name}: expected a mapping of recipe fields at the top level, got {type(document).__name__}"
        )
    unknown = sorted(str(key) for key in document if key not in ALLOWED_KEYS)
    if unknown:
        raise fields.error(unknown[0], f"unknown field; allowed fields are {', '.join(sorted(ALLOWED_KEYS))}")

    name = document.get("name")
    if name is not None:
        validate_tag(fields.expect_str(name, "name"), "image name")

    extends = document.get("extends", "default")
    if extends not in EXTENDS_CHOICES:
        raise fields.error("extends", f"expected one of {', '.join(EXTENDS_CHOICES)}, got {extends!r}")

    base = document.get("base", parent.base if parent else None)
    if base is None:
        raise fields.error("base", "missing; say `base: debian`")
    if base not in SUPPORTED_BASES:
        raise fields.error("base", f"expected one of {', '.join(SUPPORTED_BASES)}, got {base!r}")

    release = document.get("release", parent.release if parent else DEFAULT_RELEASE)
    if not isinstance(release, str) or not RELEASE_NAME.match(release):
        raise fields.error("release", f"expected a Debian release name such as bookworm or trixie, got {release!r}")

    kernel = document.get("kernel", parent.kernel if parent else None)
    if kernel is None:
        raise fields.error("kernel", "missing; name a kernel package such as linux-image-cloud-amd64")
    fields.package_name(kernel, "kernel")

    packages = fields.package_names(document.get("packages", []), "packages")
    exclude = fields.package_names(document.get("exclude", []), "exclude")
    files = tuple(
        _parse_file(fields, item, f"files[{index}]", path.parent)
        for index, item in enumerate(fields.expect_list(document.get("files", []), "files"))
    )
    kernel_args = tuple(
        _parse_kernel_arg(fields, item, f"kernel_args[{index}]")
        for index, item in enumerate(fields.expect_list(document.get("kernel_args", []), "kernel_args"))
    )
    env = _parse_env(fields, document.get("env", {}))

    if parent is not None:
        packages = _merged(parent.packages, packages)
        exclude = _merged(parent.exclude, exclude)
        files = parent.files + files
        kernel_args = _merged(parent.kernel_args, kernel_args)
        env = {**parent.env, **env}
    if not packages:
        raise fields.error(
            "packages", "empty; an image needs at least busybox-static, python3-minimal and libpython3-stdlib"
        )

    return Recipe(
        name=name,
        base=base,
        release=release,
        kernel=kernel,
        packages=packages,
        exclude=exclude,
        files=files,
        kernel_args=kernel_args,
        env=MappingProxyType(env),
        source=path,
    )


def _merged(first: tuple[str, ...], second: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(first + second))


def _parse_file(fields: _Fields, item: Any, where: str, recipe_dir: Path) -> FileSpec:
    if not isinstance(item, dict):
        raise fields.error(where, f"expected a mapping with src, dest and optional mode, got {item!r}")
    unknown = sorted(str(key) for key in item if key not in FILE_KEYS)
    if unknown:
        raise fields.error(f"{where}.{unknown[0]}", "unknown field; allowed fields are src, dest, mode")
    if "src" not in item:
        raise fields.error(f"{where}.src", "missing; give the host file to copy")
    if "dest" not in item:
        raise fields.error(f"{where}.dest", "missing; give the absolute path in the guest")
    src = (recipe_dir / fields.expect_str(item["src"], f"{where}.src")).resolve()
    if src.is_dir():
        raise fields.error(f"{where}.src", f"{src} is a directory; list the files in it one by one")
    if not src.is_file():
        raise fields.error(f"{where}.src", f"no such file {src} (relative paths are relative to the recipe)")
    dest = fields.expect_str(item["dest"], f"{where}.dest")
    if not dest.startswith("/") or dest == "/" or ".." in dest.split("/"):
        raise fields.error(f"{where}.dest", f"expected an absolute guest path, got {dest!r}")
    return FileSpec(src=src, dest=dest, mode=_parse_mode(fields, item.get("mode"), f"{where}.mode"))


def _parse_mode(fields: _Fields, value: Any, where: str) -> int | None:
    """Accept YAML octal ints (0755) and strings ('0o755', '755', '0755')."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise fields.error(where, f"expected a file mode such as '0o755', got {value!r}")
    if isinstance(value, int):
        mode = value
    elif isinstance(value, str):
        digits = value[2:] if value.lower().startswith("0o") else value
        try:
            mode = int(digits, 8)
        except ValueError:
            raise fields.error(where, f"expected an octal file mode such as '0o755', got {value!r}") from None
    else:
        raise fields.error(where, f"expected a file mode such as '0o755', got {value!r}")
    if not 0 <= mode <= 0o7777:
        raise fields.error(where, f"expected a file mode between 0 and 0o7777, got {value!r}")
    return mode


def _parse_kernel_arg(fields: _Fields, item: Any, where: str) -> str:
    arg = fields.expect_str(item, where)
    if any(char.isspace() for char in arg):
        raise fields.error(where, f"expected one argument without spaces, got {arg!r}; use one list item per argument")
    return arg


def _parse_env(fields: _Fields, value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise fields.error("env", f"expected a mapping of NAME: value, got {type(value).__name__} {value!r}")
    env: dict[str, str] = {}
    for key, item in value.items():
        if not isinstance(key, str) or not ENV_NAME.match(key):
            raise fields.error(
                f"env.{key}", "expected a variable name made of A-Z a-z 0-9 _ (not starting with a digit)"
            )
        if isinstance(item, bool) or not isinstance(item, (str, int, float)):
            raise fields.error(f"env.{key}", f"expected a string, got {type(item).__name__} {item!r}")
        env[key] = str(item)
    return env
