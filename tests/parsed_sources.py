"""Python sources parsed once per test session, for the tests that read the package's code.

The layer, engine-seam and docstring checks each walk every module of the
package; parsing it is most of their cost, so they share one parse per file.
The trees are shared: read them, never change them.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path


@functools.lru_cache(maxsize=None)
def parsed(path: Path) -> ast.Module:
    """The syntax tree of the file at ``path`` (parsed on first use, then the same object)."""
    return ast.parse(path.read_text(), str(path))


@functools.lru_cache(maxsize=None)
def nodes(path: Path) -> tuple[ast.AST, ...]:
    """Every node of :func:`parsed` ``(path)``, in :func:`ast.walk` order (walked once)."""
    return tuple(ast.walk(parsed(path)))
