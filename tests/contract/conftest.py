"""Engines under contract: every test here runs on the fake engine and on QEMU.

The QEMU variant carries the ``vm`` mark and skips, saying why, where QEMU or
the default guest image is missing; the fake variant needs neither, so
``pytest -m "not vm"`` runs this whole contract in seconds.

Guest files are addressed relative to the agent's working directory (see
:func:`home`): on QEMU that is the guest's own, on the fake engine each VM's
private guest directory.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from pytest_forkd.core.factory import VMFactory
from pytest_forkd.core.vm import VM
from pytest_forkd.engine.base import make_engine
from pytest_forkd.errors import ForkdError
from pytest_forkd.storage.snapshot import Snapshot

#: Small enough to stay cheap, large enough for the default image under QEMU.
MEMORY_MIB = {"fake": 64, "qemu": 256}


def qemu_problem() -> str | None:
    """Why the QEMU variant cannot run here (QEMU missing, default image not built), or None."""
    problem = make_engine("qemu").unavailable_reason()
    if problem:
        return problem
    from pytest_forkd.image import load_image

    try:
        load_image("default")
    except ForkdError as exc:
        return f"the default guest image is not built ({exc})"
    return None


@pytest.fixture(scope="session", params=["fake", pytest.param("qemu", marks=pytest.mark.vm)])
def engine_name(request: pytest.FixtureRequest) -> str:
    if request.param == "qemu":
        problem = qemu_problem()
        if problem:
            pytest.skip(f"QEMU engine unavailable: {problem}")
    return request.param


@pytest.fixture(scope="session")
def factory(engine_name: str) -> Iterator[VMFactory]:
    factory = VMFactory(engine=engine_name, accel=os.environ.get("PYTEST_FORKD_ACCEL", "auto"))
    yield factory
    factory.close()


@pytest.fixture(scope="session")
def memory_mib(engine_name: str) -> int:
    return MEMORY_MIB[engine_name]


@pytest.fixture(scope="session")
def base(factory: VMFactory, memory_mib: int) -> Snapshot:
    """A booted VM with a marker file, frozen: the parent of the children the tests get."""
    root = factory.boot(memory_mib=memory_mib)
    root.exec(["sh", "-c", "echo from-base > marker"])
    return root.freeze("contract-base", keep_running=False)


@pytest.fixture
def vm(base: Snapshot) -> Iterator[VM]:
    (child,) = base.fork()
    yield child
    child.close()
