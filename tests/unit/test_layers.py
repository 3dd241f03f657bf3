"""The package's layers, checked from its source: imports only go down, and no import circle.

The import graph is read with :mod:`ast` from every module of ``pytest_forkd``
and of the built-in ``backends`` (installed as ``forkd_backends``), counting
every import, including those inside functions (a lazy import is still a
dependency). The layer check leaves out the imports under ``if TYPE_CHECKING:``
(they never run); the circle check counts them too, because a module that names
another's types for the checker depends on it as much as one that calls it.

The layers, bottom to top (a module may import its own layer and any layer
below it; docs/ARCHITECTURE.md draws them):

0. foundation: ``errors``, ``filesystems``, ``moved``, ``paths``, ``private``, ``processes``, ``sizes``,
   ``tables``, ``version``, ``waiting``, ``zstdio``
1. ``guest``, ``image``
2. ``engine``
3. ``storage``, ``latency``, and the built-in ``backends``
4. ``core`` (the VM life cycle), ``analysis``, ``archives``
5. ``project``
6. ``aio``
7. ``plugin``, ``cli``, ``integrations``, ``isolate``, ``e2b``

The package root ``pytest_forkd/__init__.py`` is the public facade: it may
name anything (lazily), and nothing inside the package imports it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest
from parsed_sources import import_nodes

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "pytest_forkd"
BACKENDS = "forkd_backends"
SOURCES = {PACKAGE: ROOT / "pytest_forkd", BACKENDS: ROOT / "backends"}

LAYERS: dict[str, int] = {
    "errors": 0,
    "paths": 0,
    "private": 0,
    "processes": 0,
    "sizes": 0,
    "version": 0,
    "waiting": 0,
    "tables": 0,
    "moved": 0,
    "filesystems": 0,
    "zstdio": 0,
    "guest": 1,
    "image": 1,
    "engine": 2,
    "storage": 3,
    "latency": 3,
    BACKENDS: 3,
    "core": 4,
    "analysis": 4,
    "archives": 4,
    "project": 5,
    "aio": 6,
    "plugin": 7,
    "cli": 7,
    "integrations": 7,
    "isolate": 7,
    "e2b": 7,
}
FACADE = PACKAGE  # the package root: may import anything, imported by nothing inside

# Imports (importer, imported) allowed to reach up a layer. Empty, and meant to
# stay so; an entry that no longer occurs fails the test, so the list only shrinks.
ALLOWED_UPWARD: frozenset[tuple[str, str]] = frozenset()

# Imports (importer, imported) left out of the circle check. Empty, and meant to
# stay so; an entry that no longer occurs fails the test, so the list only shrinks.
ALLOWED_BACK_EDGES: frozenset[tuple[str, str]] = frozenset()


def module_files() -> Iterator[tuple[str, Path]]:
    for top, directory in SOURCES.items():
        for path in sorted(directory.rglob("*.py")):
            parts = list(path.relative_to(directory).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join([top, *parts]), path


def imports_of(name: str, path: Path, known: set[str], type_checking: bool = False) -> set[str]:
    """The package modules ``name`` imports at run time (absolute names), or for the type checker too."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node, checker_only in import_nodes(path):
        if checker_only and not type_checking:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # "from pkg import sub" imports the submodule when it is one.
            targets = [
                f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module for alias in node.names
            ]
        else:  # importlib.import_module("literal")
            assert isinstance(node.args[0], ast.Constant)
            targets = [str(node.args[0].value)]
        for target in targets:
            if target.startswith("backends."):  # the source directory's name, as some tests spell it
                target = BACKENDS + target[len("backends") :]
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    files = dict(module_files())
    known = set(files)
    return {name: imports_of(name, path, known, type_checking) for name, path in files.items()}


