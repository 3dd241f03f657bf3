"""The ASGI application: one URL for the sandbox API and every sandbox's in-sandbox API, routed by header.

With ``E2B_SANDBOX_URL`` set, the SDKs send every in-sandbox call to that one
URL with ``E2b-Sandbox-Id`` and ``E2b-Sandbox-Port`` (49983: envd, 49999: the
code interpreter); calls without them are the sandbox API. So this gate:

- for the sandbox API, checks the API key (``X-API-Key``) and hands the call
  to the REST routes (:mod:`pytest_forkd.e2b.rest_api`); a path they do not
  serve answers 501 naming it;
- for an in-sandbox call, finds the sandbox (resuming it first if it is
  paused with auto-resume; 502 "was not found" when it is gone, as E2B's
  proxy answers), checks the token the call carries (envd's access token,
  the interpreter's traffic token, or a file URL's signature), reads the
  calling user, and hands the call to envd's Connect services, its file
  routes, or the code interpreter's routes, with the call's
  :class:`~pytest_forkd.e2b.scope.CallScope` set.

It also notices a client that goes away (so a stream ends at once) and never
lets a failure out as a traceback. The ``E2B_DEBUG`` ports run the same
application in a fixed role: the API on 3000, envd on 49983 and the
interpreter on 49999, for the one sandbox the SDK's debug mode talks to.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

from connectrpc.errors import ConnectError
from e2b.envd.filesystem.filesystem_connect import FilesystemASGIApplication
from e2b.envd.process.process_connect import ProcessASGIApplication
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, Router

from pytest_forkd.e2b import files_http, interpreter_routes
from pytest_forkd.e2b.api_errors import ApiError, as_api_error, guarded_route, sandbox_gone
from pytest_forkd.e2b.auth import (
    ACCESS_TOKEN_HEADER,
    TRAFFIC_TOKEN_HEADER,
    check_api_key,
    same,
    signature_valid,
    user_of,
)
from pytest_forkd.e2b.config import ENVD_PORT, INTERPRETER_PORT
from pytest_forkd.e2b.envd_filesystem import FilesystemService
from pytest_forkd.e2b.envd_process import ProcessService, rpc_error
from pytest_forkd.e2b.registry import DEBUG_SANDBOX_ID, SandboxRegistry
from pytest_forkd.e2b.rest_api import SandboxApi
from pytest_forkd.e2b.sandbox import Sandbox
from pytest_forkd.e2b.scope import CURRENT, CallScope

log = logging.getLogger("pytest_forkd.e2b")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class Role(enum.Enum):
    """What one listening socket serves."""

    ALL = "all"  # the URL forkd e2b serve prints: the API, and in-sandbox calls by header
    DEBUG_API = "debug-api"  # localhost:3000
    DEBUG_ENVD = "debug-envd"  # localhost:49983
    DEBUG_INTERPRETER = "debug-interpreter"  # localhost:49999


class ConnectErrors:
    """Connect interceptor: whatever a service raises reaches the client as envd's error, never as a 500 trace."""

    async def intercept_unary(self, call_next: Any, request: Any, ctx: Any, /) -> Any:
        try:
            return await call_next(request, ctx)
        except Exception as exc:  # noqa: BLE001
            raise _rpc_error(exc, ctx) from None

    async def intercept_client_stream(self, call_next: Any, request: Any, ctx: Any, /) -> Any:
        try:
            return await call_next(request, ctx)
        except Exception as exc:  # noqa: BLE001
            raise _rpc_error(exc, ctx) from None

    async def intercept_server_stream(self, call_next: Any, request: Any, ctx: Any, /) -> AsyncIterator[Any]:
        try:
            async for item in call_next(request, ctx):
                yield item
        except Exception as exc:  # noqa: BLE001
            raise _rpc_error(exc, ctx) from None


def _rpc_error(exc: BaseException, ctx: Any) -> ConnectError:
    scope = CURRENT.get(None)
    return rpc_error(exc, f"{ctx.method.service_name}/{ctx.method.name}", scope.sandbox.id if scope else None)


