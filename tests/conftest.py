"""Test layers.

``vm``
    Needs QEMU (and the default guest image); skipped, saying why, on a host
    without QEMU.
``slow``
    No QEMU, but seconds each: whole pytest sessions run in subprocesses
    (every test using ``pytester`` is marked so) and statistics at scale.
``alone``
    Compares the timings of two runs it makes, so a change of load between
    them is a real regression to the gate: under pytest-xdist it runs while
    no other worker runs a test (``run_alone`` below).

``pytest -m "not vm"`` is the fast layer: no QEMU, the fake engine where a VM
is needed (tests/contract), and no ``slow`` test unless the expression names
``slow`` itself (``-m "not vm and slow"``) or ``FORKD_TESTS_SLOW=1`` is set.
Without ``-m`` every test runs. The fast layer does not even import the test
modules it would deselect whole (``fast_layer_skips``): importing them is most
of what they would cost it.
"""

from __future__ import annotations

import ast
import fcntl
import functools
import gc
import os
import re
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest


@functools.lru_cache(maxsize=1)
def qemu_problem() -> str | None:
    from pytest_forkd.engine.base import make_engine

    return make_engine("qemu").unavailable_reason()


def pytest_itemcollected(item: pytest.Item) -> None:
    if "pytester" in getattr(item, "fixturenames", ()):
        item.add_marker(pytest.mark.slow)


def _fast_layer(config: pytest.Config) -> bool:
    expression = config.option.markexpr or ""
    return "not vm" in expression and "slow" not in expression and not os.environ.get("FORKD_TESTS_SLOW")


#: Every test under tests/integration/ is marked vm (its conftest.py does it).
ALL_VM = Path(__file__).parent / "integration"
_MODULE_MARK = re.compile(r"^pytestmark\s*=.*?\bpytest\.mark\.(vm|slow)\b", re.MULTILINE | re.DOTALL)


def _marks_whole_module(value: ast.expr) -> set[str]:
    """The marker names a module-level ``pytestmark = ...`` gives every test of the module."""
    marks = value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]
    return {
        mark.attr
        for mark in marks
        if isinstance(mark, ast.Attribute)
        and isinstance(mark.value, ast.Attribute)
        and mark.value.attr == "mark"
        and isinstance(mark.value.value, ast.Name)
        and mark.value.value.id == "pytest"
    }


def fast_layer_skips(path: Path) -> bool:
    """Whether every test of the module at ``path`` is marked ``vm`` or ``slow``, as its source shows.

    The text is searched first and parsed only when it may say so (a string in
    the module can hold such a line too): most modules cost no parse.
    """
    if path.parent == ALL_VM:
        return True
    text = path.read_text()
    if not _MODULE_MARK.search(text):
        return False
    for node in ast.parse(text, str(path)).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "pytestmark" for target in node.targets
        ):
            return bool(_marks_whole_module(node.value) & {"vm", "slow"})
    return False


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if (
        collection_path.suffix == ".py"
        and collection_path.name.startswith("test_")
        and _fast_layer(config)
        and fast_layer_skips(collection_path)
    ):
        return True
    return None


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session) -> Iterator[object]:
    """Collection without full garbage collections; what it leaves is then frozen out of later ones.

    Collecting imports the test modules and everything they use (Inspect, the
    Agents SDK, pydantic...): objects that live to the end of the run. Each full
    collection scans all of them, a fifth of a second and more once they are
    loaded, and the interpreter ran one every few hundred milliseconds of
    collecting and testing: seconds per run. So collection runs with the young
    generations only, then one full collection clears what it left, and
    ``gc.freeze`` keeps the survivors out of every later one.
    """
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], 1 << 30)
    try:
        return (yield)
    finally:
        gc.set_threshold(*thresholds)
        gc.collect()
        gc.freeze()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _fast_layer(config):
        slow = [item for item in items if item.get_closest_marker("slow") is not None]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if item.get_closest_marker("slow") is None]
    for item in items:
        if item.get_closest_marker("vm") is not None and qemu_problem():
            item.add_marker(pytest.mark.skip(reason=f"needs QEMU: {qemu_problem()}"))


@pytest.fixture(autouse=True)
def run_alone(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Under pytest-xdist, tests marked ``alone`` exclude every other test of the run.

    A reader-writer lock shared by the workers (in the run's common temporary
    directory): each test holds it shared, an ``alone`` test exclusively. An
    ``alone`` test first takes the ``intent`` lock, which a test about to start
    passes through, so a worker that keeps starting tests cannot starve it.
    """
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    shared = tmp_path_factory.getbasetemp().parent
    alone = request.node.get_closest_marker("alone") is not None
    with ExitStack() as locks:
        intent = locks.enter_context(open(shared / "forkd-tests-intent.lock", "a"))
        held = locks.enter_context(open(shared / "forkd-tests-running.lock", "a"))
        fcntl.flock(intent, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(held, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(intent, fcntl.LOCK_UN)
        yield
