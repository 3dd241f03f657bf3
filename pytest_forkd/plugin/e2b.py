"""The ``forkd_e2b`` fixture: code written against E2B's SDK runs unchanged, its sandboxes forked microVMs.

One :class:`~pytest_forkd.e2b.E2BServer` per session (per xdist worker),
started the first time a test asks for it, **in-process**: uvicorn on a
thread of its own, over the run's own forkd session. In-process rather than
a ``forkd e2b serve`` subprocess because the sandboxes then are the session's
VMs: ``base`` is the session's snapshot (the parent's state, so what a
session fixture prepared in ``forkd_parent`` is in every sandbox), they come
from the session's factory and pools, their timings go to the run's table,
and a test can hold a sandbox's VM itself (``forkd_e2b.vm(id)``) to check
its files, ``changes()`` or transcript. No second process to start, find a
port for, or clean up after a crash: its VMs die with pytest's.

For each test the fixture sets ``E2B_API_URL``, ``E2B_SANDBOX_URL`` and
``E2B_API_KEY`` with monkeypatch (and clears ``E2B_DOMAIN``, ``E2B_DEBUG`` and
``E2B_ACCESS_TOKEN``, which would send the SDK elsewhere), so
``Sandbox.create()`` in the code under test reaches the server; after the
test, every sandbox and snapshot the test left is killed or deleted.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from pytest_forkd.plugin.progress import progress_printer

if TYPE_CHECKING:
    from pytest_forkd.core.vm import VM
    from pytest_forkd.e2b import E2BServer
    from pytest_forkd.project.session import ForkdSession

#: Variables that would point the SDK at another endpoint than the test's server.
REDIRECTING_VARIABLES = ("E2B_DOMAIN", "E2B_DEBUG", "E2B_ACCESS_TOKEN")


class ForkdE2B:
    """What ``forkd_e2b`` gives a test: the server's address and key, and the test's sandboxes as forkd VMs."""

    def __init__(self, server: E2BServer, before: set[str], snapshots_before: set[str]) -> None:
        self.server = server
        self._before = before
        self._snapshots_before = snapshots_before

    @property
    def url(self) -> str:
        """The one URL of the sandbox API and of every sandbox (E2B_API_URL and E2B_SANDBOX_URL)."""
        return self.server.url

    @property
    def api_key(self) -> str:
        return self.server.api_key

    @property
    def env(self) -> dict[str, str]:
        """The environment the SDKs need (set for the test already): for subprocesses, node, other SDKs."""
        return dict(self.server.environment)

    def sandbox_ids(self) -> list[str]:
        """Ids of the sandboxes this test made that still exist (running or paused)."""
        return [sandbox_id for sandbox_id in self.server.sandbox_ids() if sandbox_id not in self._before]

    @property
    def sandboxes(self) -> dict[str, VM]:
        """The running sandboxes this test made, by id, as forkd VMs."""
        found: dict[str, VM] = {}
        for sandbox_id in self.sandbox_ids():
            try:
                found[sandbox_id] = self.server.vm(sandbox_id)
            except Exception:  # noqa: BLE001 - paused, or gone meanwhile
                continue
        return found

    def vm(self, sandbox_id: str) -> VM:
        """The forkd VM of running sandbox ``sandbox_id``: ``read_file``, ``exec``, ``changes()``, ``transcript``."""
        return self.server.vm(sandbox_id)

    def cleanup(self) -> None:
        """Kill what the test left: its sandboxes (running or paused) and its snapshots."""
        self.server.call(_cleanup(self.server, self._before, self._snapshots_before))


async def _cleanup(server: E2BServer, before: set[str], snapshots_before: set[str]) -> None:
    registry = server.registry
    for sandbox_id in [sandbox_id for sandbox_id in registry.sandboxes if sandbox_id not in before]:
        try:
            await registry.kill(sandbox_id)
        except Exception:  # noqa: BLE001 - killed meanwhile (a timeout): nothing left either way
            pass
    for snapshot_id in [name for name in registry.snapshots if name not in snapshots_before]:
        registry.delete_snapshot(snapshot_id)


async def _snapshot_ids(server: E2BServer) -> set[str]:
    return set(server.registry.snapshots)


@pytest.fixture(scope="session")
def _forkd_e2b_server(forkd: ForkdSession, pytestconfig: pytest.Config) -> Iterator[E2BServer]:
    try:
        import e2b.envd.process.process_connect  # noqa: F401 - the SDK's message types the server speaks
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"forkd_e2b needs the e2b extra ({exc.name} is missing): pip install 'pytest-forkd[e2b]'")
    from pytest_forkd.e2b import E2BServer
    from pytest_forkd.e2b.config import DEFAULT_TEMPLATE

    server = E2BServer(forkd, progress=progress_printer(pytestconfig)).start()
    try:
        server.warm(DEFAULT_TEMPLATE)  # built and prepared now: the SDK's first create does not wait for it
        yield server
    finally:
        server.stop()


@pytest.fixture
def forkd_e2b(_forkd_e2b_server: E2BServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[ForkdE2B]:
    """An E2B-compatible server for this test: ``Sandbox.create()`` works unchanged; its sandboxes die after it."""
    server = _forkd_e2b_server
    for name in REDIRECTING_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in server.environment.items():
        monkeypatch.setenv(name, value)
    handle = ForkdE2B(server, set(server.sandbox_ids()), server.call(_snapshot_ids(server)))
    try:
        yield handle
    finally:
        handle.cleanup()
