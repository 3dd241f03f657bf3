"""What ``pytest --forkd-isolate`` gives the guest: which files go in, and how its pytest is started.

The project goes into the guest at the same absolute paths as on the host,
so node ids, tracebacks, ``__file__`` and the paths in ``--junitxml`` read
the same as in a local run. The rootdir is copied, or the paths of ini
``forkd_isolate_paths``, less version-control folders, virtualenvs (any
folder holding a ``pyvenv.cfg``), caches and byte-code, and the patterns of
ini ``forkd_isolate_exclude``.

The guest's pytest gets the host's settings as the host parsed them (see
:mod:`~pytest_forkd.isolate.forwarding`): collection and selection (``-k``,
``-m``, ``-x``, ``--lf``) and reporting (the terminal, ``--junitxml``,
pytest-html) stay on the host. Its arguments are the rootdir and the ini file
(the same files, copied) and the test files of the tests to run. It runs
from the same directory, with the project's code first on ``sys.path`` as
the host has it (:mod:`~pytest_forkd.isolate.imports`).

Plain data in and out, so it is tested without a VM.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Final

import pytest

from pytest_forkd.errors import ConfigError

#: Left out of the copy unless the project says otherwise: version control, virtualenvs, caches, byte-code.
DEFAULT_EXCLUDE: Final = (
    ".git",
    ".hg",
    ".svn",
    ".venv",
    "venv",
    ".tox",
    ".nox",
    "__pycache__",
    "*.pyc",
    ".pytest_cache",
    ".mypy_cache",
    ".ruff_cache",
    ".hypothesis",
    ".forkd",
)
#: Guest directories a project must not land on: its paths are the host's, and these are the guest's own.
SYSTEM_DIRECTORIES: Final = ("/", "/bin", "/boot", "/dev", "/etc", "/lib", "/lib64", "/opt", "/proc", "/run")
SYSTEM_TREES: Final = ("/dev", "/proc", "/sys", "/opt/forkd", "/usr", "/sbin", "/bin", "/lib", "/etc", "/run")
#: Where the runner and its spec go in the guest (tmpfs, outside the project).
RUNNER_DIR: Final = "/run/forkd-isolate"
#: The runner and the modules beside it (``pytest_forkd/guest/``), copied into ``RUNNER_DIR`` as they are.
RUNNER_FILES: Final = ("isolate_runner.py", "isolate_plugin.py", "isolate_pytest.py", "isolate_imports.py")
RUNNER_PATH: Final = f"{RUNNER_DIR}/{RUNNER_FILES[0]}"
SPEC_PATH: Final = f"{RUNNER_DIR}/spec.json"
#: How far down the copied trees a virtualenv (a folder with ``pyvenv.cfg``) is looked for.
VENV_SEARCH_DEPTH: Final = 2


@dataclass(frozen=True)
class Copy:
    """One host file or tree copied to the same path in the guest."""

    path: Path
    exclude: tuple[str, ...] = ()


@dataclass(frozen=True)
class GuestPlan:
    """Everything the parent VM is given: the copies, the runner's working directory, its spec and env."""

    copies: tuple[Copy, ...]
    cwd: str
    spec: Mapping[str, Any]
    env: Mapping[str, str] = field(default_factory=dict)

    def spec_json(self) -> str:
        return json.dumps(self.spec, indent=1, sort_keys=True)

    def command(self, python: str = "python3") -> list[str]:
        return [python, RUNNER_PATH, SPEC_PATH]


def check_guest_path(path: Path, what: str) -> str:
    """``path`` as the guest path it is copied to; ConfigError if it would land on the guest's own system."""
    text = str(PurePosixPath(path))
    if not text.startswith("/"):
        raise ConfigError(f"{what}: {path} is not an absolute path")
    clashes = text in SYSTEM_DIRECTORIES or any(text == tree or text.startswith(tree + "/") for tree in SYSTEM_TREES)
    if clashes:
        raise ConfigError(
            f"{what}: {text} would be copied to the same path in the guest, which is the guest system's own; "
            "run pytest --forkd-isolate from a project directory (e.g. under /home, /srv or /tmp)"
        )
    return text


