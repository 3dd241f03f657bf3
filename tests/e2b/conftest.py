"""Fixtures of the E2B-compatible server's tests.

``fake_server``: a server whose sandboxes are VMs of the fake engine (the real
agent as a host process, see :mod:`pytest_forkd.engine.fake`), for the fast
tests of routing, authentication, limits and error mapping with the official
SDK. Its guests' commands run on the host, in the fake guest's directory:
tests give it absolute paths inside that directory (``fake_dir``), never
anything outside. The VM tests use the plugin's own ``forkd_e2b`` fixture.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pytest_forkd.core.factory import VMFactory
from pytest_forkd.e2b.config import CODE_INTERPRETER_TEMPLATE, DEFAULT_TEMPLATE, Limits, ServerConfig
from pytest_forkd.project.config import EMPTY_PROJECT
from pytest_forkd.project.session import ForkdSession
from pytest_forkd.project.settings import Settings
from pytest_forkd.storage.snapshot import Snapshot

if TYPE_CHECKING:
    from pytest_forkd.e2b.server import E2BServer

#: What the fake server allows: few sandboxes, so that the limit is reached in a test.
FAKE_LIMITS = Limits(max_sandboxes=6, max_json_body=64 * 1024, max_upload=8 << 20, max_download=8 << 20)


class FakeEngineSession(ForkdSession):
    """A forkd session on the fake engine, whose ``base`` is a frozen fake root VM (no image, no QEMU)."""

    def __init__(self, store: Path) -> None:
        super().__init__(Settings(store=store, pool=0), EMPTY_PROJECT)
        self._factory = VMFactory(engine="fake")
        root = self._factory.boot(memory_mib=64)
        self.guest_dir = Path(root.exec("pwd").stdout.strip())
        self._base = root.freeze("e2b-fake-base", keep_running=False)

    @property
    def snapshot(self) -> Snapshot:
        return self._base


@pytest.fixture(scope="module")
def fake_session() -> Iterator[FakeEngineSession]:
    with tempfile.TemporaryDirectory(prefix="forkd-e2b-fake-") as store:
        session = FakeEngineSession(Path(store))
        try:
            yield session
        finally:
            session.close()


@pytest.fixture(scope="module")
def fake_server(fake_session: FakeEngineSession) -> Iterator[E2BServer]:
    pytest.importorskip("e2b", reason="the E2B server needs the e2b extra: pip install 'pytest-forkd[e2b]'")
    from pytest_forkd.e2b.server import E2BServer

    # The code interpreter's template is the fake base too (its own image is a Debian guest to boot).
    config = ServerConfig(limits=FAKE_LIMITS, templates={CODE_INTERPRETER_TEMPLATE: DEFAULT_TEMPLATE})
    server = E2BServer(fake_session, config, prepare_guest=False).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def fake_e2b(fake_server: E2BServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[E2BServer]:
    """The fake server with the SDK's environment set; the sandboxes a test leaves are killed after it."""
    for name in ("E2B_DOMAIN", "E2B_DEBUG", "E2B_ACCESS_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in fake_server.environment.items():
        monkeypatch.setenv(name, value)
    before = set(fake_server.sandbox_ids())
    yield fake_server
    for sandbox_id in set(fake_server.sandbox_ids()) - before:
        fake_server.call(_kill(fake_server, sandbox_id))


async def _kill(server: E2BServer, sandbox_id: str) -> None:
    try:
        await server.registry.kill(sandbox_id)
    except Exception:  # noqa: BLE001 - killed meanwhile
        pass