async def _not_served(request: Request) -> Response:
    raise ApiError(
        501,
        f"{request.method} {request.url.path} is not served by forkd's E2B-compatible server "
        "(it serves sandboxes, commands, files, snapshots and the code interpreter; not template builds, "
        "volumes, secrets, logs or live network changes)",
    )


class E2BApp:
    """The ASGI application of one server over ``registry``, in one :class:`Role`."""

    def __init__(self, registry: SandboxRegistry, role: Role = Role.ALL) -> None:
        self.registry = registry
        self.role = role
        limits = registry.config.limits
        any_method = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
        rest = SandboxApi(registry).router()
        rest.routes.append(guarded_route("/{path:path}", _not_served, any_method))
        self._rest = rest
        interceptors = [ConnectErrors()]
        self._process = ProcessASGIApplication(
            ProcessService(), interceptors=interceptors, read_max_bytes=limits.max_rpc_message
        )
        self._filesystem = FilesystemASGIApplication(
            FilesystemService(), interceptors=interceptors, read_max_bytes=limits.max_rpc_message
        )
        self._envd_http = Router(
            routes=[
                guarded_route("/files", files_http.download, ["GET"]),
                guarded_route("/files", files_http.upload, ["POST"]),
                guarded_route("/health", files_http.health, ["GET"]),
                Route("/{path:path}", _not_served, methods=any_method),
            ]
        )
        interpreter = interpreter_routes.router()
        interpreter.routes.append(guarded_route("/{path:path}", _not_served, any_method))
        self._interpreter = interpreter
        self.streams = 0
        """In-sandbox calls being served now (a test checks that a client killed mid-stream leaves none)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            await send({"type": "websocket.close", "code": 1008})
            return
        headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}
        tracker = _Tracker(receive, send)
        try:
            port = self._port(headers)
            if port is None and scope["path"] == "/files" and b"signature=" in scope.get("query_string", b""):
                port = ENVD_PORT  # a signed file URL, used without the SDK's headers
            if port is None:
                check_api_key(headers, self.registry.config.api_key)
                await self._rest(scope, tracker.receive, tracker.send)
            else:
                await self._in_sandbox(scope, tracker, headers, port)
        except Exception as exc:  # noqa: BLE001 - the boundary: an answer, never a traceback
            if tracker.started or tracker.disconnected.is_set():
                if not isinstance(exc, (ApiError, ConnectError)):
                    log.warning("serving %s %s failed mid-answer: %s", scope["method"], scope["path"], exc)
                return
            await as_api_error(exc, f"{scope['method']} {scope['path']}").response()(scope, receive, send)

    def _port(self, headers: dict[str, str]) -> int | None:
        if self.role == Role.DEBUG_API:
            return None
        if self.role == Role.DEBUG_ENVD:
            return ENVD_PORT
        if self.role == Role.DEBUG_INTERPRETER:
            return INTERPRETER_PORT
        value = headers.get("e2b-sandbox-port")
        if value is None:
            return None
        try:
            return int(value)
        except ValueError:
            raise ApiError(400, f"E2b-Sandbox-Port must be a port number, got {value!r}") from None

    async def _in_sandbox(self, scope: Scope, tracker: _Tracker, headers: dict[str, str], port: int) -> None:
        query = dict(urllib.parse.parse_qsl(scope.get("query_string", b"").decode("latin-1")))
        sandbox_id = headers.get("e2b-sandbox-id") or self._signed_sandbox(scope, query)
        if not sandbox_id:
            raise ApiError(400, "in-sandbox call without an E2b-Sandbox-Id header (set E2B_SANDBOX_URL as printed)")
        if port not in (ENVD_PORT, INTERPRETER_PORT):
            raise sandbox_gone(
                sandbox_id,
                f"port {port} is not open: forkd serves envd ({ENVD_PORT}) and the code interpreter "
                f"({INTERPRETER_PORT}), not other ports of a sandbox",
            )
        sandbox = await self.registry.running(sandbox_id)
        self._authorize(sandbox, scope, headers, query, port)
        keepalive = headers.get("keepalive-ping-interval")
        call = CallScope(
            sandbox=sandbox,
            user=user_of(headers) or sandbox.template.user,  # none named: envd's default user
            disconnected=tracker.disconnected,
            registry=self.registry,
            keepalive_s=_seconds(keepalive),
        )
        token = CURRENT.set(call)
        self.streams += 1
        try:
            await self._target(scope["path"], port)(scope, tracker.receive, tracker.send)
        finally:
            self.streams -= 1
            CURRENT.reset(token)

    def _target(self, path: str, port: int) -> ASGIApp:
        if port == INTERPRETER_PORT:
            return self._interpreter
        if path.startswith("/process.Process/"):
            return self._process
        if path.startswith("/filesystem.Filesystem/"):
            return self._filesystem
        return self._envd_http

    def _signed_sandbox(self, scope: Scope, query: dict[str, str]) -> str | None:
        """The sandbox a signed file URL belongs to (a URL used without the SDK carries no header)."""
        if not _is_signed_file_url(scope, query):
            return None
        for sandbox in list(self.registry.sandboxes.values()):
            if _signed_for(sandbox, scope, query):
                return sandbox.id
        raise ApiError(401, BAD_SIGNATURE)

    def _authorize(
        self, sandbox: Sandbox, scope: Scope, headers: dict[str, str], query: dict[str, str], port: int
    ) -> None:
        if sandbox.id == DEBUG_SANDBOX_ID and self.role != Role.ALL:
            return  # the SDK's debug mode sends no token: its sandbox is served on loopback ports only
        token = headers.get(ACCESS_TOKEN_HEADER)
        if port == INTERPRETER_PORT:
            traffic = headers.get(TRAFFIC_TOKEN_HEADER)
            if same(traffic, sandbox.traffic_token) or same(token, sandbox.envd_token):
                return
            raise ApiError(401 if traffic is None and token is None else 403, "missing or wrong traffic access token")
        if token is not None:
            if same(token, sandbox.envd_token):
                return
            raise ApiError(401, f"wrong access token for sandbox {sandbox.id}")
        if _is_signed_file_url(scope, query):
            if _signed_for(sandbox, scope, query):
                return
            raise ApiError(401, BAD_SIGNATURE)
        raise ApiError(401, f"missing access token for sandbox {sandbox.id} (X-Access-Token)")


class _Tracker:
    """Watches one call's messages: whether the answer started, whether the client went away."""

    def __init__(self, receive: Receive, send: Send) -> None:
        self._receive = receive
        self._send = send
        self.started = False
        self.disconnected = asyncio.Event()

    async def receive(self) -> Message:
        message = await self._receive()
        if message["type"] == "http.disconnect":
            self.disconnected.set()
        return message

    async def send(self, message: Message) -> None:
        if self.disconnected.is_set():
            return  # nobody listens any more
        if message["type"] == "http.response.start":
            self.started = True
        try:
            await self._send(message)
        except OSError:
            self.disconnected.set()


def _seconds(value: str | None) -> float | None:
    try:
        return min(600.0, max(1.0, float(value))) if value else None
    except ValueError:
        return None


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


BAD_SIGNATURE = "the file URL's signature is not valid (or it expired)"


def _is_signed_file_url(scope: Scope, query: dict[str, str]) -> bool:
    """Whether the request is to ``/files`` with a signature (an upload or download URL the SDK made)."""
    return scope["path"] == "/files" and bool(query.get("signature"))


def _signed_for(sandbox: Sandbox, scope: Scope, query: dict[str, str]) -> bool:
    """Whether a signed file URL's signature is the one ``sandbox``'s token gives its path, user and operation."""
    return signature_valid(
        query["signature"],
        query.get("path", ""),
        "read" if scope["method"] == "GET" else "write",
        query.get("username"),
        sandbox.envd_token,
        query.get("signature_expiration"),
    )
