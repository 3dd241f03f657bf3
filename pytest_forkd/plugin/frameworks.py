"""Fixtures for agent frameworks whose sandboxes are forkd VMs (the OpenAI Agents SDK).

``forkd_sandbox_client`` (function)
    a :class:`~pytest_forkd.integrations.openai_agents.ForkdSandboxClient`
    on the run's forkd session: every session it creates is a child of the
    parent VM's current state (what ``forkd_vm`` would be), so a suite of
    ``SandboxAgent`` tests pays a fork per session, not a boot. Every session
    it made, and every session forked from those, is killed at the test's
    teardown. Skipped, saying what to install, when the SDK is missing.

The SDK is imported when the fixture is first set up, never when pytest
loads the plugin: a project that does not use the fixture does not pay for
it, nor needs the SDK installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pytest_forkd.integrations.openai_agents import ForkdSandboxClient
    from pytest_forkd.project.session import ForkdSession

#: Why a test using ``forkd_sandbox_client`` is skipped on a host without the SDK.
AGENTS_SDK_MISSING = (
    "forkd_sandbox_client needs the OpenAI Agents SDK (module 'agents'): pip install \"pytest-forkd[openai-agents]\""
)


@pytest.fixture
def forkd_sandbox_client(forkd: ForkdSession) -> Iterator[ForkdSandboxClient]:
    """An Agents SDK sandbox client whose sessions are children of the parent VM's state; all killed afterwards."""
    try:
        from pytest_forkd.integrations.openai_agents import ForkdSandboxClient
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] not in ("agents", "openai"):
            raise
        pytest.skip(AGENTS_SDK_MISSING)
    client = ForkdSandboxClient(forkd=forkd)
    yield client
    client.close()
