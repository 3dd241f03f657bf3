"""The server: uvicorn serving the E2B application on its own thread and event loop, until stopped.

``forkd e2b serve`` and the ``forkd_e2b`` fixture both run an
:class:`E2BServer` over a forkd session (the command's own, or the pytest
run's), so the sandbox API and every sandbox's in-sandbox API live beside the
code that uses them: the fixture's tests call the SDK synchronously from the
main thread while the server answers from its thread. The listening sockets
are bound before the thread starts, so the port is known at once (``--port
0``) and a port in use is a clear error. :meth:`E2BServer.stop` kills every
sandbox (and removes every snapshot) of the server before its thread ends:
nothing it started outlives it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import shlex
import socket
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from pytest_forkd.e2b.api_errors import ApiError
from pytest_forkd.e2b.app import E2BApp, Role
from pytest_forkd.e2b.config import (
    DEBUG_API_PORT,
    DEBUG_ENVD_PORT,
    DEBUG_INTERPRETER_PORT,
    DEFAULT_TEMPLATE,
    ServerConfig,
)
from pytest_forkd.e2b.registry import SandboxRegistry
from pytest_forkd.e2b.templates import SetupHook, TemplateCatalog
from pytest_forkd.errors import ConfigError, VMError

if TYPE_CHECKING:
    import uvicorn

    from pytest_forkd.aio import AsyncVM
    from pytest_forkd.core.vm import VM
    from pytest_forkd.project.session import ForkdSession

T = TypeVar("T")
log = logging.getLogger("pytest_forkd.e2b")

#: Seconds to wait for the server's thread to come up, and for it to end after stop().
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 120.0


def _bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket whose connections send each write at once (``TCP_NODELAY``).

    The protocol is named (``IPPROTO_TCP``, not 0) because asyncio sets
    ``TCP_NODELAY`` on an accepted connection only when its socket says it is
    TCP, and the option is set on the listener too (Linux passes it on). With
    Nagle's algorithm on, a response written in two parts (uvicorn writes the
    head, then the body) waits for the client's delayed ACK: 40 ms added to
    every call on a kept-alive connection, five times the cost of
    ``commands.run("true")`` itself (measured).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    address = "127.0.0.1" if host == "localhost" else host
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((address, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; pick another --port") from None
    sock.setblocking(False)
    return sock


class E2BServer:
    """An E2B-compatible server over a forkd session; ``start()`` it, ``stop()`` it (or use ``with``)."""

    def __init__(
        self,
        session: ForkdSession,
        config: ServerConfig | None = None,
        *,
        setup: Sequence[SetupHook] = (),
        prepare_guest: bool = True,
        interpreter_factory: Callable[[AsyncVM], Any] | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config or ServerConfig()
        self.session = session
        catalog = TemplateCatalog(
            session, self.config.templates, setup=setup, prepare_guest=prepare_guest, progress=progress
        )
        self.registry = SandboxRegistry(catalog, self.config, interpreter_factory=interpreter_factory)
        self.app = E2BApp(self.registry)
        self._sockets: list[tuple[socket.socket, Role]] = []
        self._servers: list[uvicorn.Server] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._stopped = False

    # -- where it listens --------------------------------------------------------------------------------
    @property
    def port(self) -> int:
        if not self._sockets:
            raise VMError("the E2B server has not been started")
        return int(self._sockets[0][0].getsockname()[1])

    @property
    def url(self) -> str:
        """The one URL of the sandbox API and of every sandbox (``E2B_API_URL``, ``E2B_SANDBOX_URL``)."""
        return f"http://{self.config.url_host}:{self.port}"

    @property
    def api_key(self) -> str:
        return self.config.api_key

    @property
    def environment(self) -> dict[str, str]:
        """What the SDKs read to use this server."""
        return {"E2B_API_URL": self.url, "E2B_SANDBOX_URL": self.url, "E2B_API_KEY": self.api_key}

    def exports(self) -> list[str]:
        """``export NAME=VALUE`` lines for a shell (``eval "$(forkd e2b serve ...)"``)."""
        return [f"export {name}={shlex.quote(value)}" for name, value in self.environment.items()]

    # -- running -------------------------------------------------------------------------------------------
    def start(self) -> E2BServer:
        """Bind the ports and serve on a thread of its own; returns once the server answers."""
        if self._thread is not None:
            return self
        self._sockets = [(_bind(self.config.host, self.config.port), Role.ALL)]
        if self.config.debug_ports:
            for port, role in (
                (DEBUG_API_PORT, Role.DEBUG_API),
                (DEBUG_ENVD_PORT, Role.DEBUG_ENVD),
                (DEBUG_INTERPRETER_PORT, Role.DEBUG_INTERPRETER),
            ):
                try:
                    self._sockets.append((_bind("127.0.0.1", port), role))
                except ConfigError as exc:
                    self._close_sockets()
                    raise ConfigError(
                        f"--debug-ports needs the SDKs' fixed ports 3000, 49983 and 49999 free on 127.0.0.1: {exc}"
                    ) from None
        self._thread = threading.Thread(target=self._run, name="forkd-e2b-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S) or self._failure is not None:
            self.stop()
            raise VMError(f"the E2B server did not start: {self._failure or 'it did not answer in time'}")
        return self

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # noqa: BLE001 - reported by start() or logged
            self._failure = exc
            self._ready.set()
            if not isinstance(exc, (KeyboardInterrupt, SystemExit)):
                log.error("the E2B server stopped on an error", exc_info=exc)

    async def _serve(self) -> None:
        import uvicorn

        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self.registry.clean_leftovers)
        for _, role in self._sockets:
            app = self.app if role == Role.ALL else E2BApp(self.registry, role)
            config = uvicorn.Config(
                app,
                lifespan="off",
                log_config=None,
                log_level="warning",
                access_log=False,
                timeout_graceful_shutdown=5,
                # h11 even where httptools is installed: its size bound below holds for every request.
                http="h11",
                h11_max_incomplete_event_size=64 * 1024,
                ws="none",
            )
            self._servers.append(uvicorn.Server(config))
        tasks = [
            asyncio.ensure_future(server.serve(sockets=[sock]))
            for server, (sock, _) in zip(self._servers, self._sockets)
        ]
        while not all(server.started for server in self._servers):
            if any(task.done() for task in tasks):
                break
            await asyncio.sleep(0.01)
        self._ready.set()
        await asyncio.gather(*tasks)

    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = 600.0) -> T:
        """Run ``coroutine`` in the server's loop from another thread and return its result."""
        if self._loop is None or self._loop.is_closed():
            coroutine.close()
            raise VMError("the E2B server is not running")
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def stop(self) -> None:
        """Kill every sandbox of the server, remove its snapshots, stop serving. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive() and not loop.is_closed():
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(STOP_TIMEOUT_S)
            except (concurrent.futures.TimeoutError, RuntimeError) as exc:
                log.warning("stopping the E2B server cleanly failed: %s", exc)
                for server in self._servers:
                    server.force_exit = True
        if thread is not None:
            thread.join(STOP_TIMEOUT_S)
        self._close_sockets()

    async def _shutdown(self) -> None:
        # The sandboxes first (a fork's child being restored is killed once its restore ends), then the
        # listeners: once uvicorn returns, asyncio.run cancels what is left, this coroutine with it.
        try:
            await self.registry.close()
        finally:
            for server in self._servers:
                server.should_exit = True

    def _close_sockets(self) -> None:
        for sock, _ in self._sockets:
            sock.close()

    def __enter__(self) -> E2BServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def warm(self, template: str) -> None:
        """Make ``template`` ready now (built if need be, and prepared), so its first sandbox starts at once.

        ConfigError for a name or mapping that names nothing usable, VMError when making it ready failed.
        """
        try:
            self.call(_warm(self.registry, template), timeout=None)
        except ApiError as exc:
            raise (ConfigError if exc.status in (400, 404) else VMError)(exc.message) from None

    def warm_templates(self) -> None:
        """Make the default template and every ``--template`` mapping ready, as ``forkd e2b serve`` does first.

        An image's first pull, boot and preparation can take longer than the
        SDKs wait for a create call (60 s), and a mapping that names nothing
        usable is better reported when the server starts than at its first use.
        """
        for name in dict.fromkeys([DEFAULT_TEMPLATE, *self.config.templates]):
            self.warm(name)

    # -- for tests -----------------------------------------------------------------------------------------
    def sandbox_ids(self) -> list[str]:
        """Ids of the server's sandboxes, running and paused."""
        return self.call(_ids(self.registry))

    def vm(self, sandbox_id: str) -> VM:
        """The forkd VM of running sandbox ``sandbox_id`` (for assertions: files, changes(), transcript)."""
        return self.call(_vm_of(self.registry, sandbox_id))


async def _warm(registry: SandboxRegistry, template: str) -> None:
    await registry.catalog.get(template)


async def _ids(registry: SandboxRegistry) -> list[str]:
    return list(registry.sandboxes)


async def _vm_of(registry: SandboxRegistry, sandbox_id: str) -> VM:
    sandbox = registry.sandboxes.get(sandbox_id)
    if sandbox is None:
        raise VMError(f"sandbox {sandbox_id} does not exist (killed, timed out, or never made by this server)")
    try:
        await registry.started(sandbox)  # a fork's child: once it is restored
    except ApiError as exc:
        raise VMError(exc.message) from None
    vm = sandbox.sync_vm
    if vm is None:
        raise VMError(f"sandbox {sandbox_id} is {sandbox.state.value}: it has no VM until it is resumed")
    return vm
