"""Test layers.

``vm``
    Needs QEMU (and the default guest image); skipped, saying why, on a host
    without QEMU.
``slow``
    No QEMU, but seconds each: whole pytest sessions run in subprocesses
    (every test using ``pytester`` is marked so) and statistics at scale.

``pytest -m "not vm"`` is the fast layer: no QEMU, the fake engine where a VM
is needed (tests/contract), and no ``slow`` test unless the expression names
``slow`` itself (``-m "not vm and slow"``) or ``FORKD_TESTS_SLOW=1`` is set.
Without ``-m`` every test runs.
"""

from __future__ import annotations

import functools
import os

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
