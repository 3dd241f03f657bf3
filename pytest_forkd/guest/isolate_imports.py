"""The project's own code first in the guest's imports, and a check that the suite imports that copy.

On the host a suite imports its project from wherever the developer put it
on ``sys.path``: the rootdir (``python -m pytest``), ``src/`` through an
editable install's ``.pth`` file, setuptools' ``__editable__`` finder, or
the ini's ``pythonpath``. The guest has none of the host's virtualenv, but
it has the copied tree at the same paths, and a Python whose own packages
(Debian's ``python3-pytest`` brings pluggy, for one) could shadow the
project's. So, before pytest is imported in the guest, :func:`put_first`
puts the host's ``sys.path`` entries that lie in the copied tree at the
front of the guest's, in the host's order, and serves the editable
finders' packages (name to location) with a finder of its own at the front
of ``sys.meta_path``. After collection :func:`mismatches` checks every
top-level package the host imported from the project against where the
guest finds it: one line per package found elsewhere, so a run never
passes against another copy of the code.

Plain Python (the standard library alone), copied into the guest beside the
runner.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any


class ProjectFinder(importlib.abc.MetaPathFinder):
    """Finds the top-level packages an editable install mapped to the project's files (name -> location).

    A location is a package directory or a module file, as setuptools'
    ``__editable__`` finders and the ``editables`` redirector list them;
    submodules are then found inside the package as usual.
    """

    def __init__(self, mapping: Mapping[str, str]) -> None:
        self.mapping = dict(mapping)

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None) -> Any:
        location = self.mapping.get(fullname)
        if location is None:
            return None
        if os.path.isdir(location):
            init = os.path.join(location, "__init__.py")
            if os.path.isfile(init):
                return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[location])
            spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
            spec.submodule_search_locations = [location]  # a namespace package
            return spec
        if os.path.isfile(location):
            return importlib.util.spec_from_file_location(fullname, location)
        return None


def put_first(entries: Sequence[str], mapping: Mapping[str, str], runner_dir: str) -> None:
    """Put ``entries`` at the front of ``sys.path`` (in order), ``runner_dir`` at its end, and serve ``mapping``."""
    runner_dir = os.path.abspath(runner_dir)
    kept = [entry for entry in sys.path if entry not in entries and os.path.abspath(entry or ".") != runner_dir]
    sys.path[:] = [*entries, *kept, runner_dir]
    if mapping:
        sys.meta_path.insert(0, ProjectFinder(mapping))


def location_of(name: str) -> str | None:
    """Where the guest takes the top-level module ``name`` from: its package folder or file (None: nowhere)."""
    module = sys.modules.get(name)
    if module is not None:
        return module_location(module)
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        if spec.origin and spec.origin not in ("namespace", "built-in", "frozen"):
            return os.path.dirname(spec.origin)
        return next((str(entry) for entry in spec.submodule_search_locations), None)
    return str(spec.origin) if spec.origin else None


def module_location(module: ModuleType) -> str | None:
    """A top-level module's package folder or file (a namespace package's first folder), or None.

    The host asks it of the modules its suite imported (isolate/imports.py),
    the guest of the same modules after collection, so both name places alike.
    """
    file = getattr(module, "__file__", None)
    path = getattr(module, "__path__", None)
    if isinstance(file, str) and file:
        return os.path.dirname(file) if path is not None else file
    if path is not None:
        return next((str(entry) for entry in path), None)
    return None


def same_place(first: str, second: str) -> bool:
    return os.path.normpath(first) == os.path.normpath(second)


def mismatches(expected: Mapping[str, str]) -> list[str]:
    """One line per top-level package the guest takes from elsewhere than the host did (``expected``).

    A package the guest cannot find at all is left to the tests that import
    it (their ImportError says so); one found at another place would let
    them pass against code that is not the project's.
    """
    lines = []
    for name, location in sorted(expected.items()):
        found = location_of(name)
        if found is not None and not same_place(found, location):
            lines.append(
                f"the guest imports {name!r} from {found}, not from the project's copy at {location} as the host does"
            )
    return lines
