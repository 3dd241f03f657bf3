"""The fork path reads top-down: a static walk of it stays in few modules and never climbs back up.

The walk starts at :meth:`VMFactory.fork_snapshot` and follows, depth first
and in the order Python evaluates them, every call it can resolve from the
source alone (:mod:`ast`): functions of the module and names it imports,
methods on ``self`` (its class and base classes), constructors (``__init__``,
a dataclass's ``__post_init__``), methods and properties of a value whose
class is known from an annotation (a parameter, an attribute set in
``__init__`` or declared on the class, a function's return type, the element
type of a list, a tuple or a mapping), and the overrides of such a method in
the package's subclasses (a storage backend's ``prepare_child`` in
``forkd_backends``). A function nested in another is walked where it is
called or handed to another call (a thread pool's task). Each function is
visited once. A callable only known at run time (an argument, a partial) is
not followed.

Two walks are made from the start:

* *the path*: the functions of the factory's module the fork runs, every
  function they call in any module, and the helpers each of those calls in
  its own module. What a called function asks of yet another module is that
  module's business, not a step of the fork (``plan_child`` in storage asks
  the store, the engine and the backend; the path shows the one call). The
  path is the way a fork goes when it works: exception handlers are its
  exits and are left out of it.
* *everything below*: every call, handlers included, as deep as the
  package's code goes.

Two figures are read off them. A *stay* is a maximal run of consecutive
visits of the path to one module: a path that goes down the layers doing
each module's part at once has few. A *climb* is a call, anywhere below the
start, from a module of a lower layer (``tests/unit/test_layers.py``
``LAYERS``) into one of a higher layer: a callback into the core, the kind of
step a record that forks itself or a module-level hook makes.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest
from parsed_sources import nodes, parsed
from test_layers import ROOT, layer_of, module_files

_T = TypeVar("_T")

START = ("pytest_forkd.core.factory", "VMFactory.fork_snapshot")
MAX_STAYS = 15
MAX_CLIMBS = 3

CONTAINERS = frozenset(
    {"list", "List", "Sequence", "Iterable", "Iterator", "set", "frozenset", "Collection", "deque", "KeysView"}
)
OPTIONAL = frozenset({"Optional", "Final", "ClassVar", "Annotated"})
MAPPINGS = frozenset({"dict", "Dict", "Mapping", "MutableMapping", "defaultdict", "OrderedDict"})
#: Methods of a mapping that give one of its values.
VALUE_GETTERS = frozenset({"get", "pop", "setdefault"})


# -- the package, indexed -----------------------------------------------------------------------------------------
@dataclass
class ClassInfo:
    module: str
    name: str
    node: ast.ClassDef
    methods: dict[str, ast.FunctionDef] = field(default_factory=dict)
    attributes: dict[str, Attribute] = field(default_factory=dict)
    is_dataclass: bool = False

    @property
    def key(self) -> str:
        return f"{self.module}:{self.name}"


@dataclass
class ModuleInfo:
    name: str
    tree: ast.Module
    functions: dict[str, ast.FunctionDef] = field(default_factory=dict)
    classes: dict[str, ClassInfo] = field(default_factory=dict)
    imports: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    """Local name -> (module, attribute or None for the module itself)."""
    aliases: dict[str, ast.expr] = field(default_factory=dict)


@dataclass(frozen=True)
class Attribute:
    """What the walk knows of an attribute of instances: its annotation, else the value ``__init__`` gives it."""

    module: str
    annotation: ast.expr | None = None
    value: ast.expr | None = None


@dataclass(frozen=True)
class Alias:
    """A module-level assignment (a type alias such as ``AnyEngine = Engine[SpecLike, ImageLike]``)."""

    module: str
    value: ast.expr


@dataclass(frozen=True)
class Type:
    """What the walk knows of a value: an instance of a class, a container, a tuple, a module."""

    kind: str  # "class", "list", "tuple", "module"
    target: str = ""  # class key or module name
    items: tuple[Type | None, ...] = ()


def _function_nodes(body: list[ast.stmt]) -> Iterator[ast.FunctionDef]:
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node  # type: ignore[misc]


class Package:
    """Every module of the package and of the built-in backends, indexed (``root``: another checkout's)."""

    def __init__(self, root: Path | None = None) -> None:
        self.modules: dict[str, ModuleInfo] = {}
        for name, path in module_files():
            if root is not None:
                path = root / path.relative_to(ROOT)
                if not path.is_file():
                    continue
            self.modules[name] = self._index(name, path)
        self.classes = {cls.key: cls for module in self.modules.values() for cls in module.classes.values()}
        self.subclasses: dict[str, list[ClassInfo]] = {}
        for module in self.modules.values():
            for info in module.classes.values():
                for base in info.node.bases:
                    resolved = self.class_of(module.name, base)
                    if resolved is not None:
                        self.subclasses.setdefault(resolved.key, []).append(info)

    def _index(self, name: str, path: Path) -> ModuleInfo:
        tree = parsed(path)  # shared with the other source checks: read, never changed
        info = ModuleInfo(name, tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in nodes(path):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        info.imports[alias.asname] = (alias.name, None)
                    else:
                        info.imports.setdefault(alias.name.split(".")[0], (alias.name.split(".")[0], None))
            elif isinstance(node, ast.ImportFrom):
                relative = "." * node.level + (node.module or "")
                module = importlib.util.resolve_name(relative, package) if node.level else relative
                if module.startswith("backends."):
                    module = "forkd_backends" + module[len("backends") :]
                for alias in node.names:
                    info.imports[alias.asname or alias.name] = (module, alias.name)
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                info.functions[node.name] = node  # type: ignore[assignment]
            elif isinstance(node, ast.ClassDef):
                info.classes[node.name] = self._class(name, node)
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                info.aliases[node.targets[0].id] = node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                info.aliases[node.target.id] = node.value
        return info

    def _class(self, module: str, node: ast.ClassDef) -> ClassInfo:
        info = ClassInfo(module, node.name, node)
        info.is_dataclass = any("dataclass" in ast.unparse(decorator) for decorator in node.decorator_list)
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                info.attributes[item.target.id] = Attribute(module, annotation=item.annotation)
        for method in _function_nodes(node.body):
            info.methods[method.name] = method
            arguments = method.args
            annotated = {
                argument.arg: argument.annotation
                for argument in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
                if argument.annotation is not None
            }
            for statement in ast.walk(method):
                target, annotation = None, None
                if isinstance(statement, ast.AnnAssign):
                    target, annotation = statement.target, statement.annotation
                elif isinstance(statement, ast.Assign) and len(statement.targets) == 1:
                    target = statement.targets[0]
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                    and target.attr not in info.attributes
                ):
                    value = statement.value if isinstance(statement, ast.Assign) else None
                    if annotation is None and isinstance(value, ast.Name) and value.id in annotated:
                        annotation = annotated[value.id]  # self.x = x, a parameter of known type
                    if annotation is not None:
                        info.attributes[target.attr] = Attribute(module, annotation=annotation)
                    elif method.name == "__init__" and value is not None:
                        info.attributes[target.attr] = Attribute(module, value=value)
        return info

    # -- names ------------------------------------------------------------------------------------------------
    def symbol(self, module: str, name: str, depth: int = 0) -> object | None:
        """What ``name`` means in ``module``: a ModuleInfo, a ClassInfo, (module, function node), or None."""
        info = self.modules.get(module)
        if info is None or depth > 10:
            return None
        if name in info.functions:
            return (module, info.functions[name])
        if name in info.classes:
            return info.classes[name]
        if name in info.imports:
            source, attribute = info.imports[name]
            if attribute is None:
                return self.modules.get(source)
            if f"{source}.{attribute}" in self.modules:
                return self.modules[f"{source}.{attribute}"]
            return self.symbol(source, attribute, depth + 1)
        if name in info.aliases:
            return Alias(module, info.aliases[name])
        return None

    def class_of(self, module: str, expression: ast.expr) -> ClassInfo | None:
        found = self.annotation(module, expression)
        return self.classes.get(found.target) if found is not None and found.kind == "class" else None

    def annotation(self, module: str, expression: ast.expr | None, depth: int = 0) -> Type | None:
        """The type an annotation (or a type alias) names, as far as the walk can tell."""
        if expression is None or depth > 10:
            return None
        if isinstance(expression, ast.Constant) and isinstance(expression.value, str):
            try:
                return self.annotation(module, ast.parse(expression.value, mode="eval").body, depth + 1)
            except SyntaxError:
                return None
        if isinstance(expression, ast.BinOp) and isinstance(expression.op, ast.BitOr):
            return self.annotation(module, expression.left, depth + 1) or self.annotation(
                module, expression.right, depth + 1
            )
        if isinstance(expression, ast.Subscript):
            head = expression.value
            head_name = head.attr if isinstance(head, ast.Attribute) else head.id if isinstance(head, ast.Name) else ""
            arguments = expression.slice.elts if isinstance(expression.slice, ast.Tuple) else [expression.slice]
            if head_name in CONTAINERS:
                return Type("list", items=(self.annotation(module, arguments[0], depth + 1),))
            if head_name in MAPPINGS and len(arguments) == 2:
                return Type("dict", items=(self.annotation(module, arguments[1], depth + 1),))
            if head_name in ("tuple", "Tuple"):
                return Type("tuple", items=tuple(self.annotation(module, a, depth + 1) for a in arguments))
            if head_name in OPTIONAL:
                return self.annotation(module, arguments[0], depth + 1)
            return self.annotation(module, head, depth + 1)
        target: object | None = None
        if isinstance(expression, ast.Name):
            target = self.symbol(module, expression.id)
        elif isinstance(expression, ast.Attribute):
            owner = self.annotation(module, expression.value, depth + 1)
            if owner is not None and owner.kind == "module":
                target = self.symbol(owner.target, expression.attr)
        if isinstance(target, Alias):
            return self.annotation(target.module, target.value, depth + 1)
        if isinstance(target, ClassInfo):
            return Type("class", target.key)
        if isinstance(target, ModuleInfo):
            return Type("module", target.name)
        return None

    def method(self, cls: ClassInfo, name: str) -> tuple[ClassInfo, ast.FunctionDef] | None:
        """``name`` on ``cls`` or the first base class of the package that has it."""
        return self._inherited(cls, lambda each: (each, each.methods[name]) if name in each.methods else None)

    def attribute(self, cls: ClassInfo, name: str) -> Attribute | None:
        return self._inherited(cls, lambda each: each.attributes.get(name))

    def _inherited(
        self, cls: ClassInfo, find: Callable[[ClassInfo], _T | None], seen: frozenset[str] = frozenset()
    ) -> _T | None:
        """What ``find`` finds on ``cls``, else on its base classes of the package, depth first."""
        found = find(cls)
        for base in cls.node.bases if found is None else ():
            parent = self.class_of(cls.module, base)
            if parent is not None and parent.key not in seen:
                found = self._inherited(parent, find, seen | {cls.key})
                if found is not None:
                    break
        return found

    def overrides(self, cls: ClassInfo, name: str) -> Iterator[tuple[ClassInfo, ast.FunctionDef]]:
        """Definitions of ``name`` in the package's subclasses of ``cls``, depth first."""
        for sub in self.subclasses.get(cls.key, []):
            if name in sub.methods:
                yield sub, sub.methods[name]
            yield from self.overrides(sub, name)


def _callable(found: object | None) -> ClassInfo | tuple[str, ast.FunctionDef, None] | None:
    """A symbol as a call target: a class (its constructor) or a module-level function."""
    if isinstance(found, ClassInfo):
        return found
    if isinstance(found, tuple):
        return (found[0], found[1], None)
    return None


def _is_property(node: ast.FunctionDef) -> bool:
    return any(
        (isinstance(d, ast.Name) and d.id in ("property", "cached_property"))
        or (isinstance(d, ast.Attribute) and d.attr == "cached_property")
        for d in node.decorator_list
    )


# -- the walk -----------------------------------------------------------------------------------------------------
@dataclass
class Visit:
    module: str
    function: str

    def __str__(self) -> str:
        return f"{self.module}  {self.function}"


class Walk:
    """A depth-first walk of the calls from one function; ``path`` bounds what counts as the path (see the module)."""

    def __init__(self, package: Package, *, path: bool) -> None:
        self.package = package
        self.path = path
        self.visits: list[Visit] = []
        self.calls: set[tuple[str, str, str, str]] = set()
        """(caller module, caller function, callee module, callee function) of every call followed."""
        self._seen: set[tuple[str, int]] = set()

    # -- visiting -------------------------------------------------------------------------------------------------
    def visit(
        self,
        module: str,
        qualname: str,
        node: ast.FunctionDef | ast.Lambda,
        cls: ClassInfo | None,
        caller: Visit | None = None,
        outer: dict[str, Type | None] | None = None,
        nested: dict[str, ast.FunctionDef] | None = None,
    ) -> None:
        if self.path and caller is not None and caller.module not in (START[0], module):
            return  # another module's own business: not a step of the path
        if caller is not None:
            self.calls.add((caller.module, caller.function, module, qualname))
        key = (module, id(node))
        if key in self._seen:
            return
        self._seen.add(key)
        here = Visit(module, qualname)
        self.visits.append(here)
        scope = _Scope(self, module, cls, here, dict(outer or {}), dict(nested or {}))
        scope.enter(node)

    def function(self, module: str, node: ast.FunctionDef, caller: Visit) -> None:
        self.visit(module, node.name, node, None, caller)

    def method(self, cls: ClassInfo, node: ast.FunctionDef, caller: Visit) -> None:
        self.visit(cls.module, f"{cls.name}.{node.name}", node, cls, caller)

    def construct(self, cls: ClassInfo, caller: Visit) -> None:
        for name in ("__init__", "__post_init__") if cls.is_dataclass else ("__init__",):
            found = self.package.method(cls, name)
            if found is not None:
                self.method(*found, caller)

    def call_method(self, cls: ClassInfo, name: str, caller: Visit) -> ast.FunctionDef | None:
        found = self.package.method(cls, name)
        if found is not None:
            self.method(*found, caller)
        for sub, node in self.package.overrides(found[0] if found else cls, name):
            self.method(sub, node, caller)
        return found[1] if found else None


class _Scope(ast.NodeVisitor):
    """Walks one function body in evaluation order, knowing the types of its names."""

    def __init__(
        self,
        walk: Walk,
        module: str,
        cls: ClassInfo | None,
        here: Visit,
        names: dict[str, Type | None],
        nested: dict[str, ast.FunctionDef],
    ) -> None:
        self.walk = walk
        self.package = walk.package
        self.module = module
        self.cls = cls
        self.here = here
        self.names = names
        self.nested = nested

    def enter(self, node: ast.FunctionDef | ast.Lambda) -> None:
        arguments = node.args
        for index, argument in enumerate([*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]):
            if index == 0 and self.cls is not None and argument.arg in ("self", "cls"):
                self.names[argument.arg] = Type("class", self.cls.key)
            else:
                self.names[argument.arg] = self.package.annotation(self.module, argument.annotation)
        body = node.body if isinstance(node.body, list) else [ast.Expr(node.body)]
        for statement in body:
            self._learn(statement)
        for statement in body:
            self.visit(statement)

    # -- what names hold ----------------------------------------------------------------------------------------
    def _learn(self, statement: ast.stmt) -> None:
        """Types of the names a statement binds (flow-insensitive: the first known type wins)."""
        for node in ast.walk(statement):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node is not statement:
                continue
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.nested[node.name] = node  # type: ignore[assignment]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                self._bind(node.target, self.package.annotation(self.module, node.annotation))
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    self._bind(target, self.type_of(node.value))
            elif isinstance(node, ast.For):
                iterated = self.type_of(node.iter)
                self._bind(node.target, iterated.items[0] if iterated and iterated.kind == "list" else None)
            elif isinstance(node, ast.withitem) and node.optional_vars is not None:
                self._bind(node.optional_vars, self.type_of(node.context_expr))

    def _bind(self, target: ast.expr, value: Type | None) -> None:
        if isinstance(target, ast.Name):
            if self.names.get(target.id) is None:
                self.names[target.id] = value
        elif isinstance(target, ast.Tuple):
            items = value.items if value is not None and value.kind == "tuple" else ()
            for index, element in enumerate(target.elts):
                self._bind(element, items[index] if index < len(items) else None)

    def type_of(self, expression: ast.expr) -> Type | None:
        package = self.package
        if isinstance(expression, ast.Name):
            if expression.id in self.names:
                return self.names[expression.id]
            found = package.symbol(self.module, expression.id)
            if isinstance(found, ModuleInfo):
                return Type("module", found.name)
            return None
        if isinstance(expression, ast.Attribute):
            owner = self.type_of(expression.value)
            if owner is None:
                return None
            if owner.kind == "module":
                found = package.symbol(owner.target, expression.attr)
                return Type("module", found.name) if isinstance(found, ModuleInfo) else None
            if owner.kind != "class":
                return None
            cls = package.classes[owner.target]
            method = package.method(cls, expression.attr)
            if method is not None and _is_property(method[1]):
                return package.annotation(method[0].module, method[1].returns)
            attribute = package.attribute(cls, expression.attr)
            if attribute is None:
                return None
            if attribute.value is not None:
                return _Scope(self.walk, attribute.module, cls, self.here, {}, {}).type_of(attribute.value)
            return package.annotation(attribute.module, attribute.annotation)
        if isinstance(expression, ast.Call):
            if isinstance(expression.func, ast.Attribute):
                owner = self.type_of(expression.func.value)
                if owner is not None and owner.kind == "dict":
                    if expression.func.attr in VALUE_GETTERS:
                        return owner.items[0]
                    if expression.func.attr == "values":
                        return Type("list", items=owner.items)
            target = self.resolve(expression.func)
            if isinstance(target, ClassInfo):
                return Type("class", target.key)
            if isinstance(target, tuple):
                module, node, _ = target
                return package.annotation(module, node.returns)
            return None
        if isinstance(expression, ast.BoolOp):
            for value in expression.values:
                found = self.type_of(value)
                if found is not None:
                    return found
            return None
        if isinstance(expression, ast.IfExp):
            return self.type_of(expression.body) or self.type_of(expression.orelse)
        if isinstance(expression, ast.Subscript):
            container = self.type_of(expression.value)
            if container is not None and container.kind in ("list", "dict"):
                return container.items[0]
            if container is not None and container.kind == "tuple" and isinstance(expression.slice, ast.Constant):
                index = expression.slice.value
                if isinstance(index, int) and -len(container.items) <= index < len(container.items):
                    return container.items[index]
            return None
        if isinstance(expression, (ast.List, ast.ListComp)):
            element = expression.elts[0] if isinstance(expression, ast.List) and expression.elts else None
            if isinstance(expression, ast.ListComp):
                element = expression.elt
            return Type("list", items=(self.type_of(element) if element is not None else None,))
        if isinstance(expression, ast.Await):
            return self.type_of(expression.value)
        return None

    def resolve(self, func: ast.expr) -> ClassInfo | tuple[str, ast.FunctionDef, ClassInfo | None] | None:
        """What a call's ``func`` names: a class (a constructor) or (module, function, class of a method)."""
        if isinstance(func, ast.Name):
            if func.id in self.nested:
                return (self.module, self.nested[func.id], self.cls)
            return _callable(self.package.symbol(self.module, func.id))
        owner = self.type_of(func.value) if isinstance(func, ast.Attribute) else None
        if owner is None:
            return None
        assert isinstance(func, ast.Attribute)
        if owner.kind == "module":
            return _callable(self.package.symbol(owner.target, func.attr))
        if owner.kind == "class":
            cls = self.package.classes[owner.target]
            method = self.package.method(cls, func.attr)
            if method is not None:
                return (method[0].module, method[1], cls)
        return None

    # -- walking ------------------------------------------------------------------------------------------------
    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        """A nested function runs where it is called or handed over (see visit_Call), not where it is defined."""

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        pass

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        """An exception handler is an exit of the path, not a step of it: the whole walk reads it, the path not."""
        if not self.walk.path:
            self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        """A property read runs its getter."""
        self.generic_visit(node)
        owner = self.type_of(node.value)
        if owner is None or owner.kind != "class":
            return
        cls = self.package.classes[owner.target]
        method = self.package.method(cls, node.attr)
        if method is not None and _is_property(method[1]):
            self.walk.method(method[0], method[1], self.here)

    def _nested(self, name: str) -> None:
        function = self.nested[name]
        self.walk.visit(
            self.module,
            f"{self.here.function}.<{name}>",
            function,
            self.cls,
            self.here,
            outer=self.names,
            nested=self.nested,
        )

    def visit_Call(self, node: ast.Call) -> None:
        # Python evaluates the callee's receiver, then the arguments, then calls.
        if isinstance(node.func, ast.Attribute):
            self.visit(node.func.value)
        for argument in [*node.args, *(keyword.value for keyword in node.keywords)]:
            if isinstance(argument, ast.Name) and argument.id in self.nested:
                self._nested(argument.id)  # a nested function handed over (``executor.submit(task)``) runs too
            else:
                self.visit(argument)
        target = self.resolve(node.func)
        if isinstance(node.func, ast.Name) and node.func.id in self.nested:
            self._nested(node.func.id)
        elif isinstance(target, ClassInfo):
            self.walk.construct(target, self.here)
        elif isinstance(target, tuple):
            module, function, cls = target
            if cls is None:
                self.walk.function(module, function, self.here)
            else:
                assert isinstance(node.func, ast.Attribute)
                self.walk.call_method(cls, node.func.attr, self.here)


# -- the figures --------------------------------------------------------------------------------------------------
def walk_fork_path(*, path: bool, root: Path | None = None) -> Walk:
    """The walk from :data:`START`: the path (``path=True``) or every call below it."""
    package = Package(root) if root is not None else this_package()
    module, qualname = START
    class_name, method_name = qualname.split(".")
    cls = package.modules[module].classes[class_name]
    walk = Walk(package, path=path)
    walk.visit(module, qualname, cls.methods[method_name], cls)
    return walk


@functools.lru_cache(maxsize=1)
def this_package() -> Package:
    """This checkout's package, indexed once for every walk of the module."""
    return Package()


def stays(visits: list[Visit]) -> list[tuple[str, list[str]]]:
    """Maximal runs of consecutive visits to one module: (module, functions visited there)."""
    runs: list[tuple[str, list[str]]] = []
    for visit in visits:
        if runs and runs[-1][0] == visit.module:
            runs[-1][1].append(visit.function)
        else:
            runs.append((visit.module, [visit.function]))
    return runs


def climbs(walk: Walk) -> list[tuple[str, str, str, str]]:
    """Calls from a module of a lower layer into one of a higher layer."""
    found = []
    for caller_module, caller, callee_module, callee in sorted(walk.calls):
        low, high = layer_of(caller_module), layer_of(callee_module)
        if low is not None and high is not None and high > low:
            found.append((caller_module, caller, callee_module, callee))
    return found


def describe(path: Walk, everything: Walk) -> str:
    """The path, stay by stay, and every climb of the whole walk."""
    runs = stays(path.visits)
    found = climbs(everything)
    lines = [
        f"the fork path: {len(runs)} stays in {len({m for m, _ in runs})} modules; "
        f"below it, {len(everything.visits)} functions in {len({v.module for v in everything.visits})} modules, "
        f"{len(found)} climbs"
    ]
    for index, (module, functions) in enumerate(runs, 1):
        lines.append(f"  {index:2}. {module} (layer {layer_of(module)}): {', '.join(functions)}")
    for caller_module, caller, callee_module, callee in found:
        lines.append(f"  climb: {caller_module} {caller} -> {callee_module} {callee}")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def path() -> Walk:
    return walk_fork_path(path=True)


@pytest.fixture(scope="module")
def everything() -> Walk:
    return walk_fork_path(path=False)


def test_the_fork_path_reads_top_down(path: Walk, everything: Walk) -> None:
    assert len(stays(path.visits)) <= MAX_STAYS and len(climbs(everything)) <= MAX_CLIMBS, describe(path, everything)


@pytest.mark.parametrize(
    "module",
    [
        "pytest_forkd.core.validate",
        "pytest_forkd.storage.child_plan",
        "pytest_forkd.core.pool",
        "pytest_forkd.engine.rundir",
        "pytest_forkd.engine.base",
        "pytest_forkd.storage.backend",
        "forkd_backends.diff",
        "pytest_forkd.guest.client",
        "pytest_forkd.core.vm",
    ],
)
def test_the_path_goes_down_to(path: Walk, everything: Walk, module: str) -> None:
    """The walk is not blind: the path reaches the plan, the engine, a backend, the guest agent and the VM."""
    assert module in {visit.module for visit in path.visits}, describe(path, everything)


@pytest.mark.parametrize(
    "module",
    [
        "pytest_forkd.storage.store",
        "pytest_forkd.storage.local_copy",
        "pytest_forkd.engine.network",
        "pytest_forkd.engine.memory",
        "pytest_forkd.guest.wire",
        "pytest_forkd.latency.timings",
    ],
)
def test_below_the_path_the_walk_reaches(everything: Walk, module: str) -> None:
    """The store's checks, the network, the diff backend's copy, the wire format and the timings are read too."""
    assert module in {visit.module for visit in everything.visits}


def test_the_path_leaves_out_handlers_the_walk_below_reads_them(path: Walk, everything: Walk) -> None:
    on_path = {(visit.module, visit.function) for visit in path.visits}
    below = {(visit.module, visit.function) for visit in everything.visits}
    handler_only = ("pytest_forkd.engine.base", "Machine.crash_error")  # adopt's: the guest died before it answered
    assert handler_only in below and handler_only not in on_path


def test_the_walk_counts_a_callback_as_a_climb() -> None:
    walk = Walk(this_package(), path=False)
    walk.calls = {
        ("pytest_forkd.storage.snapshot", "Snapshot.fork", "pytest_forkd.core.factory", "VMFactory.fork_snapshot"),
        ("pytest_forkd.core.factory", "VMFactory.fork_snapshot", "pytest_forkd.storage.store", "resolve_base"),
    }
    assert [c[0] for c in climbs(walk)] == ["pytest_forkd.storage.snapshot"]


def test_stays_are_runs_of_one_module() -> None:
    visits = [Visit("a", "f"), Visit("a", "g"), Visit("b", "h"), Visit("a", "i")]
    assert [(m, len(f)) for m, f in stays(visits)] == [("a", 2), ("b", 1), ("a", 1)]
