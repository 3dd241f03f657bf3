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
Without ``-m`` every test runs.
"""

from __future__ import annotations

import fcntl
import functools
import os
from collections.abc import Iterator
from contextlib import ExitStack

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
