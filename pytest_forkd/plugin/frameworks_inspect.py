"""The fixture that runs Inspect evals inside a test on the run's forkd VMs: ``forkd_inspect_sandbox``.

``forkd_inspect_sandbox`` (function)
    a sandbox spec for ``Task(sandbox=...)`` (or ``eval(..., sandbox=...)``):
    every sample of an eval run inside the test gets a child of the parent
    VM's current state (what ``forkd_vm`` would be: the selected snapshot,
    plus whatever a session fixture prepared in ``forkd_parent``), from the
    run's pool, so a suite of evals pays a fork per sample, not a boot or a
    second session. Each sample's VM is killed when the sample ends; the
    session stays the plugin's. Skipped, saying what to install, when
    Inspect is missing.

Inspect is imported when the fixture is first set up, never when pytest
loads the plugin.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from inspect_ai.util import SandboxEnvironmentSpec

    from pytest_forkd.project.session import ForkdSession

#: Why a test using ``forkd_inspect_sandbox`` is skipped on a host without Inspect.
INSPECT_MISSING = "forkd_inspect_sandbox needs Inspect (module 'inspect_ai'): pip install \"pytest-forkd[inspect]\""


@pytest.fixture
def forkd_inspect_sandbox(forkd: ForkdSession) -> Iterator[SandboxEnvironmentSpec]:
    """``("forkd", ...)`` for an Inspect task: its samples fork from this run's forkd session."""
    try:
        from pytest_forkd.integrations.inspect_sandbox import lend_session
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "inspect_ai":
            raise
        pytest.skip(INSPECT_MISSING)
    with lend_session(forkd) as spec:
        yield spec
