"""Fixtures shared by the unit tests that drive VMs on the fake engine (no QEMU)."""

from __future__ import annotations

from typing import Iterator

import pytest

from pytest_forkd.core.factory import VMFactory


@pytest.fixture(scope="module")
def factory() -> Iterator[VMFactory]:
    """A factory on the fake engine per test module; it kills whatever VMs the module left."""
    factory = VMFactory(engine="fake")
    yield factory
    factory.close()
