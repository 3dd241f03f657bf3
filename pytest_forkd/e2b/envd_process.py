"""envd's ``process.Process`` Connect service, on forkd guest processes.

Served with the ``connectrpc`` runtime and the message types that ship in the
``e2b`` package (``e2b/envd/process``). ``Start`` spawns the command in the
sandbox's VM and streams its events (start with the pid, stdout/stderr or
terminal data, end with the exit code); ``Connect`` follows a running one;
``List``, ``SendInput``, ``StreamInput``, ``CloseStdin``, ``SendSignal`` and
``Update`` (a terminal's size) act on them by pid or tag. As envd does, a
stream that loses its client leaves its process running (``commands.run(...,
background=True)`` relies on that) until the timeout the stream asked for
(``Connect-Timeout-Ms``), when the process is killed; keepalive events go out
at the interval the SDK names (``Keepalive-Ping-Interval``). A command runs
as envd runs it in E2B's templates: as the call's user (``user`` unless the
call names another), with that user's ``HOME``, ``USER`` and ``LOGNAME``, in
/home/user unless it names a cwd (``~`` and relative ones are the user's
home's).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import posixpath
import signal as signal_module
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from e2b.envd.process import process_connect, process_pb
from protobuf import Oneof

from pytest_forkd.e2b.api_errors import ApiError, as_api_error, guest_errno, unknown_user
from pytest_forkd.e2b.config import DEFAULT_WORKDIR
from pytest_forkd.e2b.processes import ProcessConfig, ProcessEnd, ProcessHub, Subscription, with_deadline
from pytest_forkd.e2b.scope import CallScope, current, user_home
from pytest_forkd.errors import AgentError, ForkdError

log = logging.getLogger("pytest_forkd.e2b")

#: How the guest agent refuses a user its /etc/passwd does not have (envd answers that as UNAUTHENTICATED).
UNKNOWN_USER = "unable to find user"
_SIGNALS = {process_pb.Signal.SIGKILL: signal_module.SIGKILL, process_pb.Signal.SIGTERM: signal_module.SIGTERM}


def rpc_error(exc: BaseException, what: str, sandbox_id: str | None = None) -> ConnectError:
    """Any failure as the Connect error envd would answer with."""
    if isinstance(exc, ConnectError):
        return exc
    return as_api_error(exc, what, sandbox_id).connect_error()


def _event(event: Any) -> process_pb.ProcessEvent:
    return process_pb.ProcessEvent(event=event)


def data_event(kind: str, data: bytes) -> process_pb.ProcessEvent:
    return _event(Oneof("data", process_pb.ProcessEvent.DataEvent(output=Oneof(kind, data))))  # type: ignore[arg-type]


def end_event(end: ProcessEnd) -> process_pb.ProcessEvent:
    return _event(
        Oneof(
            "end",
            process_pb.ProcessEvent.EndEvent(exit_code=end.exit_code, exited=end.exited, status=end.status),
        )
    )


class ProcessService(process_connect.Process):
    """The ``process.Process`` service of every sandbox (the sandbox comes from the call's scope)."""

    async def list(self, request: process_pb.ListRequest, ctx: RequestContext[Any, Any]) -> process_pb.ListResponse:
        scope = current()
        return process_pb.ListResponse(
            processes=[
                process_pb.ProcessInfo(
                    config=process_pb.ProcessConfig(
                        cmd=config.cmd, args=list(config.args), envs=dict(config.envs), cwd=config.cwd
                    ),
                    pid=pid,
                    tag=config.tag,
                )
                for pid, config in scope.sandbox.processes.running()
            ]
        )

    async def start(
        self, request: process_pb.StartRequest, ctx: RequestContext[Any, Any]
    ) -> AsyncIterator[process_pb.StartResponse]:
        scope = current()
        hub, subscription = await self._spawn(scope, request, ctx.timeout_ms)
        async for event in follow(hub, scope, ctx, subscription):
            yield process_pb.StartResponse(event=event)

    async def _spawn(
        self, scope: CallScope, request: process_pb.StartRequest, timeout_ms: float | None
    ) -> tuple[ProcessHub, Subscription]:
        sandbox = scope.sandbox
        if len(sandbox.processes.configs) >= sandbox_limit(scope):
            raise ConnectError(Code.RESOURCE_EXHAUSTED, f"at most {sandbox_limit(scope)} processes per sandbox")
        message = request.process or process_pb.ProcessConfig()
        if not message.cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd is required")
        defaulted = not (message.has_field("cwd") and message.cwd)
        cwd = DEFAULT_WORKDIR if defaulted else working_directory(message.cwd, scope.user)
        envs = dict(message.envs)
        env = dict(envs)
        if scope.user is None:
            env.setdefault("HOME", user_home(None))
        else:  # as envd: HOME (the agent sets it from the guest's /etc/passwd), USER and LOGNAME of the user
            for name in ("USER", "LOGNAME"):
                if name not in envs and name not in sandbox.envs:
                    env[name] = scope.user
        size: tuple[int, int] | bool = False
        if request.pty is not None:
            rows = request.pty.size.rows if request.pty.size is not None else 0
            cols = request.pty.size.cols if request.pty.size is not None else 0
            size = (rows or 24, cols or 80)
        config = with_deadline(
            ProcessConfig(
                cmd=message.cmd,
                args=tuple(message.args),
                envs=tuple(envs.items()),
                cwd=cwd,
                tag=request.tag if request.has_field("tag") else None,
                pty=bool(size),
            ),
            timeout_ms,
        )
        vm = sandbox.sync_vm
        assert vm is not None
        user = "0" if scope.user == "root" else scope.user  # uid 0 is root even in an image without a passwd file
        # envd gives a process started with stdin=false (the SDK's default) none: it reads end-of-file at once.
        stdin = bool(size) or not request.has_field("stdin") or request.stdin

        def spawn() -> Any:
            try:
                return vm.spawn([message.cmd, *message.args], env=env, cwd=cwd, pty=size, user=user, stdin=stdin)
            except ForkdError as exc:
                if not defaulted or guest_errno(exc) != errno.ENOENT:
                    raise
            # /home/user is missing (an image where it could not be made): start where the image starts commands
            return vm.spawn([message.cmd, *message.args], env=env, pty=size, user=user, stdin=stdin)

        try:
            hub, subscription = await sandbox.processes.start([message.cmd, *message.args], config, spawn)
        except ApiError as exc:
            raise exc.connect_error() from None
        except Exception as exc:  # noqa: BLE001 - a process envd could not start is an invalid argument
            if isinstance(exc, AgentError) and UNKNOWN_USER in str(exc):
                raise unknown_user(scope.user).connect_error() from None
            error = as_api_error(exc, f"starting {message.cmd!r}", sandbox.id)
            code = Code.UNAVAILABLE if error.status == 502 else Code.INVALID_ARGUMENT
            raise ConnectError(code, error.message) from None
        return hub, subscription

    async def connect(
        self, request: process_pb.ConnectRequest, ctx: RequestContext[Any, Any]
    ) -> AsyncIterator[process_pb.ConnectResponse]:
        scope = current()
        hub = await _selected(scope, request.process)
        async for event in follow(hub, scope, ctx):
            yield process_pb.ConnectResponse(event=event)

    async def send_input(
        self, request: process_pb.SendInputRequest, ctx: RequestContext[Any, Any]
    ) -> process_pb.SendInputResponse:
        scope = current()
        hub = await _selected(scope, request.process)
        await _write(hub, request.input, scope)
        return process_pb.SendInputResponse()

    async def stream_input(
        self, request: AsyncIterator[process_pb.StreamInputRequest], ctx: RequestContext[Any, Any]
    ) -> process_pb.StreamInputResponse:
        scope = current()
        hub: ProcessHub | None = None
        async for message in request:
            value = message.event.value if message.event is not None else None
            if isinstance(value, process_pb.StreamInputRequest.StartEvent):
                hub = await _selected(scope, value.process)
            elif isinstance(value, process_pb.StreamInputRequest.DataEvent):
                if hub is None:
                    raise ConnectError(Code.INVALID_ARGUMENT, "the input stream must start with a start event")
                await _write(hub, value.input, scope)
            # a keepalive: nothing to do
        return process_pb.StreamInputResponse()

    async def close_stdin(
        self, request: process_pb.CloseStdinRequest, ctx: RequestContext[Any, Any]
    ) -> process_pb.CloseStdinResponse:
        scope = current()
        hub = await _selected(scope, request.process)
        if hub.config.pty:
            raise ConnectError(Code.INVALID_ARGUMENT, "a terminal has no stdin to close: send Ctrl-D (0x04) instead")
        await _call(scope, "closing stdin", hub.process.close_stdin)
        return process_pb.CloseStdinResponse()

    async def send_signal(
        self, request: process_pb.SendSignalRequest, ctx: RequestContext[Any, Any]
    ) -> process_pb.SendSignalResponse:
        scope = current()
        number = _SIGNALS.get(request.signal)
        if number is None:
            raise ConnectError(Code.INVALID_ARGUMENT, f"unsupported signal {request.signal!r}: SIGTERM or SIGKILL")
        hub = await _selected(scope, request.process)
        if not await hub.kill(number):
            raise ConnectError(Code.NOT_FOUND, f"process {hub.pid} has already ended")
        return process_pb.SendSignalResponse()

    async def update(
        self, request: process_pb.UpdateRequest, ctx: RequestContext[Any, Any]
    ) -> process_pb.UpdateResponse:
        scope = current()
        hub = await _selected(scope, request.process)
        if request.pty is not None and request.pty.size is not None:
            if not hub.config.pty:
                raise ConnectError(Code.INVALID_ARGUMENT, f"process {hub.pid} has no terminal to resize")
            size = request.pty.size
            await _call(scope, "resizing the terminal", hub.process.resize, size.rows or 24, size.cols or 80)
        return process_pb.UpdateResponse()


def working_directory(cwd: str, user: str | None) -> str:
    """A command's cwd as envd resolves it: ``~`` and relative paths are the user's home's."""
    home = user_home(user)
    if cwd == "~" or cwd.startswith("~/"):
        cwd = home + cwd[1:]
    elif not cwd.startswith("/"):
        cwd = posixpath.join(home, cwd)
    return posixpath.normpath(cwd)


def sandbox_limit(scope: CallScope) -> int:
    return scope.registry.config.limits.max_processes


async def _selected(scope: CallScope, selector: process_pb.ProcessSelector | None) -> ProcessHub:
    """The hub of the process a ``ProcessSelector`` names (by pid or tag); NOT_FOUND otherwise."""
    table = scope.sandbox.processes
    try:
        match selector.selector if selector is not None else None:
            case Oneof(field="pid", value=int() as pid):
                return await table.hub(table.find(pid=pid))
            case Oneof(field="tag", value=str() as tag):
                return await table.hub(table.find(tag=tag))
            case _:
                raise ConnectError(Code.INVALID_ARGUMENT, "a process selector (pid or tag) is required")
    except ApiError as exc:
        raise exc.connect_error() from None


async def _write(hub: ProcessHub, message: process_pb.ProcessInput | None, scope: CallScope) -> None:
    match message.input if message is not None else None:
        case Oneof(field="stdin", value=data) | Oneof(field="pty", value=data):
            if data:
                await _call(scope, f"writing to process {hub.pid}", hub.process.write_stdin, bytes(data))
        case _:
            raise ConnectError(Code.INVALID_ARGUMENT, "input (stdin or pty data) is required")


async def _call(scope: CallScope, what: str, function: Callable[..., Any], *args: Any) -> Any:
    try:
        return await asyncio.to_thread(function, *args)
    except Exception as exc:  # noqa: BLE001 - answered as envd would
        raise rpc_error(exc, what, scope.sandbox.id) from None


async def follow(
    hub: ProcessHub, scope: CallScope, ctx: RequestContext[Any, Any], subscription: Subscription | None = None
) -> AsyncIterator[process_pb.ProcessEvent]:
    """The events of ``hub`` for one stream: start, data, end; keepalives between; ends if the client goes away."""
    subscription = subscription or hub.subscribe()
    timeout_ms = ctx.timeout_ms
    deadline = None if not timeout_ms else time.monotonic() + timeout_ms / 1000
    gone = asyncio.ensure_future(scope.disconnected.wait())
    try:
        yield _event(Oneof("start", process_pb.ProcessEvent.StartEvent(pid=hub.pid)))
        while True:
            waits = [scope.keepalive_s or 3600.0]
            if deadline is not None:
                waits.append(deadline - time.monotonic())
            getting = asyncio.ensure_future(subscription.queue.get())
            done, _ = await asyncio.wait({getting, gone}, timeout=max(0.0, min(waits)), return_when="FIRST_COMPLETED")
            if gone in done:
                getting.cancel()
                return
            if not getting.done():
                getting.cancel()
                if deadline is not None and time.monotonic() >= deadline:
                    raise ConnectError(Code.DEADLINE_EXCEEDED, f"process {hub.pid}: the stream's timeout ran out")
                yield _event(Oneof("keepalive", process_pb.ProcessEvent.KeepAlive()))
                continue
            kind, value = getting.result()
            if kind == "end":
                yield end_event(value)
                return
            if kind == "error":
                raise value.connect_error()
            yield data_event(kind, value)
    finally:
        gone.cancel()
        hub.unsubscribe(subscription)
