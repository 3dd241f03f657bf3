"""The code interpreter's HTTP routes (port 49999): ``/execute`` and ``/contexts``, as e2b-code-interpreter calls them.

The routes only translate: each sandbox gets one host-side interpreter,
``pytest_forkd.e2b.interpreter.CodeInterpreter(vm)``, made on its first call
(a forked or resumed sandbox makes a new one, which finds the contexts its
guest already has); ``execute`` yields E2B's JSON lines (stdout, stderr,
result, error, end...) and each becomes one line of the streamed answer. A
client that goes away closes the stream, and with it the execution's
iterator. The interpreter module is imported on first use, so the server
runs without it (those routes then answer 501).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import AsyncIterator
from types import ModuleType
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Router

from pytest_forkd.e2b.api_errors import ApiError, as_api_error, guarded_route
from pytest_forkd.e2b.rest_api import read_json
from pytest_forkd.e2b.scope import CallScope, current

INTERPRETER_MODULE = "pytest_forkd.e2b.interpreter"


def _module() -> ModuleType:
    try:
        return importlib.import_module(INTERPRETER_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != INTERPRETER_MODULE:
            raise
        raise ApiError(501, "the code interpreter is not part of this build of pytest-forkd") from None


def interpreter_of(scope: CallScope) -> Any:
    """The sandbox's interpreter, made on first use."""
    sandbox = scope.sandbox
    if sandbox.interpreter is None:
        factory = scope.registry.interpreter_factory or _module().CodeInterpreter
        if sandbox.vm is None:
            raise ApiError(502, f"The sandbox {sandbox.id} was not found")
        sandbox.interpreter = factory(sandbox.vm)
    return sandbox.interpreter


def _unknown_context(exc: BaseException) -> bool:
    try:
        return isinstance(exc, _module().UnknownContext)
    except ApiError:
        return False


async def _answer(scope: CallScope, what: str, call: Any) -> Any:
    try:
        return await call
    except Exception as exc:  # noqa: BLE001 - answered as the code interpreter would
        if _unknown_context(exc):
            raise ApiError(404, str(exc)) from None
        raise as_api_error(exc, what, scope.sandbox.id) from None


async def execute(request: Request) -> Response:
    scope = current()
    body = await read_json(request, scope.registry.config.limits.max_json_body)
    code = body.get("code")
    if not isinstance(code, str):
        raise ApiError(400, "field 'code' (a string) is required")
    env_vars = body.get("env_vars") or None
    if env_vars is not None and not (
        isinstance(env_vars, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env_vars.items())
    ):
        raise ApiError(400, "field 'env_vars' must map strings to strings")
    for name in ("context_id", "language"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise ApiError(400, f"field {name!r} must be a string")
    interpreter = interpreter_of(scope)
    lines: AsyncIterator[dict[str, Any]] = interpreter.execute(
        code, context_id=body.get("context_id"), language=body.get("language"), env_vars=env_vars
    )
    try:
        first: dict[str, Any] | None = await _answer(scope, "running code", anext(lines))
    except StopAsyncIteration:
        first = None

    async def stream() -> AsyncIterator[bytes]:
        try:
            if first is not None:
                yield (json.dumps(first) + "\n").encode()
            async for item in lines:
                yield (json.dumps(item) + "\n").encode()
        finally:
            close = getattr(lines, "aclose", None)
            if close is not None:
                await close()  # the client went away, or the execution ended: nothing runs on unseen

    return StreamingResponse(stream(), media_type="application/json")


async def create_context(request: Request) -> Response:
    scope = current()
    body = await read_json(request, scope.registry.config.limits.max_json_body)
    for name in ("language", "cwd"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise ApiError(400, f"field {name!r} must be a string")
    interpreter = interpreter_of(scope)
    context = await _answer(
        scope, "creating a context", interpreter.create_context(language=body.get("language"), cwd=body.get("cwd"))
    )
    return JSONResponse(context)


async def list_contexts(request: Request) -> Response:
    scope = current()
    return JSONResponse(await _answer(scope, "listing contexts", interpreter_of(scope).list_contexts()))


async def restart_context(request: Request) -> Response:
    scope = current()
    context_id = request.path_params["context_id"]
    await _answer(scope, f"restarting context {context_id}", interpreter_of(scope).restart_context(context_id))
    return Response(status_code=204)


async def remove_context(request: Request) -> Response:
    scope = current()
    context_id = request.path_params["context_id"]
    await _answer(scope, f"removing context {context_id}", interpreter_of(scope).remove_context(context_id))
    return Response(status_code=204)


def router() -> Router:
    return Router(
        routes=[
            guarded_route("/execute", execute, ["POST"]),
            guarded_route("/contexts", create_context, ["POST"]),
            guarded_route("/contexts", list_contexts, ["GET"]),
            guarded_route("/contexts/{context_id}/restart", restart_context, ["POST"]),
            guarded_route("/contexts/{context_id}", remove_context, ["DELETE"]),
        ]
    )
