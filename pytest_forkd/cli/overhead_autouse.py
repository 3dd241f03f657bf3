"""pytest plugin (``-p pytest_forkd.cli.overhead_autouse``): every test gets a ``forkd_vm`` and uses it.

Loaded by ``forkd bench --external-suite`` into a suite that knows nothing of
forkd, so each of its tests pays the fixture like an agent test would: a
fresh child, one command run in it (``$FORKD_BENCH_COMMAND``, default
``true``) before the test body, the child killed after the test.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _forkd_every_test(forkd_vm: object) -> Iterator[None]:
    forkd_vm.exec(["/bin/sh", "-c", os.environ.get("FORKD_BENCH_COMMAND", "true")], check=True)  # type: ignore[attr-defined]
    yield
