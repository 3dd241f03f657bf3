"""envd's ``filesystem.Filesystem`` Connect service, answered by each sandbox's filesystem helper.

``Stat``, ``MakeDir``, ``Move``, ``ListDir`` (with depth), ``Remove``, the
polled watchers (``CreateWatcher``, ``GetWatcherEvents``, ``RemoveWatcher``,
which the sync SDK uses) and the streamed ``WatchDir`` (the async SDK's)
are one request each to the helper running in the guest
(:mod:`pytest_forkd.guest.e2b_files`); its answers become envd's messages
(``e2b/envd/filesystem``), its errors envd's codes (NOT_FOUND,
ALREADY_EXISTS...), which the SDKs turn into FileNotFoundException and the
like. Relative paths are the user's home's, ``/home/user`` by default.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
from collections.abc import AsyncIterator
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from e2b.envd.filesystem import filesystem_connect, filesystem_pb
from protobuf import Oneof
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp

from pytest_forkd.e2b.api_errors import ApiError
from pytest_forkd.e2b.scope import CallScope, current

#: Batches of events a streamed watcher holds for a client that does not read them, before it drops new ones.
WATCH_BACKLOG = 1000

_FILE_TYPES = {
    "file": filesystem_pb.FileType.FILE,
    "dir": filesystem_pb.FileType.DIRECTORY,
    "symlink": filesystem_pb.FileType.SYMLINK,
}


def entry_info(entry: dict[str, Any]) -> filesystem_pb.EntryInfo:
    """The helper's entry as envd's ``EntryInfo``."""
    mtime = entry.get("mtime")
    return filesystem_pb.EntryInfo(
        name=str(entry.get("name", "")),
        type=_FILE_TYPES.get(str(entry.get("type")), filesystem_pb.FileType.UNSPECIFIED),
        path=str(entry.get("path", "")),
        size=int(entry.get("size", 0)),
        mode=int(entry.get("mode", 0)),
        permissions=str(entry.get("permissions", "")),
        owner=str(entry.get("owner", "")),
        group=str(entry.get("group", "")),
        modified_time=Timestamp.from_datetime(datetime.datetime.fromtimestamp(float(mtime), datetime.timezone.utc))
        if isinstance(mtime, (int, float))
        else None,
        symlink_target=entry.get("symlink_target") if isinstance(entry.get("symlink_target"), str) else None,
        metadata={str(k): str(v) for k, v in (entry.get("metadata") or {}).items()},
        is_symlink=bool(entry.get("is_symlink")),
    )


def fs_event(event: dict[str, Any]) -> filesystem_pb.FilesystemEvent:
    kind = event.get("type")
    entry = event.get("entry")
    return filesystem_pb.FilesystemEvent(
        name=str(event.get("name", "")),
        type=filesystem_pb.EventType(kind) if isinstance(kind, int) and 0 < kind <= 5 else None,
        entry=entry_info(entry) if isinstance(entry, dict) else None,
    )


async def helper_call(scope: CallScope, op: str, **fields: Any) -> dict[str, Any]:
    """One request to the sandbox's helper, as the calling user; ConnectError with envd's code on failure."""
    files = scope.sandbox.files
    if files is None:
        raise ConnectError(Code.UNAVAILABLE, f"The sandbox {scope.sandbox.id} was not found")
    try:
        return await files.call(op, user=scope.user, **fields)
    except ApiError as exc:
        raise exc.connect_error() from None


class FilesystemService(filesystem_connect.Filesystem):
    """The ``filesystem.Filesystem`` service of every sandbox (the sandbox comes from the call's scope)."""

    async def stat(
        self, request: filesystem_pb.StatRequest, ctx: RequestContext[Any, Any]
    ) -> filesystem_pb.StatResponse:
        result = await helper_call(current(), "stat", path=request.path)
        return filesystem_pb.StatResponse(entry=entry_info(result["entry"]))

    async def make_dir(
        self, request: filesystem_pb.MakeDirRequest, ctx: RequestContext[Any, Any]
    ) -> filesystem_pb.MakeDirResponse:
        result = await helper_call(current(), "mkdir", path=request.path)
        return filesystem_pb.MakeDirResponse(entry=entry_info(result["entry"]))

    async def move(
        self, request: filesystem_pb.MoveRequest, ctx: RequestContext[Any, Any]
    ) -> filesystem_pb.MoveResponse:
        result = await helper_call(current(), "move", source=request.source, destination=request.destination)
        return filesystem_pb.MoveResponse(entry=entry_info(result["entry"]))

    async def list_dir(
        self, request: filesystem_pb.ListDirRequest, ctx: RequestContext[Any, Any]
    ) -> filesystem_pb.ListDirResponse:
        result = await helper_call(current(), "list", path=request.path, depth=request.depth or 1)
        return filesystem_pb.ListDirResponse(entries=[entry_info(entry) for entry in result["entries"]])

    async def remove(
        self, request: filesystem_pb.RemoveRequest, ctx: RequestContext[Any, Any]
    ) -> filesystem_pb.RemoveResponse:
        await helper_call(current(), "remove", path=request.path)
        return filesystem_pb.RemoveResponse()

    async def create_watcher(
        self, request: filesystem_pb.CreateWatcherRequest, ctx: RequestContext[Any, Any]
    ) -> filesystem_pb.CreateWatcherResponse:
        result = await _start_watcher(current(), "watch_create", request)
        return filesystem_pb.CreateWatcherResponse(watcher_id=str(result["watcher"]))

    async def get_watcher_events(
        self, request: filesystem_pb.GetWatcherEventsRequest, ctx: RequestContext[Any, Any]
    ) -> filesystem_pb.GetWatcherEventsResponse:
        result = await helper_call(current(), "watch_events", watcher=_watcher_id(request.watcher_id))
        return filesystem_pb.GetWatcherEventsResponse(events=[fs_event(event) for event in result["events"]])

    async def remove_watcher(
        self, request: filesystem_pb.RemoveWatcherRequest, ctx: RequestContext[Any, Any]
    ) -> filesystem_pb.RemoveWatcherResponse:
        scope = current()
        await helper_call(scope, "watch_remove", watcher=_watcher_id(request.watcher_id))
        scope.sandbox.watchers = max(0, scope.sandbox.watchers - 1)
        return filesystem_pb.RemoveWatcherResponse()

    async def watch_dir(
        self, request: filesystem_pb.WatchDirRequest, ctx: RequestContext[Any, Any]
    ) -> AsyncIterator[filesystem_pb.WatchDirResponse]:
        scope = current()
        files = scope.sandbox.files
        assert files is not None
        queue: asyncio.Queue[list[dict[str, Any]]] = asyncio.Queue(WATCH_BACKLOG)
        result = await _start_watcher(scope, "watch_stream", request)
        watcher = int(result["watcher"])
        files.listen(watcher, functools.partial(_offer, queue))
        gone = asyncio.ensure_future(scope.disconnected.wait())
        try:
            yield filesystem_pb.WatchDirResponse(event=_oneof("start", filesystem_pb.WatchDirResponse.StartEvent()))
            while True:
                getting = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait(
                    {getting, gone}, timeout=scope.keepalive_s or 3600.0, return_when="FIRST_COMPLETED"
                )
                if gone in done:
                    getting.cancel()
                    return
                if not getting.done():
                    getting.cancel()
                    yield filesystem_pb.WatchDirResponse(
                        event=_oneof("keepalive", filesystem_pb.WatchDirResponse.KeepAlive())
                    )
                    continue
                for event in getting.result():
                    yield filesystem_pb.WatchDirResponse(event=_oneof("filesystem", fs_event(event)))
        finally:
            gone.cancel()
            files.unlisten(watcher)
            scope.sandbox.watchers = max(0, scope.sandbox.watchers - 1)
            try:
                await files.call("watch_remove", watcher=watcher)
            except ApiError:
                pass  # the sandbox ended: its watchers with it


def _offer(queue: asyncio.Queue[list[dict[str, Any]]], events: list[dict[str, Any]]) -> None:
    """Queue a batch of events for the stream; a client that reads none of them loses the newest past the bound."""
    try:
        queue.put_nowait(events)
    except asyncio.QueueFull:
        pass


def _oneof(field: str, value: Any) -> Any:
    """A oneof value of a WatchDirResponse (the field is checked when the message is made)."""
    return Oneof(field, value)


async def _start_watcher(
    scope: CallScope,
    method: str,
    request: filesystem_pb.CreateWatcherRequest | filesystem_pb.WatchDirRequest,
) -> dict[str, Any]:
    """Start a watcher in the guest, counted against the sandbox's limit (the count is given back if it fails)."""
    limit = scope.registry.config.limits.max_watchers
    if scope.sandbox.watchers >= limit:
        raise ConnectError(Code.RESOURCE_EXHAUSTED, f"at most {limit} directory watchers per sandbox")
    scope.sandbox.watchers += 1
    try:
        return await helper_call(
            scope, method, path=request.path, recursive=request.recursive, include_entry=request.include_entry
        )
    except BaseException:
        scope.sandbox.watchers -= 1
        raise


def _watcher_id(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConnectError(Code.NOT_FOUND, f"watcher {text!r} not found") from None
