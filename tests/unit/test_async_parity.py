"""The asyncio API mirrors the synchronous one: every public member has an async twin with the same parameters.

``AsyncVM``, ``AsyncSnapshot`` and ``AsyncCheckpoint`` are written by hand on
top of ``VM``, ``Snapshot`` and ``Checkpoint``; without this check a parameter
added to the sync method (``exec(pty=)``, ``fork(network=)``) silently never
reaches async users. Parameters are compared by name, kind and default (their
annotations differ on purpose: the async side takes and returns async handles);
a property must stay a property, with a setter if the sync one has one; a
method that blocks on the guest or the host must be a coroutine in its twin.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

import pytest

from pytest_forkd.aio import AsyncCheckpoint, AsyncSnapshot, AsyncVM
from pytest_forkd.core.checkpoint import Checkpoint
from pytest_forkd.core.vm import VM
from pytest_forkd.storage.snapshot import Snapshot

# Twins that are plain (not awaited) calls on purpose, as on the sync side: they
# read or copy what the handle already holds and never wait on the guest or the
# host. ``checkpoint`` returns an awaitable that is also an async context manager.
NOT_AWAITED = {
    (VM, "console_tail"),
    (VM, "defaults"),
    (VM, "checkpoint"),
    (Snapshot, "replace"),
    (Snapshot, "with_owner"),
    (Snapshot, "load_from"),
    (Checkpoint, "keep"),
}

PAIRS = [(VM, AsyncVM), (Snapshot, AsyncSnapshot), (Checkpoint, AsyncCheckpoint)]


def public_names(cls: type, *, methods_only: bool) -> list[str]:
    """The public class members of ``cls`` (methods, class and static methods, properties unless ``methods_only``)."""
    names = []
    for name in dir(cls):
        if name.startswith("_"):
            continue
        member = inspect.getattr_static(cls, name)
        if isinstance(member, property):
            if not methods_only:
                names.append(name)
        elif inspect.isfunction(member) or isinstance(member, (classmethod, staticmethod)):
            names.append(name)
    return names


def instance_attributes(cls: type) -> list[str]:
    """Public attributes that ``cls.__init__`` assigns to ``self`` (they are no class members)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))  # type: ignore[misc]
    return sorted(
        {
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and not node.attr.startswith("_")
        }
    )


def parameters(cls: type, name: str) -> list[tuple[str, Any, Any]]:
    """``(name, kind, default)`` of each parameter of ``cls.name``, without ``self`` or ``cls``."""
    signature = inspect.signature(getattr(cls, name))
    found = [(p.name, p.kind, p.default) for p in signature.parameters.values()]
    if found and found[0][0] == "self" and inspect.isfunction(inspect.getattr_static(cls, name)):
        found = found[1:]
    return found


def differences(sync_cls: type, async_cls: type, *, methods_only: bool = False) -> list[str]:
    """What the async class lacks or does differently from the sync one, one line each."""
    problems = []
    for name in public_names(sync_cls, methods_only=methods_only):
        sync_member = inspect.getattr_static(sync_cls, name)
        try:
            async_member = inspect.getattr_static(async_cls, name)
        except AttributeError:
            problems.append(f"{async_cls.__name__}.{name} is missing")
            continue
        where = f"{async_cls.__name__}.{name}"
        if isinstance(sync_member, property):
            if not isinstance(async_member, property):
                problems.append(f"{where} must be a property, as {sync_cls.__name__}.{name} is")
            elif (sync_member.fset is None) != (async_member.fset is None):
                problems.append(f"{where} must {'not ' if sync_member.fset is None else ''}have a setter")
            continue
        if type(sync_member) is not type(async_member):
            problems.append(f"{where} is a {type(async_member).__name__}, not a {type(sync_member).__name__}")
            continue
        sync_parameters, async_parameters = parameters(sync_cls, name), parameters(async_cls, name)
        if sync_parameters != async_parameters:
            problems.append(f"{where} takes {async_parameters}, but {sync_cls.__name__}.{name} takes {sync_parameters}")
        awaited = inspect.iscoroutinefunction(getattr(async_cls, name))
        if awaited == ((sync_cls, name) in NOT_AWAITED):
            problems.append(f"{where} must {'not ' if awaited else ''}be a coroutine function")
    return problems


def test_every_public_member_of_vm_has_an_async_twin() -> None:
    assert differences(VM, AsyncVM) == []


def test_every_instance_attribute_of_vm_reads_through_the_async_handle() -> None:
    attributes = instance_attributes(VM)
    assert {"image", "origin", "transcript", "generation"} <= set(attributes), "the walk over __init__ broke"
    missing = [name for name in attributes if not isinstance(inspect.getattr_static(AsyncVM, name, None), property)]
    assert missing == []


def test_every_public_method_of_snapshot_has_an_async_twin() -> None:
    assert differences(Snapshot, AsyncSnapshot, methods_only=True) == []


def test_every_public_method_of_checkpoint_has_an_async_twin() -> None:
    assert differences(Checkpoint, AsyncCheckpoint, methods_only=True) == []


class _Sync:
    def __init__(self) -> None:
        self.seen = 0

    @property
    def size(self) -> int:
        return 1

    @property
    def mode(self) -> str:
        return "a"

    @mode.setter
    def mode(self, value: str) -> None:
        pass

    def run(self, command: str, *, timeout: float | None = None, pty: bool = False) -> None:
        pass

    def read(self, path: str) -> bytes:
        return b""

    def gone(self) -> None:
        pass

    @classmethod
    def load(cls, path: str) -> _Sync:
        return cls()


class _Drifted:
    size = 1  # a plain attribute, not a property

    @property
    def mode(self) -> str:  # no setter
        return "a"

    async def run(self, command: str, *, timeout: float | None = 5.0) -> None:  # no pty, another default
        pass

    def read(self, path: str) -> bytes:  # blocks the event loop
        return b""

    async def load(self, path: str) -> None:  # an instance method, not a classmethod
        pass


def test_the_comparison_reports_each_kind_of_drift() -> None:
    problems = differences(_Sync, _Drifted)
    assert len(problems) == 6, problems
    assert "_Drifted.gone is missing" in problems
    assert "_Drifted.size must be a property, as _Sync.size is" in problems
    assert "_Drifted.mode must have a setter" in problems
    assert any(line.startswith("_Drifted.run takes") and "pty" in line for line in problems)
    assert "_Drifted.read must be a coroutine function" in problems
    assert "_Drifted.load is a function, not a classmethod" in problems


@pytest.mark.parametrize(("sync_cls", "async_cls"), PAIRS)
def test_the_pairs_are_compared_at_all(sync_cls: type, async_cls: type) -> None:
    """Guards the walk itself: a change that hid every member would make the parity tests pass vacuously."""
    names = public_names(sync_cls, methods_only=sync_cls is not VM)
    assert "fork" in names and len(names) >= 3
