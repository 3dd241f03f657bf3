"""The host side of the filesystem helper (:mod:`pytest_forkd.guest.e2b_files`) of one sandbox.

A template's VM starts the helper once, as root (:func:`start_helper`), so
that it can give the files it makes to the calling user as envd does; its children
have it running from their first instant, so a sandbox only attaches to it
(``vm.process(pid)``). Should it be missing (an image without the memory
snapshot's processes, or a helper that died), the sandbox starts its own.
Requests go to its stdin one line each; a reader thread takes its stdout
lines and resolves each request's future in the server's event loop, or
hands watch events to the streams that asked for them. Replies are matched
by id, and the ids are random per attachment, so a reply left unread in a
template's snapshot is never taken for one of a child's.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pytest_forkd.e2b.api_errors import ApiError
from pytest_forkd.errors import CommandNotFound, ForkdError, NoSuchProcess, ProcessError, VMError
from pytest_forkd.guest import e2b_files_program

if TYPE_CHECKING:
    from pytest_forkd.core.process import GuestProcess
    from pytest_forkd.core.vm import VM

#: Seconds a freshly started helper may take to say it is ready (a first Python start under TCG).
START_TIMEOUT_S = 120.0
#: Longest reply line the host assembles (a directory listing of many entries).
MAX_REPLY_BYTES = 64 << 20
#: The status of each error code of the helper, as the SDKs expect them for files.
_STATUS = {
    "not_found": 404,
    "exists": 409,
    "invalid": 400,
    "permission": 403,
    "no_space": 507,
    "unknown_user": 401,  # envd: UNAUTHENTICATED, "invalid username"
    "internal": 500,
}


def helper_source() -> str:
    return e2b_files_program().read_text(encoding="utf-8")


def helper_command() -> list[str]:
    """The helper's argv: its source on the command line, so nothing has to be written into the guest first."""
    return ["python3", "-u", "-c", helper_source()]


def start_helper(vm: VM) -> int:
    """Start the helper in ``vm`` and wait until it is ready; its pid. Blocking."""
    try:
        process = vm.spawn(helper_command(), cwd="/", user="0")  # root whatever the image's own user is
    except CommandNotFound:
        raise ApiError(
            501,
            "the filesystem API needs python3 in the sandbox's image, and this template's image has none; "
            "files can still be read and written (files.read/files.write) and commands run",
        ) from None
    line = process.stdout.readline(timeout=START_TIMEOUT_S)
    try:
        ready = json.loads(line)
    except ValueError:
        ready = None
    if not isinstance(ready, dict) or not ready.get("ready"):
        process.kill(9)
        raise VMError(
            f"the filesystem helper did not start in VM {vm.name}: it printed {line[:300]!r}; "
            f"stderr: {process.stderr.read_chunk(timeout=1)[:300]!r}"
        )
    return process.pid


class FilesHelper:
    """One sandbox's filesystem helper: ``await helper.call("stat", path=...)``."""

    def __init__(self, vm: VM, pid: int | None, loop: asyncio.AbstractEventLoop) -> None:
        self._vm = vm
        self._loop = loop
        self._pid = pid
        self._process: GuestProcess | None = None
        self._ids = itertools.count(secrets.randbits(40))
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._watch_listeners: dict[int, Callable[[list[dict[str, Any]]], None]] = {}
        self._ready = asyncio.Lock()
        self._writing = asyncio.Lock()
        self._closed: str | None = None

    @property
    def pid(self) -> int | None:
        return self._pid

    async def _attach(self) -> GuestProcess:
        async with self._ready:
            if self._closed is not None:
                raise ApiError(502, self._closed)
            if self._process is not None:
                return self._process
            process = await asyncio.to_thread(self._attach_blocking)
            self._process = process
            self._pid = process.pid
            threading.Thread(target=self._read, args=(process,), name=f"e2b-files-{self._vm.name}", daemon=True).start()
            return process

    def _attach_blocking(self) -> GuestProcess:
        if self._pid is not None:
            try:
                return self._vm.process(self._pid)
            except (NoSuchProcess, ProcessError):
                pass  # not in this guest (a fresh image, or it died): start one
        pid = start_helper(self._vm)
        return self._vm.process(pid)

    async def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """Run one operation in the guest; ApiError with the status the helper's error code maps to."""
        process = await self._attach()
        number = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        self._pending[number] = future
        line = json.dumps({"id": number, "op": op, **{k: v for k, v in fields.items() if v is not None}}) + "\n"
        try:
            async with self._writing:
                await asyncio.to_thread(process.write_stdin, line.encode())
            return await future
        except ForkdError as exc:
            raise ApiError(502, f"the sandbox's filesystem helper is gone ({exc})") from None
        finally:
            self._pending.pop(number, None)

    def listen(self, watcher: int, listener: Callable[[list[dict[str, Any]]], None]) -> None:
        """Call ``listener`` (in the loop) with each batch of events the streaming watcher ``watcher`` pushes."""
        self._watch_listeners[watcher] = listener

    def unlisten(self, watcher: int) -> None:
        self._watch_listeners.pop(watcher, None)

    def close(self, reason: str) -> None:
        """Fail what waits (the VM ended); the reader thread ends with the VM's stream."""
        self._closed = reason
        for future in list(self._pending.values()):
            if not future.done():
                future.set_exception(ApiError(502, reason))
        self._pending.clear()

    # -- the reader thread -------------------------------------------------------------------------------
    def _read(self, process: GuestProcess) -> None:
        buffer = bytearray()
        try:
            while True:
                piece = process.stdout.readline()
                if not piece:
                    break
                buffer += piece
                if len(buffer) > MAX_REPLY_BYTES:
                    buffer.clear()  # a reply past the bound: dropped, its request fails below
                    self._loop.call_soon_threadsafe(self._fail_all, "a reply of the filesystem helper was too large")
                    continue
                if not buffer.endswith(b"\n"):
                    continue
                line, buffer = bytes(buffer), bytearray()
                try:
                    message = json.loads(line)
                except ValueError:
                    continue
                if isinstance(message, dict):
                    self._loop.call_soon_threadsafe(self._deliver, message)
        except ForkdError:
            pass  # the VM was closed or restored: close() says why to whoever waits
        except RuntimeError:
            return  # the event loop is closed: the server has stopped
        try:
            self._loop.call_soon_threadsafe(self._fail_all, "the sandbox's filesystem helper ended")
        except RuntimeError:
            pass

    def _deliver(self, message: dict[str, Any]) -> None:
        if "watch" in message:
            listener = self._watch_listeners.get(message["watch"])
            events = message.get("events")
            if listener is not None and isinstance(events, list):
                listener(events)
            return
        future = self._pending.get(message.get("id"))  # type: ignore[arg-type]
        if future is None or future.done():
            return
        error = message.get("error")
        if isinstance(error, dict):
            status = _STATUS.get(str(error.get("code")), 500)
            future.set_exception(ApiError(status, str(error.get("message"))))
        else:
            result = message.get("result")
            future.set_result(result if isinstance(result, dict) else {})

    def _fail_all(self, reason: str) -> None:
        self._process = None
        for future in list(self._pending.values()):
            if not future.done():
                future.set_exception(ApiError(502, reason))
