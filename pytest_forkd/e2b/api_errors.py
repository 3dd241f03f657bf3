"""Errors as the E2B SDKs read them: an HTTP status and ``{"code", "message"}``, or a Connect error code.

The SDKs pick their exception by status (401 AuthenticationException, 404
NotFoundException, 429 RateLimitException, 502 with "was not found" in the
message SandboxNotRunningException...) and by Connect code on the envd RPCs.
Every failure the server answers goes through :class:`ApiError`, so a client
never sees a traceback: forkd's own errors are translated by
:func:`from_forkd_error`, anything else becomes a 500 naming the exception
type (and is logged with its traceback on the server).
"""

from __future__ import annotations

import errno as errno_module
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pytest_forkd.errors import (
    AgentError,
    ConfigError,
    ExecTimeout,
    ForkdError,
    GuestCrashed,
    NoSuchProcess,
    ProcessTimeout,
    VMError,
)

log = logging.getLogger("pytest_forkd.e2b")

_CODE_OF_STATUS = {
    400: Code.INVALID_ARGUMENT,
    401: Code.UNAUTHENTICATED,
    403: Code.PERMISSION_DENIED,
    404: Code.NOT_FOUND,
    409: Code.ALREADY_EXISTS,
    413: Code.RESOURCE_EXHAUSTED,
    429: Code.RESOURCE_EXHAUSTED,
    499: Code.CANCELED,
    501: Code.UNIMPLEMENTED,
    502: Code.UNAVAILABLE,
    504: Code.DEADLINE_EXCEEDED,
    507: Code.RESOURCE_EXHAUSTED,
}


class ApiError(Exception):
    """A failure to answer with ``status`` and ``message`` (and ``code`` on a Connect RPC)."""

    def __init__(self, status: int, message: str, code: Code | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code or _CODE_OF_STATUS.get(status, Code.INTERNAL if status >= 500 else Code.UNKNOWN)

    def response(self) -> JSONResponse:
        return JSONResponse({"code": self.status, "message": self.message}, status_code=self.status)

    def connect_error(self) -> ConnectError:
        return ConnectError(self.code, self.message)


def unsupported(call: str, hint: str = "") -> ApiError:
    """The answer to a call of E2B's API this server does not serve: 501 naming it."""
    return ApiError(501, f"{call} is not served by forkd's E2B-compatible server" + (f"; {hint}" if hint else ""))


def sandbox_gone(sandbox_id: str, why: str = "") -> ApiError:
    """What E2B's proxy answers for a sandbox that is not running: 502, "was not found" (the SDKs key on it)."""
    return ApiError(502, f"The sandbox {sandbox_id} was not found" + (f" ({why})" if why else ""))


def unknown_user(user: str | None) -> ApiError:
    """envd's answer to a call as a user the sandbox does not have: 401 (AuthenticationException in the SDKs)."""
    return ApiError(401, f"invalid username: {user!r} is not a user of the sandbox (not in its /etc/passwd)")


def guest_errno(exc: BaseException) -> int | None:
    """The errno of an operating-system error in the guest (the agent reports them with one), else None."""
    value = getattr(exc, "errno", None)
    return value if isinstance(value, int) and isinstance(exc, ForkdError) else None


def from_forkd_error(exc: ForkdError, what: str, sandbox_id: str | None = None) -> ApiError:
    """The answer to a failure of forkd's while doing ``what`` (for a sandbox, when it is named)."""
    text = f"{what}: {exc}"
    number = guest_errno(exc)
    if number is not None:
        status = {
            errno_module.ENOENT: 404,
            errno_module.EEXIST: 409,
            errno_module.EISDIR: 400,
            errno_module.ENOTDIR: 400,
            errno_module.EINVAL: 400,
            errno_module.ENAMETOOLONG: 400,
            errno_module.EACCES: 403,
            errno_module.EPERM: 403,
            errno_module.ENOSPC: 507,
            errno_module.EFBIG: 507,
        }.get(number, 500)
        return ApiError(status, text)
    if isinstance(exc, NoSuchProcess):
        return ApiError(404, text)
    if isinstance(exc, (ExecTimeout, ProcessTimeout)):
        return ApiError(504, text)
    if isinstance(exc, ConfigError):
        return ApiError(400, text)
    if isinstance(exc, AgentError):  # the guest's agent answered, so the sandbox runs: it refused the request
        return ApiError(400, text)
    if isinstance(exc, (GuestCrashed, VMError)) and sandbox_id is not None:
        return sandbox_gone(sandbox_id, f"{what} failed: {exc}")
    return ApiError(500, text)


def internal(exc: BaseException, what: str) -> ApiError:
    """An unexpected exception: logged with its traceback here, one line for the client."""
    log.error("%s failed", what, exc_info=exc)
    return ApiError(500, f"{what} failed: internal error {type(exc).__name__}: {exc}")


def as_api_error(exc: BaseException, what: str, sandbox_id: str | None = None) -> ApiError:
    """Any exception as the :class:`ApiError` to answer with."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ForkdError):
        return from_forkd_error(exc, what, sandbox_id)
    return internal(exc, what)


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"code": status, "message": message}


def guarded_route(path: str, endpoint: Callable[[Request], Awaitable[Response]], methods: list[str]) -> Route:
    """A route whose every failure answers as E2B's API does (:class:`ApiError`'s JSON), never a traceback."""

    async def guarded(request: Request) -> Response:
        try:
            return await endpoint(request)
        except Exception as exc:  # noqa: BLE001 - every failure becomes an answer
            sandbox_id = request.path_params.get("sandbox_id")
            return as_api_error(exc, f"{request.method} {request.url.path}", sandbox_id).response()

    return Route(path, guarded, methods=methods)
