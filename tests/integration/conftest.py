"""Layered fixtures for tests against real QEMU: booted -> frozen base -> child.

One factory owns every VM of the test session and kills them all at the end.
A root VM is booted once and frozen into a base snapshot; tests get
copy-on-write children of it, which start in a fraction of a cold boot.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Iterator

import pytest

from pytest_forkd.core.factory import VMFactory
from pytest_forkd.core.vm import VM
from pytest_forkd.engine.qemu.host import userfaultfd_problem
from pytest_forkd.storage.snapshot import Snapshot


def needs_userfaultfd(item: pytest.Item) -> bool:
    """Tests of the uffd backend: parametrized with backend "uffd", named after it, or asking for it by name."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "backend" in params:
        return "uffd" in str(params["backend"])  # "uffd" and test variants of it
    if "uffd" in getattr(item, "originalname", item.name):
        return True
    try:
        source = inspect.getsource(item.function)  # type: ignore[attr-defined]
    except (AttributeError, OSError, TypeError):
        return False
    return 'backend="uffd"' in source or "backend='uffd'" in source


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    uffd_problem: str | None = None
    probed = False
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.vm)
            if needs_userfaultfd(item):
                if not probed:
                    uffd_problem, probed = userfaultfd_problem(), True
                if uffd_problem:
                    item.add_marker(pytest.mark.skip(reason=f"uffd backend unavailable: {uffd_problem}"))


@pytest.fixture(scope="session")
def factory() -> Iterator[VMFactory]:
    factory = VMFactory(accel=os.environ.get("PYTEST_FORKD_ACCEL", "auto"))
    yield factory
    factory.close()


@pytest.fixture(scope="session")
def base_snapshot(factory: VMFactory) -> Snapshot:
    """The default image booted once, with a marker file, frozen into a session snapshot."""
    root = factory.boot()
    root.write_file("/root/marker", b"from-base\n")
    return root.freeze("itest-base", keep_running=False)


@pytest.fixture(scope="session")
def outbound_snapshot(factory: VMFactory) -> Snapshot:
    """A root VM booted with outbound networking, frozen."""
    root = factory.boot(network="outbound")
    return root.freeze("itest-net", keep_running=False)


@pytest.fixture
def vm(base_snapshot: Snapshot) -> Iterator[VM]:
    """A fresh copy-on-write child of the base snapshot."""
    child = base_snapshot.fork(1)[0]
    yield child
    child.close()
