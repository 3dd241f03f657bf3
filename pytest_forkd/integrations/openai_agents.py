"""forkd as a sandbox provider of the OpenAI Agents SDK: a ``SandboxAgent``'s tools run in a forkd VM.

Install with ``pip install "pytest-forkd[openai-agents]"`` and pass the
client to the runner::

    from agents import Runner
    from agents.run import RunConfig
    from agents.sandbox import SandboxRunConfig
    from pytest_forkd.integrations.openai_agents import ForkdSandboxClient, ForkdSandboxClientOptions

    async with ForkdSandboxClient() as client:
        run_config = RunConfig(sandbox=SandboxRunConfig(client=client, options=ForkdSandboxClientOptions()))
        result = await Runner.run(agent, "fix the bug", run_config=run_config)

Each ``create`` hands out a fresh copy-on-write child VM of the snapshot the
options name (``base`` unless they say otherwise), or of the container image
they name (``ForkdSandboxClientOptions(image="python:3.12-slim")``, as the
SDK's Docker client takes an image), taken from a pool kept warm, so a
session starts with a fork rather than a boot. The snapshot is
built or restored once per process and (forkd.yaml, snapshot, pool) by a
:class:`~pytest_forkd.project.session.ForkdSession` that every client of the
process shares (:mod:`pytest_forkd.integrations.sessions`). Under pytest,
the ``forkd_sandbox_client`` fixture makes a client on the run's own forkd
session instead: its sessions are children of the parent VM's state.

Sessions are :class:`ForkdSandbox` objects: the SDK's ``SandboxSession`` plus
forkd's extras: ``vm``, ``checkpoint()`` and ``fork(n)``, which starts ``n``
new sessions from this one's VM as it is now (mid-run: the workspace, the
processes, everything).

Cleanup: ``delete`` (and the session's own ``aclose``/``shutdown``) kills the
VM; ``close()``/``aclose()`` of the client, or leaving ``async with``, kills
every VM the client made, and the shared sessions close with their last
client (their pooled VMs and run directories); at interpreter exit (also after
Ctrl-C) every client still open is closed, and a killed process takes its
QEMUs with it (PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import atexit
import threading
import uuid
import weakref
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from agents.sandbox.manifest import Manifest
from agents.sandbox.session.dependencies import Dependencies
from agents.sandbox.session.manager import Instrumentation
from agents.sandbox.session.sandbox_client import BaseSandboxClient, BaseSandboxClientOptions
from agents.sandbox.session.sandbox_session import SandboxSession
from agents.sandbox.session.sandbox_session_state import SandboxSessionState
from agents.sandbox.snapshot import SnapshotBase, SnapshotSpec, resolve_snapshot

from pytest_forkd.aio.offload import offload, uninterruptible
from pytest_forkd.aio.vm import AsyncCheckpoint, AsyncVM, Starting
from pytest_forkd.core.vm import VM
from pytest_forkd.integrations.openai_agents_session import (
    BACKEND_ID,
    ForkdSandboxSession,
    ForkdSandboxSessionState,
)
from pytest_forkd.integrations.sessions import SESSIONS, ImageGuest, canonical_reference, open_image_session
from pytest_forkd.project.settings import VMChoice

if TYPE_CHECKING:
    from pytest_forkd.project.session import ForkdSession

__all__ = [
    "ForkdSandbox",
    "ForkdSandboxClient",
    "ForkdSandboxClientOptions",
    "ForkdSandboxSession",
    "ForkdSandboxSessionState",
]


class ForkdSandboxClientOptions(BaseSandboxClientOptions):
    """Where a session's VM comes from.

    ``snapshot``: a named snapshot (the built-in ``base``, one declared in
    ``config``, or one in the store). ``config``: a forkd.yaml whose
    ``settings:`` and snapshots apply, as in a pytest run. ``image``: a
    container image instead of a snapshot, any reference forkd takes (a bare
    one as Docker reads it: ``python:3.12-slim``, ``REGISTRY/NAME:TAG``;
    ``docker://``, ``oci:``, ``oci-archive:``, ``docker-archive:``,
    ``dockerfile:``), pulled or built and booted once per process; its VMs
    have an outbound network, as a Docker container does, unless
    ``network_mode="none"``. ``pool``: children kept pre-restored (default:
    the settings' ``pool``, 1). Unknown names, malformed references and
    broken files fail with forkd's one-line
    :class:`~pytest_forkd.errors.ConfigError`, before anything boots; an image
    that cannot be pulled or built fails ``create`` with forkd's ImageError.
    """

    type: Literal["forkd"] = "forkd"
    snapshot: str = "base"
    config: str | None = None
    pool: int | None = None
    image: str | None = None
    network_mode: Literal["none"] | None = None

    def __init__(
        self,
        snapshot: str = "base",
        config: str | Path | None = None,
        pool: int | None = None,
        *,
        image: str | None = None,
        network_mode: Literal["none"] | None = None,
        type: Literal["forkd"] = "forkd",
    ) -> None:
        if image is not None:
            if snapshot != "base" or config is not None:
                from pytest_forkd.errors import ConfigError

                raise ConfigError(
                    "ForkdSandboxClientOptions: give image= or snapshot=/config=, not both: a VM starts from one"
                )
            image = canonical_reference(image, origin="ForkdSandboxClientOptions image")
        super().__init__(
            type=type,
            snapshot=snapshot,
            config=None if config is None else str(Path(config).absolute()),
            pool=pool,
            image=image,
            network_mode=network_mode,
        )

    @property
    def guest(self) -> ImageGuest | None:
        """The container image these options name, as the key of its warm parent (None: a snapshot)."""
        if self.image is None:
            return None
        network: Literal["none", "outbound"] = "none" if self.network_mode == "none" else "outbound"
        return ImageGuest(reference=self.image, network=network, pool=self.pool, origin="ForkdSandboxClientOptions")


class ForkdSandbox(SandboxSession):
    """The SDK session of one forkd VM (what ``ForkdSandboxClient.create`` returns), with forkd's extras."""

    _inner: ForkdSandboxSession

    def __init__(
        self,
        inner: ForkdSandboxSession,
        *,
        client: ForkdSandboxClient,
        instrumentation: Instrumentation | None = None,
        dependencies: Dependencies | None = None,
    ) -> None:
        super().__init__(inner, instrumentation=instrumentation, dependencies=dependencies)
        self._client = client

    @property
    def backend(self) -> ForkdSandboxSession:
        """The backend session (the SDK's inner session object)."""
        return self._inner

    @property
    def vm(self) -> VM:
        """The session's VM (synchronous handle): inspect or prepare the sandbox from a test."""
        return self._inner.vm

    @property
    def avm(self) -> AsyncVM:
        """The session's VM as an :class:`~pytest_forkd.aio.AsyncVM`."""
        return self._inner.avm

    def checkpoint(self, tag: str | None = None) -> Starting[AsyncCheckpoint]:
        """A checkpoint of the whole VM now; see :meth:`ForkdSandboxSession.checkpoint`."""
        return self._inner.checkpoint(tag)

    async def fork(self, n: int = 1) -> list[ForkdSandbox]:
        """``n`` new sessions whose VMs are copies of this one's as it is now; each must be deleted or closed.

        They are running (no ``start()`` needed; ``async with`` works as
        well), have the same manifest and a new session id each, and belong
        to the same client. Use it mid-run to try several continuations of
        one agent state.
        """
        return await self._client._fork_session(self._inner, n)


class ForkdSandboxClient(BaseSandboxClient[ForkdSandboxClientOptions | None]):
    """Creates Agents SDK sandbox sessions in forkd VMs (see the module docstring).

    ``forkd``: a :class:`~pytest_forkd.project.session.ForkdSession` to take
    VMs from (the pytest fixture passes the run's); without it the client
    uses the process's shared session per (forkd.yaml, snapshot, pool) its
    options name, opened on first use and closed with its last client.
    """

    backend_id = BACKEND_ID
    supports_default_options = True

    def __init__(
        self,
        *,
        forkd: ForkdSession | None = None,
        instrumentation: Instrumentation | None = None,
        dependencies: Dependencies | None = None,
    ) -> None:
        self._forkd = forkd
        self._instrumentation = instrumentation if instrumentation is not None else Instrumentation()
        self._dependencies = dependencies
        self._lock = threading.RLock()
        self._owned: dict[Hashable, ForkdSession] = {}
        """The shared sessions this client uses (one user each), by key."""
        self._vms: dict[str, VM] = {}
        """Every live VM this client made, by name: what ``resume`` reattaches to and ``close`` kills."""
        self._closed = False
        _open_clients.add(self)

    # -- where VMs come from -------------------------------------------------------------------
    def default_options(self) -> ForkdSandboxClientOptions:
        """Options used when ``create`` gets none: the run's selected snapshot with ``forkd``, else ``base``."""
        return ForkdSandboxClientOptions(snapshot=self._forkd.settings.snapshot if self._forkd else "base")

    def _session_for(
        self, snapshot: str, config: str | None, pool: int | None, guest: ImageGuest | None = None
    ) -> ForkdSession:
        """The forkd session the VMs of these options come from (blocking: it may build the snapshot)."""
        from pytest_forkd.project.session import ForkdSession

        if guest is not None:
            return self._image_session(guest)
        if self._forkd is not None and config is None and pool is None:
            self._forkd.check_snapshot_name(snapshot)
            return self._forkd
        key = (BACKEND_ID, config, snapshot, pool)
        with self._lock:
            if self._closed:
                from pytest_forkd.errors import VMError

                raise VMError("this ForkdSandboxClient is closed; make a new one")
            session = self._owned.get(key)
            if session is not None:
                return session
            # Every client of the process shares one session per configuration (one restore, one pool).
            session = self._owned[key] = SESSIONS.acquire(
                key, lambda: ForkdSession.open(snapshot=snapshot, config=config, pool=pool)
            )
            return session

    def _image_session(self, guest: ImageGuest) -> ForkdSession:
        """The process's session of a container image (shared by every client), warm: pulled or built, booted."""
        key = (BACKEND_ID, "image", guest)
        with self._lock:
            if self._closed:
                from pytest_forkd.errors import VMError

                raise VMError("this ForkdSandboxClient is closed; make a new one")
            session = self._owned.get(key)
            if session is not None:
                return session

            def opener() -> ForkdSession:
                opened = open_image_session(guest)
                try:
                    opened.snapshot  # noqa: B018 - pull or build, boot once, start the pool
                except BaseException:
                    opened.close()
                    raise
                return opened

            session = self._owned[key] = SESSIONS.acquire(key, opener)
            return session

    def _child(self, snapshot: str, config: str | None, pool: int | None, guest: ImageGuest | None = None) -> VM:
        """A fresh child VM (blocking): of the pytest parent's state, or of the named snapshot or image (pooled)."""
        session = self._session_for(snapshot, config, pool, guest)
        if session is self._forkd:
            vm = session.child(VMChoice(snapshot=snapshot, backend=session.settings.backend))
        else:
            vm = session.fork(1)[0]
        self._adopt(vm)
        return vm

    def _adopt(self, vm: VM) -> None:
        with self._lock:
            closed = self._closed
            if not closed:
                # Sessions closed through the SDK (aclose, a crash) killed their VM without delete(): forget them.
                self._vms = {name: known for name, known in self._vms.items() if not known.closed}
                self._vms[vm.name] = vm
        if closed:
            vm.close()
            from pytest_forkd.errors import VMError

            raise VMError("this ForkdSandboxClient was closed while a session was being created")

    def _release(self, vm: VM) -> None:
        with self._lock:
            self._vms.pop(vm.name, None)
        vm.close()

    async def _offload_vms(self, what: str, function: Callable[[], list[VM]]) -> list[VM]:
        """Start VMs in a thread; if the awaiting task is cancelled meanwhile, they are killed when they arrive."""
        loop = asyncio.get_running_loop()
        return await offload(loop, function, name=f"forkd-agents-{what}", discard=_close_all)

    # -- the SDK's client interface ----------------------------------------------------------------
    def _wrap(self, inner: ForkdSandboxSession) -> ForkdSandbox:
        return ForkdSandbox(
            inner, client=self, instrumentation=self._instrumentation, dependencies=self._resolve_dependencies()
        )

    async def create(
        self,
        *,
        snapshot: SnapshotSpec | SnapshotBase | None = None,
        manifest: Manifest | None = None,
        options: ForkdSandboxClientOptions | None = None,
    ) -> SandboxSession:
        """A session in a fresh child VM; ``start()`` it (or ``async with``) to apply the manifest."""
        resolved = options if options is not None else self.default_options()
        manifest = manifest if manifest is not None else Manifest()
        self._validate_manifest_for_create(manifest)
        vms = await self._offload_vms(
            "create", lambda: [self._child(resolved.snapshot, resolved.config, resolved.pool, resolved.guest)]
        )
        vm = vms[0]
        session_id = uuid.uuid4()
        state = ForkdSandboxSessionState(
            session_id=session_id,
            manifest=manifest,
            snapshot=resolve_snapshot(snapshot, str(session_id)),
            forkd_snapshot=resolved.snapshot,
            forkd_config=resolved.config,
            forkd_pool=resolved.pool,
            forkd_image=resolved.image,
            forkd_network_mode=resolved.network_mode,
        )
        return self._wrap(ForkdSandboxSession(state=state, vm=vm))

    async def delete(self, session: SandboxSession) -> SandboxSession:
        """Kill the session's VM (idempotent)."""
        inner = session._inner
        if not isinstance(inner, ForkdSandboxSession):
            raise TypeError("ForkdSandboxClient.delete expects a session it created (a ForkdSandboxSession)")
        try:
            await inner.pty_terminate_all()
        finally:
            vm = inner.vm
            await uninterruptible(
                offload(asyncio.get_running_loop(), lambda: self._release(vm), name="forkd-agents-delete")
            )
        return session

    async def resume(self, state: SandboxSessionState) -> SandboxSession:
        """Reattach to the state's VM if this client still has it running; else a fresh child, restored on start.

        A fresh child gets the workspace back from ``state.snapshot`` (what
        ``stop()``/``aclose()`` persisted, e.g. with a ``LocalSnapshotSpec``)
        when the SDK starts the session; with nothing persisted, the manifest
        is applied anew.
        """
        if not isinstance(state, ForkdSandboxSessionState):
            raise TypeError("ForkdSandboxClient.resume expects a ForkdSandboxSessionState")
        state.assert_path_grants_rebound()
        with self._lock:
            live = self._vms.get(state.vm_name or "")
        if live is not None and not live.closed:
            inner = ForkdSandboxSession(state=state, vm=live)
            inner._root_ready = state.workspace_root_ready
            inner._set_start_state_preserved(True)
            return self._wrap(inner)
        options = ForkdSandboxClientOptions(
            state.forkd_snapshot,
            state.forkd_config,
            state.forkd_pool,
            image=state.forkd_image,
            network_mode=state.forkd_network_mode,
        )
        vms = await self._offload_vms(
            "resume", lambda: [self._child(options.snapshot, options.config, options.pool, options.guest)]
        )
        state.workspace_root_ready = False
        inner = ForkdSandboxSession(state=state, vm=vms[0])
        inner._set_start_state_preserved(False)
        return self._wrap(inner)

    def deserialize_session_state(self, payload: dict[str, object]) -> SandboxSessionState:
        return self._deserialize_session_state_payload(payload, ForkdSandboxSessionState)

    # -- forkd's extras -----------------------------------------------------------------------------
    async def _fork_session(self, inner: ForkdSandboxSession, n: int) -> list[ForkdSandbox]:
        source = inner.vm

        def fork() -> list[VM]:
            children = source.fork(n)
            try:
                for child in children:
                    self._adopt(child)
            except BaseException:
                _close_all(children)
                raise
            return children

        children = await self._offload_vms("fork", fork)
        sessions = []
        for child in children:
            session_id = uuid.uuid4()
            old = inner.state.snapshot
            snapshot = old.model_copy(update={"id": str(session_id)}) if "id" in type(old).model_fields else old
            state = inner.state.model_copy(
                update={"session_id": session_id, "snapshot": snapshot, "workspace_root_ready": True}, deep=True
            )
            forked = ForkdSandboxSession(state=state, vm=child, started=True)
            forked._set_start_state_preserved(True)
            sessions.append(self._wrap(forked))
        return sessions

    @property
    def vms(self) -> list[VM]:
        """The live VMs of this client's sessions."""
        with self._lock:
            return [vm for vm in self._vms.values() if not vm.closed]

    def close(self) -> None:
        """Kill every VM this client made; each shared forkd session it used closes with its last client.

        Closing a session kills its pooled VMs and removes its run directory.
        """
        with self._lock:
            self._closed = True
            vms, self._vms = list(self._vms.values()), {}
            owned, self._owned = list(self._owned), {}
        _close_all(vms)
        for key in owned:
            SESSIONS.release(key)  # the last user of a shared session closes it
        _open_clients.discard(self)

    async def aclose(self) -> None:
        """:meth:`close` without blocking the event loop."""
        await uninterruptible(offload(asyncio.get_running_loop(), self.close, name="forkd-agents-close"))

    async def __aenter__(self) -> ForkdSandboxClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def _close_all(vms: list[VM]) -> None:
    for vm in vms:
        vm.close()


_open_clients: weakref.WeakSet[ForkdSandboxClient] = weakref.WeakSet()


@atexit.register
def _close_open_clients() -> None:
    """At interpreter exit (a normal end, or Ctrl-C), kill what clients nobody closed still hold."""
    for client in list(_open_clients):
        client.close()