def layer_of(module: str) -> int | None:
    """The layer of a module, None for the facade (the package root)."""
    if module == FACADE:
        return None
    if module.split(".")[0] == BACKENDS:
        return LAYERS[BACKENDS]
    return LAYERS[module.split(".")[1]]


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    bad = set()
    for importer, imported in ((a, b) for a, targets in graph.items() for b in targets):
        if imported == FACADE:
            if importer != FACADE:
                bad.add((importer, imported))
            continue
        low, high = layer_of(importer), layer_of(imported)
        if low is not None and high is not None and high > low:
            bad.add((importer, imported))
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0

    def visit(start: str) -> None:
        nonlocal counter
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_every_package_is_placed_in_a_layer(graph: dict[str, set[str]]) -> None:
    tops = {name.split(".")[1] for name in graph if name.startswith(PACKAGE + ".")}
    assert tops <= set(LAYERS), f"put {sorted(tops - set(LAYERS))} into LAYERS and docs/ARCHITECTURE.md"


def test_the_graph_sees_function_level_imports_and_skips_type_checking(tmp_path: Path) -> None:
    module = tmp_path / "mod.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from pytest_forkd.cli import main\n"
        "def f():\n    from pytest_forkd.core import vm\n"
        "from . import sibling\n"
    )
    known = {
        "pytest_forkd.core",
        "pytest_forkd.core.vm",
        "pytest_forkd.cli",
        "pytest_forkd.storage",
        "pytest_forkd.storage.sibling",
    }
    assert imports_of("pytest_forkd.storage.mod", module, known) == {
        "pytest_forkd.core.vm",
        "pytest_forkd.storage.sibling",
    }


def test_imports_only_go_down_the_layers(graph: dict[str, set[str]]) -> None:
    found = upward_imports(graph)
    new = sorted(found - ALLOWED_UPWARD)
    assert not new, "imports reaching up a layer:\n" + "\n".join(
        f"  {a} (layer {layer_of(a)}) -> {b} (layer {layer_of(b)})" for a, b in new
    )
    stale = sorted(ALLOWED_UPWARD - found)
    assert not stale, f"remove from ALLOWED_UPWARD, they are gone: {stale}"


def test_no_import_circle(graph: dict[str, set[str]]) -> None:
    stale = sorted((a, b) for a, b in ALLOWED_BACK_EDGES if b not in graph.get(a, set()))
    assert not stale, f"remove from ALLOWED_BACK_EDGES, these imports are gone: {stale}"
    pruned = {name: targets - {b for a, b in ALLOWED_BACK_EDGES if a == name} for name, targets in graph.items()}
    found = cycles(pruned)
    assert not found, "import circles:\n" + "\n".join("  " + " <-> ".join(c) for c in found)


def test_no_import_circle_counting_type_checking_imports() -> None:
    found = cycles(import_graph(type_checking=True))
    assert not found, "import circles (counting imports under TYPE_CHECKING):\n" + "\n".join(
        "  " + " <-> ".join(c) for c in found
    )


def test_the_graph_counts_type_checking_imports_when_asked(tmp_path: Path) -> None:
    module = tmp_path / "mod.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from pytest_forkd.core import vm\n"
        "else:\n    from pytest_forkd.storage import sibling\n"
    )
    known = {"pytest_forkd.core", "pytest_forkd.core.vm", "pytest_forkd.storage", "pytest_forkd.storage.sibling"}
    assert imports_of("pytest_forkd.core.mod", module, known) == {"pytest_forkd.storage.sibling"}
    assert imports_of("pytest_forkd.core.mod", module, known, type_checking=True) == {
        "pytest_forkd.core.vm",
        "pytest_forkd.storage.sibling",
    }


def test_the_circle_check_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


# -- module size ----------------------------------------------------------------------------------

#: A module longer than this holds more than one concept: split it along a seam that has a name.
MAX_MODULE_LINES = 800


def test_no_module_is_over_800_lines() -> None:
    long = {
        f"{path.relative_to(ROOT)}": lines
        for _name, path in module_files()
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split each along a named seam): " + ", ".join(
        f"{path} ({lines})" for path, lines in sorted(long.items(), key=lambda item: -item[1])
    )
