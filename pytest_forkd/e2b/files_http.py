"""envd's plain HTTP routes: ``GET /files`` (download), ``POST /files`` (upload) and ``/health``.

Uploads are streamed from the request to the guest: an octet-stream body
(gzip-encoded or not) or a multipart body with one or more files, parsed as
it arrives by ``python-multipart``, each file passed chunk by chunk to the
guest through :meth:`VM.write_stream <pytest_forkd.core.vm.VM.write_stream>`,
so the server holds one chunk at a time, never a whole file. Each file's
parent directories are made first and the file is given to the calling user
after (the filesystem helper), as envd does; a file is replaced atomically,
and an upload cut short (a client that went away, a file past the size
limit) leaves the old contents. Downloads read the file from the guest,
bounded by :attr:`Limits.max_download`. The caller is checked by the gate
(:mod:`pytest_forkd.e2b.app`): the sandbox's token, or the URL's signature.
"""

from __future__ import annotations

import asyncio
import posixpath
import zlib
from collections.abc import AsyncIterator
from typing import Any

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pytest_forkd.e2b.api_errors import ApiError, as_api_error
from pytest_forkd.e2b.scope import CallScope, current, user_home
from pytest_forkd.errors import ForkdError

METADATA_PREFIX = "x-metadata-"
#: Chunks of one upload waiting for the guest before reading the request waits too.
UPLOAD_BACKLOG = 8


def guest_path(path: str | None, user: str | None) -> str:
    """An absolute, normalised guest path: relative paths are the user's home's (envd's rule)."""
    if not path or "\0" in path:
        raise ApiError(400, "a file path is required (query parameter path=...)")
    if path == "~" or path.startswith("~/"):
        path = user_home(user) + path[1:]
    elif not path.startswith("/"):
        path = posixpath.join(user_home(user), path)
    return posixpath.normpath(path)


def call_user(request: Request, scope: CallScope) -> str | None:
    return request.query_params.get("username") or scope.user


async def check_user(scope: CallScope, user: str | None) -> None:
    """401 for a user the sandbox lacks, as envd looks up every call's user; the default user and root need no look."""
    files = scope.sandbox.files
    if user in (None, "root", scope.sandbox.template.user) or files is None:
        return
    try:
        await files.call("ping", user=user)  # the helper checks a request's user before anything else
    except ApiError as exc:
        if exc.status == 401:
            raise


async def download(request: Request) -> Response:
    scope = current()
    user = call_user(request, scope)
    await check_user(scope, user)
    path = guest_path(request.query_params.get("path"), user)
    vm = scope.sandbox.vm
    assert vm is not None
    limit = scope.registry.config.limits.max_download
    try:
        data = await vm.read_file(path, max_size=limit)
    except ForkdError as exc:
        error = as_api_error(exc, f"reading {path}", scope.sandbox.id)
        if "larger than max_size" in str(exc):
            error = ApiError(413, f"{path} is larger than {limit} bytes, the server's download limit")
        raise error from None
    name = posixpath.basename(path).replace('"', "")
    return Response(
        data,
        media_type="application/octet-stream",
        headers={"Content-Disposition": f'attachment; filename="{name}"'},
    )


async def upload(request: Request) -> Response:
    scope = current()
    user = call_user(request, scope)
    content_type, options = parse_options_header(request.headers.get("content-type", ""))
    metadata = {
        key[len(METADATA_PREFIX) :]: value
        for key, value in request.headers.items()
        if key.lower().startswith(METADATA_PREFIX)
    }
    uploader = Uploader(scope, user, metadata)
    if content_type == b"multipart/form-data":
        boundary = options.get(b"boundary")
        if not boundary:
            raise ApiError(400, "multipart upload without a boundary")
        written = await uploader.multipart(request, boundary, request.query_params.get("path"))
    else:
        path = request.query_params.get("path")
        if not path:
            raise ApiError(400, "an octet-stream upload names its file with the query parameter path=...")
        encoding = request.headers.get("content-encoding", "identity").lower()
        if encoding not in ("identity", "gzip"):
            raise ApiError(400, f"unsupported Content-Encoding {encoding!r}: identity or gzip")
        written = [await uploader.one(path, _decoded(request.stream(), encoding == "gzip"))]
    if not written:
        raise ApiError(400, "the upload held no file")
    return JSONResponse(written)


async def health(request: Request) -> Response:
    return Response(status_code=204)


async def _decoded(chunks: AsyncIterator[bytes], gzipped: bool) -> AsyncIterator[bytes]:
    if not gzipped:
        async for chunk in chunks:
            if chunk:
                yield chunk
        return
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    async for chunk in chunks:
        data = chunk
        while data:
            out = inflater.decompress(data, 1 << 20)  # bounded output per step: a small bomb stays small
            if out:
                yield out
            data = inflater.unconsumed_tail
    if not inflater.eof:
        raise ApiError(400, "the gzip-encoded upload ended before its end")


