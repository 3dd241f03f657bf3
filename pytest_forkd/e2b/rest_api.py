"""E2B's sandbox API (REST, JSON), as the SDKs call it: paths, bodies and answers of ``e2b/api/client``.

Each route reads its JSON body within :attr:`Limits.max_json_body`, checks
every field it uses (a wrong type is a 400 naming the field), and calls the
:class:`~pytest_forkd.e2b.registry.SandboxRegistry`. Fields of E2B's
requests that ask for what forkd cannot give (volumes, MCP servers, workload
identities, network rules beyond allowing or denying all traffic, a
filesystem-only pause) answer 501 naming them; so does every other path of
E2B's API (template builds, volumes, secrets, logs, live network updates).
The API key is checked before any route runs (:mod:`pytest_forkd.e2b.app`).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import urllib.parse
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Router

from pytest_forkd.e2b.api_errors import ApiError, guarded_route, unsupported
from pytest_forkd.e2b.registry import SandboxRegistry
from pytest_forkd.e2b.sandbox import Lifecycle, Sandbox, State, iso, utc_now

ALL_TRAFFIC = "0.0.0.0/0"


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The request's JSON object (``{}`` for an empty body); 413 past ``limit`` bytes, 400 if malformed."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"request body larger than {limit} bytes")
    if not body.strip():
        return {}
    try:
        value = json.loads(body)
    except ValueError as exc:
        raise ApiError(400, f"request body is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ApiError(400, "request body must be a JSON object")
    return value


def _typed(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise ApiError(400, f"field {name!r} has the wrong type: got {type(value).__name__}")
    return value


def _strings(body: dict[str, Any], name: str) -> dict[str, str]:
    value = _typed(body, name, dict, {})
    if not all(isinstance(key, str) and isinstance(item, str) for key, item in value.items()):
        raise ApiError(400, f"field {name!r} must map strings to strings")
    return dict(value)


def _internet(body: dict[str, Any]) -> bool | None:
    """Whether the create call asks for internet access (None: it does not say), or 501 for finer rules."""
    allowed: bool | None = _typed(body, "allow_internet_access", bool)
    network = _typed(body, "network", dict)
    if network:
        served = {"allowOut", "denyOut", "allowPublicTraffic"}
        extra = sorted(set(network) - served)
        if extra:
            raise unsupported(f"network option(s) {', '.join(extra)}", "only allowing or denying all traffic is")
        allow_out, deny_out = network.get("allowOut") or [], network.get("denyOut") or []
        if any(item != ALL_TRAFFIC for item in [*allow_out, *deny_out]):
            raise unsupported(
                "network rules for single hosts or ranges", f"only allowing or denying all traffic ({ALL_TRAFFIC}) is"
            )
        if allow_out:
            allowed = True
        elif deny_out:
            allowed = False
    return allowed


class SandboxApi:
    """The routes of the sandbox API over one registry."""

    def __init__(self, registry: SandboxRegistry) -> None:
        self.registry = registry
        self.limit = registry.config.limits.max_json_body

    def router(self) -> Router:
        r = guarded_route
        return Router(
            routes=[
                r("/sandboxes", self.create, ["POST"]),
                r("/v2/sandboxes", self.create, ["POST"]),
                r("/sandboxes", self.list_v1, ["GET"]),
                r("/v2/sandboxes", self.list_v2, ["GET"]),
                r("/sandboxes/metrics", self.metrics_many, ["GET"]),
                r("/sandboxes/{sandbox_id}", self.get_info, ["GET"]),
                r("/sandboxes/{sandbox_id}", self.kill, ["DELETE"]),
                r("/sandboxes/{sandbox_id}/timeout", self.set_timeout, ["POST"]),
                r("/sandboxes/{sandbox_id}/refreshes", self.refresh, ["POST"]),
                r("/sandboxes/{sandbox_id}/pause", self.pause, ["POST"]),
                r("/sandboxes/{sandbox_id}/resume", self.resume, ["POST"]),
                r("/sandboxes/{sandbox_id}/connect", self.connect, ["POST"]),
                r("/v2/sandboxes/{sandbox_id}/connect", self.connect, ["POST"]),
                r("/sandboxes/{sandbox_id}/fork", self.fork, ["POST"]),
                r("/sandboxes/{sandbox_id}/snapshots", self.create_snapshot, ["POST"]),
                r("/sandboxes/{sandbox_id}/metrics", self.metrics, ["GET"]),
                r("/snapshots", self.list_snapshots, ["GET"]),
                r("/templates/{template_id:path}", self.delete_template, ["DELETE"]),
                r("/health", self.health, ["GET"]),
            ]
        )

    # -- create, get, list, kill ------------------------------------------------------------------------
    async def create(self, request: Request) -> Response:
        body = await read_json(request, self.limit)
        template = _typed(body, "templateID", str)
        if not template:
            raise ApiError(400, "field 'templateID' is required")
        for name, call in (("mcp", "MCP servers (mcp=)"), ("iam", "workload identities (iam=)")):
            if body.get(name):
                raise unsupported(call)
        if body.get("volumeMounts"):
            raise unsupported("volume mounts (volume_mounts=)")
        if body.get("autoPauseMemory") is False:
            raise unsupported("a filesystem-only pause (on_timeout mode='filesystem')", "pauses keep memory")
        auto_pause = _typed(body, "autoPause", bool, False)
        resume = _typed(body, "autoResume", dict, {})
        auto_resume = bool(resume.get("enabled")) if isinstance(resume, dict) else False
        sandbox = await self.registry.create(
            template,
            timeout=_typed(body, "timeout", int),
            metadata=_strings(body, "metadata"),
            envs=_strings(body, "envVars"),
            lifecycle=Lifecycle("pause" if auto_pause else "kill", auto_resume),
            internet=_internet(body),
        )
        return JSONResponse(sandbox.created(), status_code=201)

    async def get_info(self, request: Request) -> Response:
        return JSONResponse(self.registry.get(request.path_params["sandbox_id"]).detail())

    async def kill(self, request: Request) -> Response:
        await self.registry.kill(request.path_params["sandbox_id"])
        return Response(status_code=204)

    async def list_v1(self, request: Request) -> Response:
        found = self.registry.listed(states={State.RUNNING.value}, metadata=_metadata_query(request))
        return JSONResponse([sandbox.listed() for sandbox in found])

    async def list_v2(self, request: Request) -> Response:
        query = request.query_params
        states = {item for item in (query.get("state") or "").split(",") if item}
        if states - {"running", "paused"}:
            raise ApiError(400, f"state must be running and/or paused, got {query.get('state')!r}")
        order = query.get("order") or "asc"
        if order not in ("asc", "desc"):
            raise ApiError(400, f"order must be asc or desc, got {order!r}")
        started_after = None
        if query.get("startedAfter"):
            try:
                started_after = datetime.datetime.fromisoformat(query["startedAfter"].replace("Z", "+00:00"))
            except ValueError:
                raise ApiError(400, f"startedAfter is not an ISO 8601 time: {query['startedAfter']!r}") from None
            if started_after.tzinfo is None:
                started_after = started_after.astimezone()
        limit = _query_int(request, "limit", 100, 1, 1000)
        found = self.registry.listed(
            states=states or None,
            metadata=_metadata_query(request),
            started_after=started_after,
            template=query.get("template") or None,
            order=order,
        )
        chosen, token = self.registry.page(found, limit, query.get("nextToken"))
        headers = {"x-next-token": token} if token else {}
        return JSONResponse([sandbox.listed() for sandbox in chosen], headers=headers)

    # -- timeouts -----------------------------------------------------------------------------------------
    async def set_timeout(self, request: Request) -> Response:
        body = await read_json(request, self.limit)
        timeout = _typed(body, "timeout", int)
        if timeout is None:
            raise ApiError(400, "field 'timeout' is required")
        self.registry.set_timeout(request.path_params["sandbox_id"], timeout)
        return Response(status_code=204)

    async def refresh(self, request: Request) -> Response:
        body = await read_json(request, self.limit)
        sandbox = self.registry.get(request.path_params["sandbox_id"])
        self.registry.set_timeout(sandbox.id, _typed(body, "duration", int) or sandbox.timeout_s)
        return Response(status_code=204)

    # -- pause, resume, connect ---------------------------------------------------------------------------
    async def pause(self, request: Request) -> Response:
        body = await read_json(request, self.limit)
        if body.get("memory") is False:
            raise unsupported("a filesystem-only pause (mode='filesystem')", "pauses keep memory")
        paused = await self.registry.pause(request.path_params["sandbox_id"])
        if not paused:
            raise ApiError(409, f"sandbox {request.path_params['sandbox_id']} is already paused")
        return Response(status_code=204)

    async def connect(self, request: Request) -> Response:
        body = await read_json(request, self.limit)
        if body.get("memory") is False:
            raise unsupported("resuming with on_resume='reboot'", "a resume restores memory")
        sandbox, resumed = await self.registry.connect(request.path_params["sandbox_id"], _typed(body, "timeout", int))
        return JSONResponse(sandbox.created(), status_code=201 if resumed else 200)

    async def resume(self, request: Request) -> Response:
        body = await read_json(request, self.limit)
        sandbox = self.registry.get(request.path_params["sandbox_id"])
        if sandbox.state == State.RUNNING:
            raise ApiError(409, f"sandbox {sandbox.id} is already running")
        if body.get("autoPause") is not None:
            sandbox.lifecycle = Lifecycle("pause" if body["autoPause"] else "kill", sandbox.lifecycle.auto_resume)
        sandbox, _ = await self.registry.connect(sandbox.id, _typed(body, "timeout", int))
        return JSONResponse(sandbox.created(), status_code=201)

    # -- fork and snapshots -------------------------------------------------------------------------------
    async def fork(self, request: Request) -> Response:
        body = await read_json(request, self.limit)
        children = await self.registry.fork(
            request.path_params["sandbox_id"], _typed(body, "count", int), _typed(body, "timeout", int)
        )
        return JSONResponse([{"sandbox": child.created()} for child in children], status_code=201)

    async def create_snapshot(self, request: Request) -> Response:
        body = await read_json(request, self.limit)
        if body.get("memory") is False:
            raise unsupported("a filesystem-only snapshot (mode='filesystem')", "snapshots keep memory")
        entry = await self.registry.snapshot(request.path_params["sandbox_id"], _typed(body, "name", str))
        return JSONResponse({"snapshotID": entry.snapshot_id, "names": entry.names}, status_code=201)

    async def list_snapshots(self, request: Request) -> Response:
        query = request.query_params
        entries = [
            entry
            for entry in self.registry.snapshots.values()
            if (not query.get("sandboxID") or entry.source == query["sandboxID"])
            and (not query.get("name") or query["name"] in (entry.snapshot_id, *entry.names))
        ]
        limit = _query_int(request, "limit", 100, 1, 1000)
        start = 0
        if query.get("nextToken"):
            ids = [entry.snapshot_id for entry in entries]
            token = urllib.parse.unquote(query["nextToken"])
            start = ids.index(token) + 1 if token in ids else len(entries)
        chosen = entries[start : start + limit]
        more = start + limit < len(entries)
        headers = {"x-next-token": urllib.parse.quote(chosen[-1].snapshot_id)} if more and chosen else {}
        return JSONResponse([{"snapshotID": e.snapshot_id, "names": e.names} for e in chosen], headers=headers)

    async def delete_template(self, request: Request) -> Response:
        template_id = urllib.parse.unquote(request.path_params["template_id"])
        if self.registry.delete_snapshot(template_id):
            return Response(status_code=204)
        raise ApiError(
            404, f"snapshot {template_id!r} not found (templates themselves are forkd snapshots: see `forkd snapshots`)"
        )

    # -- metrics ------------------------------------------------------------------------------------------
    async def metrics(self, request: Request) -> Response:
        sandbox = self.registry.get(request.path_params["sandbox_id"])
        await self.registry.started(sandbox)
        return JSONResponse([await _metric(sandbox)] if sandbox.state == State.RUNNING else [])

    async def metrics_many(self, request: Request) -> Response:
        wanted = [item for item in (request.query_params.get("sandbox_ids") or "").split(",") if item]
        found = {
            sandbox_id: self.registry.sandboxes[sandbox_id]
            for sandbox_id in wanted
            if sandbox_id in self.registry.sandboxes and self.registry.sandboxes[sandbox_id].state == State.RUNNING
        }
        await asyncio.gather(*(self.registry.started(sandbox) for sandbox in found.values()))
        values = await asyncio.gather(*(_metric(sandbox) for sandbox in found.values()))
        return JSONResponse({"sandboxes": dict(zip(found, values))})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})


async def _metric(sandbox: Sandbox) -> dict[str, Any]:
    """``SandboxMetric`` of a running sandbox, read in its guest (one request to its filesystem helper)."""
    assert sandbox.files is not None
    values = await sandbox.files.call("metrics")
    now = utc_now()
    return {
        "timestamp": iso(now),
        "timestampUnix": int(now.timestamp()),
        "cpuCount": sandbox.vcpus,
        "cpuUsedPct": float(values.get("cpu_used_pct", 0.0)),
        "memUsed": int(values.get("mem_used", 0)),
        "memTotal": int(values.get("mem_total", sandbox.memory_mib << 20)),
        "memCache": int(values.get("mem_cache", 0)),
        "diskUsed": int(values.get("disk_used", 0)),
        "diskTotal": int(values.get("disk_total", 0)),
    }


def _metadata_query(request: Request) -> dict[str, str]:
    """The ``metadata`` filter: ``k=v&k2=v2`` url-encoded once more by the SDK."""
    raw = request.query_params.get("metadata")
    if not raw:
        return {}
    return {
        urllib.parse.unquote(key): urllib.parse.unquote(value)
        for key, value in urllib.parse.parse_qsl(raw, keep_blank_values=True)
    }


def _query_int(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(400, f"query parameter {name} must be a number, got {raw!r}") from None
    if not low <= value <= high:
        raise ApiError(400, f"query parameter {name} must be from {low} to {high}, got {value}")
    return value
