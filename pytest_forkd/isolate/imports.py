"""Where the host's suite takes the project's code from, so the guest takes it from the same copied files.

Read from the host's interpreter once the suite is collected: the
``sys.path`` entries that lie in the copied tree (the rootdir of
``python -m pytest``, ``src/`` from an editable install's ``.pth`` file or
the ini's ``pythonpath``, the folders pytest put there for test modules), the
packages editable installs serve through a finder of their own
(setuptools' ``__editable__`` finders, the ``editables`` redirector) when
they lie in the copied tree, and every top-level package already imported
from there. The guest puts the first two in front before it imports pytest
and checks the third after collection (:mod:`pytest_forkd.guest.isolate_imports`).

Test modules and ``conftest.py`` files are left out of the check: the
guest imports them itself, by path, while it collects.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from pytest_forkd.guest.isolate_imports import module_location
from pytest_forkd.guest.tarstream import Excludes


class Copy(Protocol):
    """A host tree copied into the guest (:class:`pytest_forkd.isolate.plan.Copy`)."""

    @property
    def path(self) -> Path: ...

    @property
    def exclude(self) -> tuple[str, ...]: ...


@dataclass(frozen=True)
class ProjectImports:
    """The project's part of the host's imports, in the spec's terms."""

    sys_path: tuple[str, ...] = ()
    editable: Mapping[str, str] = field(default_factory=dict)
    """Top-level name -> package folder or module file, served by an editable install's finder."""
    modules: Mapping[str, str] = field(default_factory=dict)
    """Top-level name -> where the host imported it from."""


class CopiedTree:
    """Whether a host path is part of what goes into the guest (inside a copy, not excluded)."""

    def __init__(self, copies: Sequence[Copy]) -> None:
        self._copies = [(copy.path.absolute(), Excludes(copy.exclude)) for copy in copies]

    def __contains__(self, path: object) -> bool:
        if not isinstance(path, (str, Path)):
            return False
        target = Path(os.path.abspath(path))
        for root, excludes in self._copies:
            if target == root:
                return True
            try:
                relative = target.relative_to(root).as_posix()
            except ValueError:
                continue
            parts = relative.split("/")
            return not any(excludes.excluded("/".join(parts[: depth + 1])) for depth in range(len(parts)))
        return False


def editable_mappings(meta_path: Iterable[Any], modules: Mapping[str, ModuleType]) -> dict[str, str]:
    """Top-level name -> location of the packages editable installs serve through finders.

    setuptools (64 and later) writes a module ``__editable___NAME_finder``
    whose ``MAPPING`` holds them; the ``editables`` library (hatchling's and
    others' editable installs) keeps them in its finder's ``_redirections``,
    a package given by its ``__init__.py``.
    """
    found: dict[str, str] = {}
    for finder in meta_path:
        module = modules.get(getattr(finder, "__module__", "") or "")
        mapping = getattr(module, "MAPPING", None) if module is not None else None
        if mapping is None:
            mapping = getattr(finder, "_redirections", None)
        if not isinstance(mapping, dict):
            continue
        for name, location in mapping.items():
            if not isinstance(name, str) or not isinstance(location, str) or "." in name:
                continue
            if os.path.basename(location) == "__init__.py":
                location = os.path.dirname(location)
            found.setdefault(name, location)
    return found


def project_imports(
    copies: Sequence[Copy],
    skip_files: Iterable[str | Path],
    *,
    path: Sequence[str] | None = None,
    meta_path: Iterable[Any] | None = None,
    modules: Mapping[str, ModuleType] | None = None,
    cwd: str | None = None,
) -> ProjectImports:
    """The project's part of this interpreter's imports (or of those given, for tests)."""
    tree = CopiedTree(copies)
    path = list(sys.path if path is None else path)
    modules = dict(sys.modules if modules is None else modules)
    cwd = cwd or os.getcwd()
    entries: list[str] = []
    for entry in path:
        absolute = os.path.abspath(os.path.join(cwd, entry or "."))
        if absolute not in entries and os.path.isdir(absolute) and absolute in tree:
            entries.append(absolute)
    editable = {
        name: location
        for name, location in editable_mappings(sys.meta_path if meta_path is None else meta_path, modules).items()
        if location in tree
    }
    skipped = {os.path.abspath(file) for file in skip_files}
    imported: dict[str, str] = {}
    for name, module in sorted(modules.items()):
        if "." in name or name == "__main__" or name.startswith("__editable__") or not isinstance(module, ModuleType):
            continue
        location = module_location(module)
        if location is None or location not in tree:
            continue
        if os.path.abspath(location) in skipped or os.path.basename(location) == "conftest.py":
            continue
        imported[name] = location
    return ProjectImports(sys_path=tuple(entries), editable=editable, modules=imported)