class Uploader:
    """Writes the files of one upload request into the sandbox, one after the other."""

    def __init__(self, scope: CallScope, user: str | None, metadata: dict[str, str]) -> None:
        self.scope = scope
        self.user = user
        self.metadata = metadata
        self.limit = scope.registry.config.limits.max_upload

    async def one(self, path: str, chunks: AsyncIterator[bytes]) -> dict[str, Any]:
        """Upload one file from ``chunks``; envd's ``WriteInfo`` of it."""
        files, vm = self.scope.sandbox.files, self.scope.sandbox.vm
        assert files is not None and vm is not None
        prepared = await files.call("prepare_write", path=path, user=self.user)
        destination = str(prepared["path"])
        try:
            await vm.write_stream(destination, self._bounded(chunks, destination))
        except ForkdError as exc:
            raise as_api_error(exc, f"writing {destination}", self.scope.sandbox.id) from None
        finished = await files.call(
            "finish_write",
            path=destination,
            user=self.user,
            metadata=self.metadata or None,
            existed=bool(prepared.get("existed")),
        )
        entry = finished.get("entry") or {}
        info: dict[str, Any] = {"name": posixpath.basename(destination), "type": "file", "path": destination}
        if entry.get("metadata"):
            info["metadata"] = entry["metadata"]
        return info

    async def _bounded(self, chunks: AsyncIterator[bytes], path: str) -> AsyncIterator[bytes]:
        size = 0
        async for chunk in chunks:
            size += len(chunk)
            if size > self.limit:
                raise ApiError(413, f"{path}: upload larger than {self.limit} bytes, the server's upload limit")
            yield chunk

    async def multipart(self, request: Request, boundary: bytes, query_path: str | None) -> list[dict[str, Any]]:
        """Upload every file part of a multipart body as it is parsed."""
        events: list[tuple[str, Any]] = []
        header: dict[str, bytearray] = {"field": bytearray(), "value": bytearray()}
        headers: dict[str, str] = {}

        def on_header_field(data: bytes, start: int, end: int) -> None:
            header["field"] += data[start:end]

        def on_header_value(data: bytes, start: int, end: int) -> None:
            header["value"] += data[start:end]

        def on_header_end() -> None:
            headers[header["field"].decode("latin-1").lower()] = header["value"].decode("latin-1")
            header["field"], header["value"] = bytearray(), bytearray()

        def on_headers_finished() -> None:
            events.append(("begin", dict(headers)))
            headers.clear()

        def on_part_data(data: bytes, start: int, end: int) -> None:
            events.append(("data", bytes(data[start:end])))

        parser = MultipartParser(
            boundary,
            {
                "on_header_field": on_header_field,
                "on_header_value": on_header_value,
                "on_header_end": on_header_end,
                "on_headers_finished": on_headers_finished,
                "on_part_data": on_part_data,
                "on_part_end": lambda: events.append(("end", None)),
            },
        )
        written: list[dict[str, Any]] = []
        queue: asyncio.Queue[bytes | None] | None = None
        task: asyncio.Task[dict[str, Any]] | None = None
        try:
            async for chunk in request.stream():
                try:
                    parser.write(chunk)
                except MultipartParseError as exc:
                    raise ApiError(400, f"malformed multipart upload: {exc}") from None
                pending, events[:] = list(events), []
                for kind, value in pending:
                    if kind == "begin":
                        _, options = parse_options_header(value.get("content-disposition", ""))
                        filename = options.get(b"filename")
                        if filename is None:
                            queue, task = None, None  # a form field, not a file: skipped
                            continue
                        path = query_path if query_path and not written else _part_path(filename)
                        queue = asyncio.Queue(UPLOAD_BACKLOG)
                        task = asyncio.ensure_future(self.one(path, _drained(queue)))
                    elif kind == "data" and queue is not None and value:
                        await _put(queue, value, task)
                    elif kind == "end" and queue is not None and task is not None:
                        await _put(queue, None, task)
                        written.append(await task)
                        queue, task = None, None
            parser.finalize()
        finally:
            if task is not None and not task.done():
                task.cancel()  # the request ended mid-file: that upload is dropped in the guest
                await asyncio.gather(task, return_exceptions=True)
        if task is not None:
            raise ApiError(400, "the multipart upload ended in the middle of a file")
        return written


def _part_path(filename: bytes) -> str:
    """The guest path a part's filename names (the SDK puts the whole path there)."""
    return filename.decode("utf-8", "replace").replace("%22", '"')


async def _drained(queue: asyncio.Queue[bytes | None]) -> AsyncIterator[bytes]:
    while True:
        item = await queue.get()
        if item is None:
            return
        yield item


async def _put(queue: asyncio.Queue[bytes | None], item: bytes | None, task: asyncio.Task[Any] | None) -> None:
    """Hand ``item`` to the upload task; if that task ended first (it failed), raise its error."""
    assert task is not None
    putting = asyncio.ensure_future(queue.put(item))
    done, _ = await asyncio.wait({putting, task}, return_when=asyncio.FIRST_COMPLETED)
    if putting not in done:
        putting.cancel()
        task.result()
        raise ApiError(500, "an upload ended before its data did")
