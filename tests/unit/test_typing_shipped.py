"""pytest_forkd ships its type hints (PEP 561), and CI holds them and the lint to account.

A project that type-checks its tests against pytest-forkd sees the package's
annotations only when ``py.typed`` is installed with it; ``.ci/run`` runs mypy
--strict and ruff so that those annotations stay true.
"""

from __future__ import annotations

import importlib.resources
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the test environment runs 3.11
    tomllib = pytest.importorskip("tomli")


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_py_typed_marker_is_in_the_package() -> None:
    marker = importlib.resources.files("pytest_forkd").joinpath("py.typed")
    assert marker.is_file()


def test_py_typed_marker_is_package_data() -> None:
    """Installed from a wheel (not only from this checkout), the marker comes along."""
    package_data = pyproject()["tool"]["setuptools"]["package-data"]["pytest_forkd"]
    assert "py.typed" in package_data


def test_mypy_is_strict_over_the_package_and_the_backends() -> None:
    mypy = pyproject()["tool"]["mypy"]
    assert mypy["strict"] is True
    assert set(mypy["files"]) == {"pytest_forkd", "backends"}


def test_ci_runs_lint_and_type_check() -> None:
    script = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "make lint" in script
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    lint = makefile.split("\nlint:", 1)[1].split("\n\n", 1)[0]
    assert "ruff check" in lint
    assert "ruff format --check" in lint
    assert "mypy --strict" in lint


def test_dev_extra_installs_the_checkers() -> None:
    dev = " ".join(pyproject()["project"]["optional-dependencies"]["dev"])
    for tool in ("ruff>=", "mypy>=", "types-PyYAML>="):
        assert tool in dev