def copied_paths(rootdir: Path, configured: Sequence[str], inipath: Path | None) -> list[Path]:
    """The host paths that go into the guest: ``configured`` (relative to the rootdir) or the rootdir itself.

    The ini file goes in too when it lies outside them, so the guest's pytest
    reads the same settings.
    """
    paths: list[Path] = []
    for entry in configured:
        path = (rootdir / entry).absolute()
        if not path.exists():
            raise ConfigError(
                f"ini forkd_isolate_paths: {entry!r} does not exist under the rootdir {rootdir}; "
                "list paths relative to the rootdir (files or folders to copy into the guest)"
            )
        paths.append(path)
    if not paths:
        paths = [rootdir.absolute()]
    if inipath is not None and not any(_within(inipath, path) for path in paths):
        paths.append(inipath.absolute())
    for path in paths:
        check_guest_path(path, "pytest --forkd-isolate")
    return paths


def virtualenvs(root: Path, depth: int = VENV_SEARCH_DEPTH) -> list[str]:
    """Folders under ``root`` (relative paths, down to ``depth``) that are virtualenvs: they hold ``pyvenv.cfg``."""
    found: list[str] = []
    if not root.is_dir():
        return found
    level = [root]
    for _ in range(depth):
        following: list[Path] = []
        for folder in level:
            try:
                entries = sorted(os.scandir(folder), key=lambda entry: entry.name)
            except OSError:
                continue
            for entry in entries:
                if not entry.is_dir(follow_symlinks=False) or entry.name in DEFAULT_EXCLUDE:
                    continue
                if os.path.isfile(os.path.join(entry.path, "pyvenv.cfg")):
                    found.append(Path(entry.path).relative_to(root).as_posix())
                else:
                    following.append(Path(entry.path))
        level = following
    return found


def copies(paths: Iterable[Path], exclude: Sequence[str]) -> tuple[Copy, ...]:
    """Each path with the patterns it is copied without: the defaults, ``exclude``, and its virtualenvs."""
    return tuple(Copy(path, (*DEFAULT_EXCLUDE, *exclude, *virtualenvs(path))) for path in paths)


def _within(path: Path, root: Path) -> bool:
    try:
        path.absolute().relative_to(root.absolute())
    except ValueError:
        return False
    return True


def test_files(paths: Iterable[Path], plan_copies: Sequence[Copy]) -> list[str]:
    """The files of the tests to run, in first-seen order; ConfigError naming one outside what is copied."""
    files: list[str] = []
    for path in paths:
        if not any(_within(path, copy.path) for copy in plan_copies):
            raise ConfigError(
                f"pytest --forkd-isolate: {path} is outside the paths copied into the guest "
                f"({', '.join(str(copy.path) for copy in plan_copies)}); add it to ini forkd_isolate_paths"
            )
        text = str(path)
        if text not in files:
            files.append(text)
    return files


def guest_cwd(config: pytest.Config, plan_copies: Sequence[Copy]) -> str:
    """The runner's working directory: pytest's own when it is copied, else the rootdir."""
    invocation = Path(config.invocation_params.dir)
    for copy in plan_copies:
        if copy.path.is_dir() and _within(invocation, copy.path):
            return str(invocation)
    return str(config.rootpath)


def plan(
    config: pytest.Config,
    test_paths: Iterable[Path],
    *,
    configured_paths: Sequence[str],
    exclude: Sequence[str],
    collected_files: Iterable[Path] = (),
    environ: Mapping[str, str] = os.environ,
) -> GuestPlan:
    """The guest plan of a run whose isolated tests live in ``test_paths``.

    ``collected_files``: every test file the host collected (the guest
    imports those itself; they are not checked as the project's packages).
    """
    from pytest_forkd.guest import isolate_pytest
    from pytest_forkd.isolate import forwarding
    from pytest_forkd.isolate.imports import project_imports

    rootdir = Path(config.rootpath)
    plan_copies = copies(copied_paths(rootdir, configured_paths, config.inipath), exclude)
    files = test_files(test_paths, plan_copies)
    cwd = guest_cwd(config, plan_copies)
    imports = project_imports(plan_copies, [*collected_files, *files], cwd=str(config.invocation_params.dir))
    spec: dict[str, Any] = {
        "args": forwarding.command_line(config, files),
        "report_options": forwarding.report_options(config),
        "options": forwarding.options_by_name(config),
        "sys_path": list(imports.sys_path),
        "editable": dict(imports.editable),
        "project_modules": dict(imports.modules),
    }
    junitxml = isolate_pytest.junitxml(config)
    if junitxml is not None:
        spec["junit_family"] = str(getattr(junitxml, "family", "xunit1"))
    return GuestPlan(copies=plan_copies, cwd=cwd, spec=spec, env=forwarding.environment(environ))
