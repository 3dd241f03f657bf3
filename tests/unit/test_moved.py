"""Old import paths of moved modules (``pytest_forkd/moved.py``): they import, warn, and are the new module.

Code written against an earlier release imports deep paths such as
``pytest_forkd.core.changes``; after a module moves to another room those
imports must keep working for a release, give the very module object of the
new path (so ``isinstance`` checks and monkeypatching see one thing), and say
once, pointing at the importing line, where the module lives now.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from pytest_forkd import moved

REPO = Path(__file__).resolve().parents[2]

#: Old paths the documentation and earlier releases named, and where they live now.
DOCUMENTED = {
    "pytest_forkd.core.changes": "pytest_forkd.analysis.changes",
    "pytest_forkd.core.manifest": "pytest_forkd.analysis.manifest",
    "pytest_forkd.core.transcript": "pytest_forkd.analysis.transcript",
    "pytest_forkd.core.trajectory": "pytest_forkd.analysis.trajectory",
    "pytest_forkd.core.replay": "pytest_forkd.analysis.replay",
    "pytest_forkd.core.archive": "pytest_forkd.archives.archive",
    "pytest_forkd.integrations.image_sessions": "pytest_forkd.integrations.sessions",
    "pytest_forkd.integrations.shared_sessions": "pytest_forkd.integrations.sessions",
}
#: The packages that lost modules: importing them registers their old names.
LOSERS = sorted({old.rpartition(".")[0] for old in DOCUMENTED} | {"pytest_forkd.storage"})


def registered() -> dict[str, str]:
    """Every alias the package registers once the packages that lost modules are imported."""
    for package in LOSERS:
        importlib.import_module(package)
    return {old: new for old, new in moved._MOVED.items() if old.startswith("pytest_forkd.")}


@pytest.fixture
def forgotten(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Old names imported afresh: each one is dropped from ``sys.modules`` and from its package's attributes.

    Both come back afterwards (monkeypatch), so other tests see the process as it was.
    """
    for old in registered():
        package, _, name = old.rpartition(".")
        monkeypatch.delitem(sys.modules, old, raising=False)
        monkeypatch.delattr(importlib.import_module(package), name, raising=False)
    yield


def import_as_user(statement: str) -> tuple[dict[str, object], list[warnings.WarningMessage]]:
    """Run an import statement as code of a file ``user_code.py``; its names and the warnings it raised."""
    names: dict[str, object] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(statement, "user_code.py", "exec"), names)
    return names, list(caught)


@pytest.mark.parametrize(("old", "new"), sorted(DOCUMENTED.items()))
def test_an_old_path_is_the_new_module_with_a_deprecation_warning_at_the_importing_line(
    forgotten: None, old: str, new: str
) -> None:
    names, caught = import_as_user(f"import {old} as module")
    module = names["module"]
    assert isinstance(module, ModuleType)
    assert module is importlib.import_module(new), "the old path must give the same module object"
    assert module.__name__ == new
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1, [str(w.message) for w in caught]
    (warning,) = deprecations
    message = str(warning.message)
    assert old in message and new in message and "will be removed" in message
    # Attributed to the line that imports, not to the import machinery: Python shows a
    # DeprecationWarning of __main__ by default, and the user sees which line to change.
    assert warning.filename == "user_code.py"
    assert warning.lineno == 1


@pytest.mark.parametrize("old", sorted(DOCUMENTED))
def test_from_the_old_package_import_gives_the_new_module(forgotten: None, old: str) -> None:
    package, _, name = old.rpartition(".")
    names, caught = import_as_user(f"from {package} import {name} as module")
    assert names["module"] is importlib.import_module(DOCUMENTED[old])
    assert any(issubclass(w.category, DeprecationWarning) and old in str(w.message) for w in caught)
    assert getattr(importlib.import_module(package), name) is names["module"], "the package's attribute too"


def test_the_warning_is_given_once_per_process(forgotten: None) -> None:
    old = "pytest_forkd.integrations.shared_sessions"
    _names, first = import_as_user(f"import {old}")
    _names, again = import_as_user(f"import {old}")
    assert [w for w in first if issubclass(w.category, DeprecationWarning)]
    assert not [w for w in again if issubclass(w.category, DeprecationWarning)], "an imported alias is cached"


def test_a_monkeypatch_through_the_old_path_is_seen_through_the_new_one(
    forgotten: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.warns(DeprecationWarning):
        old = importlib.import_module("pytest_forkd.core.changes")
    monkeypatch.setattr(old, "marker_for_this_test", "patched", raising=False)
    assert importlib.import_module("pytest_forkd.analysis.changes").marker_for_this_test == "patched"


def test_moved_to_names_the_new_home_and_none_for_modules_that_never_moved() -> None:
    registered()
    for old, new in DOCUMENTED.items():
        assert moved.moved_to(old) == new
    assert moved.moved_to("pytest_forkd.core.vm") is None
    assert moved.moved_to("pytest_forkd.analysis.changes") is None


def test_every_alias_leads_to_a_module_and_no_file_is_left_at_an_old_path() -> None:
    """An alias is dead code if a file still sits at the old path (the real module wins) or the target is gone."""
    aliases = registered()
    assert DOCUMENTED.items() <= aliases.items(), "a documented old path is no longer served"
    for old, new in aliases.items():
        assert importlib.util.find_spec(new) is not None, f"{old} points at {new}, which does not exist"
        relative = Path(*old.split("."))
        left = [path for path in (REPO / relative.with_suffix(".py"), REPO / relative / "__init__.py") if path.exists()]
        assert not left, f"{old} is served by an alias, but {left[0].relative_to(REPO)} is still there"


def test_the_import_hook_is_installed_once_and_after_the_normal_finders() -> None:
    registered()
    moved.alias({})  # a second registration adds no second finder
    finders = [finder for finder in sys.meta_path if isinstance(finder, moved._MovedFinder)]
    assert len(finders) == 1
    assert sys.meta_path.index(finders[0]) > sys.meta_path.index(importlib.machinery.PathFinder)


@pytest.fixture
def sandbox_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A throwaway package ``forkd_moved_probe`` with one real module, ``real``; aliases registered for it go away."""
    name = "forkd_moved_probe"
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / name / "real.py").write_text("WHO = 'the real module'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(moved, "_MOVED", dict(moved._MOVED))
    yield name
    for module in [key for key in sys.modules if key == name or key.startswith(f"{name}.")]:
        del sys.modules[module]


def test_a_real_module_wins_over_an_alias_of_the_same_name(sandbox_package: str) -> None:
    moved.alias({f"{sandbox_package}.real": "json", f"{sandbox_package}.gone": "json"})
    names, caught = import_as_user(f"import {sandbox_package}.real as real\nimport {sandbox_package}.gone as gone")
    real, gone = names["real"], names["gone"]
    assert isinstance(real, ModuleType) and real.WHO == "the real module"  # type: ignore[attr-defined]
    assert gone is sys.modules["json"]
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert messages == [
        f"{sandbox_package}.gone moved to json: import it from there ({sandbox_package}.gone will be removed)"
    ]


def test_a_name_never_registered_is_still_a_module_not_found_error(sandbox_package: str) -> None:
    with pytest.raises(ModuleNotFoundError, match=f"{sandbox_package}.never_existed"):
        importlib.import_module(f"{sandbox_package}.never_existed")
