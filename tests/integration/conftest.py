"""Layered fixtures for tests against real QEMU: booted -> frozen base -> child.

One factory owns every VM of the test session and kills them all at the end.
A root VM is booted once and frozen into a base snapshot; tests get
copy-on-write children of it, which start in a fraction of a cold boot.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

from pytest_forkd.factory import VMFactory
from pytest_forkd.snapshot import Snapshot
from pytest_forkd.vm import VM


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.vm)


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


@pytest.fixture
def vm(base_snapshot: Snapshot) -> Iterator[VM]:
    """A fresh copy-on-write child of the base snapshot."""
    child = base_snapshot.fork(1)[0]
    yield child
    child.close()
