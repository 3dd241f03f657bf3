"""The engine seam holds: QEMU stays inside engine/qemu/, and core/ and storage/ import without circles.

Both checks read the source (AST), so they see imports inside functions too;
only ``if TYPE_CHECKING:`` blocks are left out (they never run).
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest
from parsed_sources import import_nodes, nodes, parsed

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pytest_forkd"
BACKENDS = ROOT / "backends"
QEMU_PACKAGE = "pytest_forkd.engine.qemu"
#: Modules that drive VMs and must do it through the engine interface only (engine/base.py).
ENGINE_USERS = (
    "pytest_forkd.core.factory",
    "pytest_forkd.core.vm",
    "pytest_forkd.core.branching",
    "pytest_forkd.core.pool",
    "pytest_forkd.core.checkpoint",
    "pytest_forkd.storage",
    "forkd_backends",
)

#: QMP commands forkd sends and QEMU command-line flags it builds: only engine/qemu/ may spell them.
QMP_COMMANDS = (
    "query-status",
    "query-migrate",
    "migrate-incoming",
    "migrate-set-capabilities",
    "migrate-set-parameters",
    "xen-save-devices-state",
    "human-monitor-command",
    "getfd",
    "qmp_capabilities",
    "hostfwd_add",
    "hostfwd_remove",
    "background-snapshot",
)
QEMU_FLAGS = (
    "-incoming",
    "-netdev",
    "-chardev",
    "-qmp",
    "-machine",
    "-accel",
    "-append",
    "-initrd",
    "-kernel",
    "memory-backend-file",
    "virtio-net-device",
    "virtserialport",
    "microvm",
)


def module_name(path: Path) -> str:
    if path.is_relative_to(BACKENDS):
        parts = ["forkd_backends", *path.relative_to(BACKENDS).with_suffix("").parts]
    else:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.lru_cache(maxsize=1)
def sources() -> dict[str, Path]:
    return {module_name(path): path for path in [*PACKAGE.rglob("*.py"), *BACKENDS.rglob("*.py")]}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports at run time, at any depth of its code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node, checker_only in import_nodes(path):
        targets: list[str] = []
        if checker_only:  # under ``if TYPE_CHECKING:``: never runs
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        for target in targets:
            # The longest known module the name starts with (``from x import y`` may name a function).
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


@functools.lru_cache(maxsize=1)
def import_graph() -> dict[str, set[str]]:
    modules = sources()
    known = set(modules)
    return {name: imports_of(name, path, known) for name, path in modules.items()}


def cycles_within(graph: dict[str, set[str]], prefixes: tuple[str, ...]) -> list[list[str]]:
    """Strongly connected components (of more than one module) of the graph restricted to ``prefixes``."""
    nodes = [n for n in graph if n.startswith(prefixes)]
    inside = set(nodes)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node] & inside):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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

    for node in sorted(nodes):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_within_or_between_core_and_storage() -> None:
    graph = import_graph()
    cycles = cycles_within(graph, ("pytest_forkd.core", "pytest_forkd.storage"))
    assert cycles == [], "import circles (including imports inside functions):\n" + "\n".join(
        " <-> ".join(cycle) for cycle in cycles
    )


def test_the_graph_sees_imports_inside_functions_but_not_type_checking_blocks(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a.b\n"
        "def f():\n    from a import c\n    from .d import e\n"
    )
    found = imports_of("pkg.m", source, {"a", "a.b", "a.c", "pkg", "pkg.d"})
    assert found == {"a", "a.c", "pkg.d"}
    graph = {"x.a": {"x.b"}, "x.b": {"x.c"}, "x.c": {"x.a"}, "x.d": {"x.a"}}
    assert cycles_within(graph, ("x",)) == [["x.a", "x.b", "x.c"]]


def test_only_the_qemu_engine_imports_qmp() -> None:
    offenders = sorted(
        name
        for name, targets in import_graph().items()
        if not name.startswith(QEMU_PACKAGE) and f"{QEMU_PACKAGE}.qmp" in targets
    )
    assert offenders == []


#: Modules outside engine/ still allowed to import the QEMU engine, with why; meant to shrink to nothing
#: (an entry that no longer does fails the test).
QEMU_IMPORTS_ALLOWED: dict[str, str] = {}


def test_no_module_outside_the_engine_imports_the_qemu_engine() -> None:
    """The CLI, the plugin, the project and the core ask the engine (engine/base.py, engine/host.py...)."""
    offenders = {
        name: sorted(t for t in targets if t == QEMU_PACKAGE or t.startswith(QEMU_PACKAGE + "."))
        for name, targets in import_graph().items()
        if not name.startswith("pytest_forkd.engine")
    }
    offenders = {name: qemu for name, qemu in offenders.items() if qemu}
    assert sorted(set(offenders) - set(QEMU_IMPORTS_ALLOWED)) == [], offenders
    assert sorted(set(QEMU_IMPORTS_ALLOWED) - set(offenders)) == [], "remove from QEMU_IMPORTS_ALLOWED"


def _probes_for_qemu(path: Path) -> bool:
    """Whether the module asks an object whether it is QEMU's: ``hasattr(x, "qmp")``, ``getattr(x, "qemu")``."""
    for node in nodes(path):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr"):
            names = [a.value for a in node.args[1:2] if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if any(name.lower() in ("qmp", "qemu") for name in names):
                return True
    return any(text.lower() == "qmp" for text in _string_constants(path))


def test_no_module_outside_the_engine_asks_whether_a_machine_or_engine_is_qemu() -> None:
    """Whether a machine has a QEMU monitor is the engine's business: callers ask its capabilities."""
    offenders = sorted(
        name
        for name, path in sources().items()
        if not name.startswith("pytest_forkd.engine") and _probes_for_qemu(path)
    )
    assert offenders == []


def test_the_qemu_probe_check_finds_a_probe(tmp_path: Path) -> None:
    probing, asking = tmp_path / "probing.py", tmp_path / "asking.py"
    probing.write_text("def f(machine):\n    return hasattr(machine, 'qmp')\n")
    asking.write_text("def f(source):\n    return source.capabilities.memory_remap\n")
    assert _probes_for_qemu(probing)
    assert not _probes_for_qemu(asking)


@pytest.mark.parametrize("user", ENGINE_USERS)
def test_vm_driving_modules_reach_the_engine_through_its_interface_only(user: str) -> None:
    offenders = {
        name: sorted(t for t in targets if t.startswith(QEMU_PACKAGE))
        for name, targets in import_graph().items()
        if name == user or name.startswith(user + ".")
    }
    assert {name: qemu for name, qemu in offenders.items() if qemu} == {}


def _string_constants(path: Path) -> list[str]:
    return [node.value for node in nodes(path) if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def test_no_module_outside_the_qemu_engine_names_a_qmp_command_or_qemu_flag() -> None:
    words = re.compile("|".join(rf"(?<![\w-]){re.escape(word)}(?![\w-])" for word in QMP_COMMANDS + QEMU_FLAGS))
    offenders = {}
    for name, path in sources().items():
        if name.startswith(QEMU_PACKAGE):
            continue
        docstrings = {
            ast.get_docstring(node, clean=False)
            for node in nodes(path)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        }
        hits = sorted(
            {
                match.group()
                for text in _string_constants(path)
                if text not in docstrings
                for match in words.finditer(text)
            }
        )
        if hits:
            offenders[name] = hits
    assert offenders == {}


def test_the_engine_interface_is_typed() -> None:
    """Specs and images are the engine's own types (Engine and Machine are generic over them), not Any."""
    names = [node.id for node in ast.walk(parsed(PACKAGE / "engine" / "base.py")) if isinstance(node, ast.Name)] + [
        node.attr for node in ast.walk(parsed(PACKAGE / "engine" / "base.py")) if isinstance(node, ast.Attribute)
    ]
    assert names.count("Any") <= 3
