"""``import pytest_forkd`` and the pytest plugin load only what they need.

pytest imports the plugin in every project that has pytest-forkd installed,
so importing it must not pull in the engine, the core, the store or asyncio:
those load when a test first asks for a VM. Checked by the set of modules a
fresh interpreter holds after the import (a wall-clock figure is in
``forkd bench``: ``import_ms``, ``pytest_startup_overhead_ms``).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import pytest_forkd

#: Modules that must not load with ``import pytest_forkd`` or with the plugin.
HEAVY_PREFIXES = (
    "pytest_forkd.engine",
    "pytest_forkd.core",
    "pytest_forkd.storage",
    "pytest_forkd.image",
    "pytest_forkd.aio",
    "pytest_forkd.latency.stats",
    "forkd_backends",
    "asyncio",
    "yaml",
)


def modules_after(statement: str) -> list[str]:
    """The modules a fresh interpreter holds after running ``statement``, beyond what it started with."""
    code = (
        "import sys; before = set(sys.modules)\n"
        + statement
        + "\nimport json; print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    output = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return list(json.loads(output))


def heavy(modules: list[str]) -> list[str]:
    return [name for name in modules if name.startswith(HEAVY_PREFIXES)]


def test_import_pytest_forkd_loads_the_errors_and_nothing_heavy() -> None:
    loaded = modules_after("import pytest_forkd")
    ours = [name for name in loaded if name.startswith("pytest_forkd")]
    assert heavy(loaded) == []
    assert sorted(ours) == ["pytest_forkd", "pytest_forkd.errors", "pytest_forkd.version"]


def test_the_plugin_loads_no_engine_core_store_or_asyncio() -> None:
    loaded = modules_after("import pytest, pytest_forkd.plugin")
    assert heavy(loaded) == []
    assert len([name for name in loaded if name.startswith("pytest_forkd")]) <= 21


def test_a_public_name_imports_its_module_on_first_use() -> None:
    loaded = modules_after("import pytest_forkd; pytest_forkd.VM")
    assert "pytest_forkd.core.vm" in loaded
    assert "asyncio" not in loaded  # the synchronous API does not need the asyncio one


@pytest.mark.parametrize("name", sorted(pytest_forkd.__all__))
def test_every_public_name_resolves(name: str) -> None:
    assert getattr(pytest_forkd, name) is not None
    assert name in dir(pytest_forkd)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        pytest_forkd.NoSuchThing  # noqa: B018
