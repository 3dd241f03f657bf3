"""Old import paths of modules that moved to another room, kept working with a DeprecationWarning.

When a module moves (``pytest_forkd.core.changes`` became
``pytest_forkd.analysis.changes``), code that imported the old path must go
on working for a release. Leaving a file behind at the old path would keep
the old room full of what no longer belongs there, so the old names are
served instead by an import hook: the package that lost the module calls
:func:`alias` from its ``__init__`` with the old and new names, and importing
an old name warns once and binds the new module under both names (one module
object, so ``isinstance`` checks and monkeypatching see the same thing).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Mapping, Sequence
from types import ModuleType

__all__ = ["alias", "moved_to"]

_MOVED: dict[str, str] = {}


def alias(moves: Mapping[str, str]) -> None:
    """Serve each old module name in ``moves`` as its new module, with a DeprecationWarning on import."""
    _MOVED.update(moves)
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedFinder())


def moved_to(old: str) -> str | None:
    """Where the module once imported as ``old`` lives now (None if it never moved)."""
    return _MOVED.get(old)


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Finds old names only; placed after the normal finders, so a real module of that name always wins."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = _MOVED.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _MovedLoader(fullname, new))


class _MovedLoader(importlib.abc.Loader):
    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{self.old} moved to {self.new}: import it from there ({self.old} will be removed)",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the new module was executed when it was imported."""
