"""Python sources parsed once per test session, for the tests that read the package's code.

The layer, engine-seam, fork-path and docstring checks each read every module
of the package; parsing and walking it is most of their cost, so they share
one parse, one walk and one list of imports per file. The trees are shared:
read them, never change them.

The first file of the package asked for parses the whole package at once
(``pytest_forkd/`` and ``backends/``) and then keeps the trees out of the
garbage collector's scans (``gc.freeze``): they are a million and more objects
that live to the end of the session, and every full collection of a test
afterwards would walk them all again.
"""

from __future__ import annotations

import ast
import functools
import gc
from pathlib import Path
from typing import TypeGuard

REPO = Path(__file__).resolve().parent.parent
#: The source folders parsed together on first use.
PACKAGE_SOURCES = (REPO / "pytest_forkd", REPO / "backends")


@functools.lru_cache(maxsize=1)
def _package() -> dict[Path, tuple[ast.Module, tuple[ast.AST, ...]]]:
    """Every module of the package, parsed and walked, its objects frozen out of later garbage collections.

    Garbage of the tests so far is collected first, so what is frozen is the
    live objects and the trees; parsing makes no garbage cycles, so it runs
    with the collector off.
    """
    gc.collect()
    gc.disable()
    try:
        trees = {
            path: ast.parse(path.read_text(), str(path))
            for root in PACKAGE_SOURCES
            for path in sorted(root.rglob("*.py"))
        }
        found = {path: (tree, tuple(ast.walk(tree))) for path, tree in trees.items()}
    finally:
        gc.enable()
    gc.freeze()
    return found


def _in_package(path: Path) -> bool:
    return any(root in path.parents for root in PACKAGE_SOURCES)


@functools.lru_cache(maxsize=None)
def parsed(path: Path) -> ast.Module:
    """The syntax tree of the file at ``path`` (parsed on first use, then the same object)."""
    if _in_package(path) and path in _package():
        return _package()[path][0]
    return ast.parse(path.read_text(), str(path))


@functools.lru_cache(maxsize=None)
def nodes(path: Path) -> tuple[ast.AST, ...]:
    """Every node of :func:`parsed` ``(path)``, in :func:`ast.walk` order (walked once)."""
    if _in_package(path) and path in _package():
        return _package()[path][1]
    return tuple(ast.walk(parsed(path)))


def is_type_checking(test: ast.expr) -> bool:
    """Whether an ``if`` tests ``TYPE_CHECKING`` (bare or as ``typing.TYPE_CHECKING``)."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _is_import(node: ast.AST) -> TypeGuard[ast.Import | ast.ImportFrom | ast.Call]:
    """An ``import``, a ``from ... import``, or a call ``<something>.import_module("literal", ...)``."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return True
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "import_module"
        and bool(node.args)
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    )


@functools.lru_cache(maxsize=None)
def import_nodes(path: Path) -> tuple[tuple[ast.Import | ast.ImportFrom | ast.Call, bool], ...]:
    """Every import of the file at any depth (see :func:`_is_import`), with whether only the type checker runs it.

    The second item is True for an import inside the body of an ``if TYPE_CHECKING:``
    (not its ``else``, which runs). Found in the shared :func:`nodes`, so the
    layer and engine-seam checks each read a few hundred imports instead of
    walking every tree again.
    """
    checker_only: set[int] = set()
    for node in nodes(path):
        if isinstance(node, ast.If) and is_type_checking(node.test):
            for statement in node.body:
                checker_only.update(id(inner) for inner in ast.walk(statement))
    return tuple((node, id(node) in checker_only) for node in nodes(path) if _is_import(node))
