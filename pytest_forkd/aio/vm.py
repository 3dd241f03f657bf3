"""The asyncio API: AsyncVM, AsyncSnapshot, AsyncCheckpoint and aboot().

Each async handle wraps the synchronous one (:class:`~pytest_forkd.core.vm.VM`,
:class:`~pytest_forkd.storage.snapshot.Snapshot`,
:class:`~pytest_forkd.core.checkpoint.Checkpoint`) and mirrors its API one to one,
awaited: ``await vm.exec(...)``, ``await vm.branch()``, ``await snap.fork(n)``,
``async with vm.checkpoint():``. The sync layer is the core (protocol, engine,
backends, timings, history); this layer only moves its blocking calls off the
event loop (see :mod:`pytest_forkd.aio.offload`) and turns task cancellation
into the right thing in the guest (see :mod:`pytest_forkd.aio.cancel`).

Cancelling an awaited operation:

- ``exec``: the command's whole process group is killed in the guest; the
  cancellation completes once it is gone, and the VM stays usable.
- ``write_file``: an upload still arriving is dropped by the agent, so the
  file keeps its old contents; one that already arrived completes. Either way
  nothing lands later, and the VM stays usable.
- ``read_file``, ``ping``: return at once; the reply is ignored when it comes.
- ``fork``, ``branch``, ``freeze`` and ``aboot()``: return at once; VMs that
  were being started are closed when they are up.
- ``restore``, ``rollback``, ``close``: they change the VM in place, so the
  cancellation waits until they are done.

If the guest does not confirm a cancellation, the handle is marked broken and
every later operation raises :class:`~pytest_forkd.errors.VMError` saying why.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import threading
from collections.abc import AsyncIterable, Awaitable, Callable, Generator, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ..errors import ForkdError, VMError
from .cancel import RequestTicket, cancel_request
from .offload import LoopGuard, offload, running_loop, settled, uninterruptible

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_forkd.analysis.changes import Changes
    from pytest_forkd.analysis.transcript import Transcript
    from pytest_forkd.core.checkpoint import Checkpoint
    from pytest_forkd.core.copy import CopyResult
    from pytest_forkd.core.handles import VMOwner
    from pytest_forkd.core.process import GuestProcess
    from pytest_forkd.core.vm import VM
    from pytest_forkd.engine.base import AnyMachine
    from pytest_forkd.engine.network import NetworkChoice, NetworkSpec
    from pytest_forkd.guest.client import AgentClient
    from pytest_forkd.guest.exec_result import ExecResult
    from pytest_forkd.storage.snapshot import Snapshot, SnapshotOwner

    from ..image import Image
    from .process import AsyncGuestProcess

T = TypeVar("T")
C = TypeVar("C", bound="_AsyncContext")


class _AsyncContext:
    async def __aenter__(self: C) -> C:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        raise NotImplementedError


class Starting(Generic[C]):
    """What ``aboot()`` and ``vm.checkpoint()`` return: await it, or use it with ``async with``.

    ``vm = await aboot()`` hands over the handle (close it yourself);
    ``async with aboot() as vm:`` closes it when the block ends.
    """

    def __init__(self, start: Callable[[], Awaitable[C]]) -> None:
        self._start = start
        self._entered: C | None = None

    def __await__(self) -> Generator[Any, None, C]:
        return self._start().__await__()

    async def __aenter__(self) -> C:
        self._entered = await self._start()
        return await self._entered.__aenter__()

    async def __aexit__(self, *exc_info: Any) -> None:
        assert self._entered is not None, "__aexit__ without __aenter__"
        await self._entered.__aexit__(*exc_info)


class AsyncVM(_AsyncContext):
    """asyncio handle of a running microVM: the :class:`~pytest_forkd.core.vm.VM` API, awaited.

    Wrap any VM with ``AsyncVM(vm)``; the handle belongs to the event loop
    that first awaits it. Any number of operations may run at once, in one VM
    or several: each waits on its own request to the guest agent.

    ``owner``: where snapshots taken through this handle start their children
    (the test fixtures pass the test, so that its forks die with it); the
    VM's factory by default. ``follow_loop``: instead of belonging to one
    event loop, the handle may move to another loop whenever none of its
    operations is in flight (the session-wide ``forkd_aparent`` is such a
    handle, since each test may run in an event loop of its own).
    """

    def __init__(
        self,
        vm: VM,
        *,
        owner: SnapshotOwner | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        follow_loop: bool = False,
    ) -> None:
        self._vm = vm
        self._owner = owner
        self._guard = LoopGuard(f"AsyncVM {vm.name}", loop, follow=follow_loop)
        self._broken: str | None = None
        self._closing = False

    # -- identity (plain attributes, usable from anywhere) -------------------------
    @property
    def sync(self) -> VM:
        """The synchronous VM this handle wraps (same guest; for synchronous code and other loops)."""
        return self._vm

    @property
    def name(self) -> str:
        return self._vm.name

    @property
    def memory_mib(self) -> int:
        return self._vm.memory_mib

    @property
    def image(self) -> Image:
        return self._vm.image

    @property
    def origin(self) -> Snapshot | None:
        """The snapshot this VM was forked or restored from (None for a booted root VM)."""
        return self._vm.origin

    @property
    def memory_base(self) -> Snapshot | None:
        """``VM.memory_base``: the snapshot whose memory file this VM maps copy-on-write."""
        return self._vm.memory_base

    @property
    def restore_phases(self) -> Any:
        """``VM.restore_phases``: where a child's restore time went (None for a booted VM)."""
        return self._vm.restore_phases

    @property
    def transcript(self) -> Transcript:
        """The VM's transcript (shared with the sync handle), as failure reports show it."""
        return self._vm.transcript

    @property
    def generation(self) -> int:
        return self._vm.generation

    @property
    def closed(self) -> bool:
        return self._vm.closed

    @property
    def env(self) -> dict[str, str]:
        """``VM.env``: environment variables every exec gets unless the call overrides them."""
        return self._vm.env

    @env.setter
    def env(self, value: Mapping[str, str] | None) -> None:
        self._vm.env = value

    @property
    def cwd(self) -> str | None:
        """``VM.cwd``: working directory of every exec that does not pass ``cwd``."""
        return self._vm.cwd

    @cwd.setter
    def cwd(self, value: str | None) -> None:
        self._vm.cwd = value

    @property
    def max_output(self) -> int:
        """``VM.max_output``: bytes of each of stdout and stderr an exec keeps unless it says otherwise."""
        return self._vm.max_output

    @max_output.setter
    def max_output(self, value: int) -> None:
        self._vm.max_output = value

    @property
    def default_backend(self) -> str | None:
        """``VM.default_backend``: the storage backend of branches and checkpoints that name none."""
        return self._vm.default_backend

    @default_backend.setter
    def default_backend(self, value: str | None) -> None:
        self._vm.default_backend = value

    @property
    def broken(self) -> str | None:
        """Why this handle cannot be used any more, or None.

        Either a cancellation the guest did not confirm, or what cut the VM
        itself off (``VM.broken``: its guest broke the agent protocol).
        """
        return self._broken if self._broken is not None else self._vm.broken

    @property
    def protocol_errors(self) -> dict[str, int]:
        """``VM.protocol_errors``: malformed or unexpected frames its guest sent so far, by kind."""
        return self._vm.protocol_errors

    def defaults(self) -> dict[str, Any]:
        """``VM.defaults``: the per-VM ``env`` and ``cwd`` as a snapshot of this VM records them."""
        return self._vm.defaults()

    def console_tail(self, lines: int = 40) -> str:
        return self._vm.console_tail(lines)

    # -- what the sync VM is built on (blocking: for storage backends and diagnostics) ----------------
    @property
    def agent(self) -> AgentClient:
        """``VM.agent``: the blocking client of the guest agent; awaited code uses this handle's operations."""
        return self._vm.agent

    @property
    def factory(self) -> VMOwner:
        """``VM.factory``: the factory that started the VM (blocking API)."""
        return self._vm.factory

    @property
    def machine(self) -> AnyMachine:
        """``VM.machine``: the engine-level process (blocking API, for storage backends and diagnostics)."""
        return self._vm.machine

    def __repr__(self) -> str:
        return f"<AsyncVM of {self._vm!r}>"

    # -- guest operations -------------------------------------------------------
    async def exec(
        self,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | str | None = None,
        check: bool = False,
        max_output: int | None = None,
        timing: str = "harness",
        pty: bool | tuple[int, int] = False,
        user: str | None = None,
    ) -> ExecResult:
        """``VM.exec``, awaited. Cancelling the awaiting task kills the command in the guest."""
        what = f"running {command!r}"
        call = functools.partial(
            self._vm.exec,
            command,
            timeout=timeout,
            env=env,
            cwd=cwd,
            stdin=stdin,
            check=check,
            max_output=max_output,
            timing=timing,
            pty=pty,
            user=user,
        )
        return await self._cancellable(what, "exec", call)

    async def write_file(
        self, path: str, data: bytes | str, *, mode: int | None = None, user: str | None = None
    ) -> None:
        """``VM.write_file``, awaited. Cancelled while the data is on its way, the file keeps its old contents
        (written as a ``user``, in place, it keeps what arrived)."""
        await self._cancellable(
            f"writing {path}", "write-file", functools.partial(self._vm.write_file, path, data, mode=mode, user=user)
        )

    async def write_stream(
        self, path: str, chunks: Iterable[bytes] | AsyncIterable[bytes], *, mode: int | None = None
    ) -> int:
        """``VM.write_stream``, awaited; ``chunks`` may be an async iterable, read in this loop as the guest takes it.

        Cancelled, the upload is dropped in the guest and the file keeps its old contents.
        """
        stop = threading.Event()
        if isinstance(chunks, AsyncIterable):
            chunks = _pulled_from_loop(chunks, asyncio.get_running_loop(), stop, f"writing {path}")
        try:
            return await self._cancellable(
                f"writing {path}", "write-stream", functools.partial(self._vm.write_stream, path, chunks, mode=mode)
            )
        finally:
            stop.set()

    async def spawn(
        self,
        command: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        pty: bool | tuple[int, int] = False,
        max_output: int | None = None,
        user: str | None = None,
        stdin: bool = True,
    ) -> AsyncGuestProcess:
        """``VM.spawn``, awaited: start a process and return its handle once it runs.

        ``async for line in proc.stdout``, ``await proc.wait()``,
        ``await proc.write_stdin(...)``, ``await proc.kill()``; see
        :class:`~pytest_forkd.aio.process.AsyncGuestProcess`.
        """
        from .process import AsyncGuestProcess

        process = await self._offload(
            f"spawning {command!r}",
            "spawn",
            functools.partial(
                self._vm.spawn, command, env=env, cwd=cwd, pty=pty, max_output=max_output, user=user, stdin=stdin
            ),
            discard=_kill_process,
        )
        return AsyncGuestProcess(process, self)

    async def process(self, pid: int) -> AsyncGuestProcess:
        """``VM.process``, awaited: the handle of a process spawned in this guest (or before its snapshot)."""
        from .process import AsyncGuestProcess

        return AsyncGuestProcess(
            await self._offload(f"attaching to process {pid}", "process", functools.partial(self._vm.process, pid)),
            self,
        )

    async def processes(self) -> list[AsyncGuestProcess]:
        """``VM.processes``, awaited: handles of every spawned process the guest tracks."""
        from .process import AsyncGuestProcess

        return [
            AsyncGuestProcess(process, self)
            for process in await self._offload("listing processes", "processes", self._vm.processes)
        ]

    async def read_file(self, path: str, *, max_size: int | None = None) -> bytes:
        """``VM.read_file``, awaited."""
        return await self._offload(
            f"reading {path}", "read-file", functools.partial(self._vm.read_file, path, max_size=max_size)
        )

    async def copy_in(
        self, local_path: str | os.PathLike[str], guest_path: str, *, exclude: Iterable[str] = ()
    ) -> CopyResult:
        """``VM.copy_in``, awaited. Cancelled, the rest of the upload is dropped in the guest."""
        return await self._cancellable(
            f"copying {local_path} into {guest_path}",
            "copy-in",
            functools.partial(self._vm.copy_in, local_path, guest_path, exclude=exclude),
        )

    async def copy_out(
        self,
        guest_path: str,
        local_path: str | os.PathLike[str],
        *,
        exclude: Iterable[str] = (),
        max_size: int | None = None,
        max_files: int | None = None,
    ) -> CopyResult:
        """``VM.copy_out``, awaited. Cancelled, the guest stops sending."""
        return await self._cancellable(
            f"copying {guest_path} out",
            "copy-out",
            functools.partial(
                self._vm.copy_out, guest_path, local_path, exclude=exclude, max_size=max_size, max_files=max_files
            ),
        )

    async def changes(
        self,
        since: AsyncCheckpoint | AsyncSnapshot | Checkpoint[VM] | Snapshot | None = None,
        *,
        include: Iterable[str] = (),
        exclude: Iterable[str] = (),
    ) -> Changes:
        """``VM.changes``, awaited: what changed in the guest's filesystem since a checkpoint or snapshot.

        The :class:`~pytest_forkd.analysis.changes.Changes` it returns is the sync
        one: its ``diff()`` and ``read()`` of new contents block, so call them
        from a worker (``asyncio.to_thread``) inside a busy event loop.
        """
        point = since.sync if isinstance(since, (AsyncCheckpoint, AsyncSnapshot)) else since
        return await self._offload(
            "computing filesystem changes",
            "changes",
            functools.partial(self._vm.changes, point, include=include, exclude=exclude),
        )

    async def ping(self, timeout: float = 10.0) -> dict[str, Any]:
        """``VM.ping``, awaited: a round trip to the guest agent."""
        return await self._offload("answering a ping", "ping", functools.partial(self._vm.ping, timeout=timeout))

    # -- network ----------------------------------------------------------------
    @property
    def network(self) -> NetworkSpec:
        """``VM.network``: its mode, the host ports it may reach and the guest ports forwarded now."""
        return self._vm.network

    @property
    def host_address(self) -> str:
        """``VM.host_address``: the address at which the guest reaches the host's loopback services."""
        return self._vm.host_address

    @property
    def forwards(self) -> dict[int, int]:
        """``VM.forwards``: guest port -> host port, for every forwarded guest port."""
        return self._vm.forwards

    async def forward(self, guest_port: int, *, check: bool = True, timeout: float = 10.0) -> int:
        """``VM.forward``, awaited: the host port that reaches ``guest_port``.

        A cancellation waits until the forward is set up (it changes the VM).
        """
        return await self._offload(
            f"forwarding guest port {guest_port}",
            "forward",
            functools.partial(self._vm.forward, guest_port, check=check, timeout=timeout),
            in_place=True,
        )

    # -- snapshots --------------------------------------------------------------
    async def branch(self, tag: str | None = None, *, backend: str | None = None) -> AsyncSnapshot:
        """``VM.branch``, awaited: snapshot this VM (it keeps running)."""
        snapshot = await self._offload(
            "taking a snapshot", "branch", lambda: self._owned(self._vm.branch(tag, backend=backend))
        )
        return AsyncSnapshot(snapshot, loop=self._guard.loop)

    async def fork(self, n: int = 1, *, backend: str | None = None, network: NetworkChoice = None) -> list[AsyncVM]:
        """``VM.fork``, awaited: branch this VM and start ``n`` children of the snapshot."""

        def fork() -> list[VM]:
            return self._owned(self._vm.branch(backend=backend)).fork(n, network=network)

        children = await self._offload(f"forking {n} children", "fork", fork, discard=_close_all)
        return [AsyncVM(child, owner=self._owner, loop=self._guard.loop) for child in children]

    async def restore(self, snapshot: AsyncSnapshot | Snapshot) -> None:
        """``VM.restore``, awaited: roll this VM back to ``snapshot`` in place."""
        record = snapshot.sync if isinstance(snapshot, AsyncSnapshot) else snapshot
        await self._offload(
            f"restoring snapshot {record.tag}", "restore", functools.partial(self._vm.restore, record), in_place=True
        )

    def checkpoint(
        self, tag: str | None = None, *, backend: str | None = None, manifest: bool = False
    ) -> Starting[AsyncCheckpoint]:
        """``VM.checkpoint``: ``cp = await vm.checkpoint()``, or ``async with vm.checkpoint() as cp:``.

        As a context manager it rolls the VM back when the block ends unless
        ``cp.keep()`` was called in it.
        """

        async def take() -> AsyncCheckpoint:
            checkpoint = await self._offload(
                "taking a checkpoint",
                "checkpoint",
                lambda: self._vm.checkpoint(tag, backend=backend, manifest=manifest),
            )
            checkpoint.snapshot = self._owned(checkpoint.snapshot)
            return AsyncCheckpoint(self, checkpoint)

        return Starting(take)

    async def freeze(self, tag: str, *, store: Any = None, keep_running: bool = True) -> AsyncSnapshot:
        """``VM.freeze``, awaited: turn this booted root VM into base snapshot ``tag``."""
        snapshot = await self._offload(
            f"freezing into {tag}",
            "freeze",
            lambda: self._vm.freeze(tag, store=store, keep_running=keep_running),
            in_place=True,
        )
        return AsyncSnapshot(self._owned(snapshot), loop=self._guard.loop)

    # -- lifecycle --------------------------------------------------------------
    async def close(self) -> None:
        """``VM.close``, awaited: kill the VM. Idempotent; operations still waiting raise VMError."""
        if self._vm.closed:
            return
        # Closing touches no loop state, so any loop may do it: a handle left over in a
        # finished loop must still be closable.
        loop = running_loop(f"closing AsyncVM {self.name}")
        self._closing = True
        await uninterruptible(offload(loop, self._vm.close, name=f"forkd-async-close-{self.name}"))

    aclose = close

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- internals ----------------------------------------------------------------
    def _owned(self, snapshot: Snapshot) -> Snapshot:
        return snapshot.with_owner(self._owner) if self._owner is not None else snapshot

    def _usable(self, what: str) -> asyncio.AbstractEventLoop:
        """The running loop, once this handle may be used in it; counts an operation until ``_guard.release()``."""
        loop = self._guard.acquire(what)
        if self._broken is not None:
            self._guard.release()
            raise VMError(
                f"VM {self.name} cannot be used for {what}: {self._broken}; close it "
                "(await vm.close()) and start another"
            )
        if self._vm.closed:
            self._guard.release()
            raise VMError(f"VM {self.name} is closed; it cannot be used for {what}")
        return loop

    def _explain(self, error: ForkdError, what: str) -> ForkdError:
        if self._closing and isinstance(error, VMError):
            return VMError(f"VM {self.name} was closed while {what}")
        return error

    async def _offload(
        self,
        what: str,
        name: str,
        call: Callable[[], T],
        *,
        discard: Callable[[T], None] | None = None,
        in_place: bool = False,
    ) -> T:
        loop = self._usable(what)
        try:
            future = offload(loop, call, name=f"forkd-async-{name}-{self.name}", discard=discard)
            return await (uninterruptible(future) if in_place else future)
        except ForkdError as exc:
            explained = self._explain(exc, what)
            if explained is exc:
                raise
            raise explained from exc
        finally:
            self._guard.release()

    async def _cancellable(self, what: str, name: str, call: Callable[[], T]) -> T:
        """Run a guest request; if the awaiting task is cancelled, stop the request in the guest too."""
        loop = self._usable(what)
        ticket = RequestTicket()
        try:
            # The agent is looked up in the worker, next to the call: a restore may have replaced it.
            future = offload(loop, lambda: ticket.run(self._vm.agent, call), name=f"forkd-async-{name}-{self.name}")
            return await future
        except asyncio.CancelledError:
            await self._cancel_in_guest(loop, ticket, what)
            raise
        except ForkdError as exc:
            explained = self._explain(exc, what)
            if explained is exc:
                raise
            raise explained from exc
        finally:
            self._guard.release()

    async def _cancel_in_guest(self, loop: asyncio.AbstractEventLoop, ticket: RequestTicket, what: str) -> None:
        target = ticket.withdraw()
        if target is None or self._vm.closed:
            return  # never sent, or nothing left to stop
        client, request_id = target
        future = offload(loop, lambda: cancel_request(client, request_id), name=f"forkd-async-cancel-{self.name}")
        await settled(future)  # bounded by the cancel request's own timeout
        error = future.exception()
        if error is not None and not self._vm.closed:
            self._broken = f"cancelling {what} in the guest failed ({error}), so it may still be running"
        elif error is None and not future.result().get("finished", True):
            self._broken = (
                f"{what} was cancelled, but the guest did not confirm within seconds that it "
                "stopped, so it may still be running"
            )


class AsyncSnapshot:
    """asyncio handle of a :class:`~pytest_forkd.storage.snapshot.Snapshot`: ``await snap.fork(n)``.

    Its record's fields (``tag``, ``backend``, ``path``, ``pause_ms``...) read
    through; ``sync`` is the record itself.
    """

    def __init__(self, snapshot: Snapshot, *, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._snapshot = snapshot
        self._guard = LoopGuard(f"AsyncSnapshot {snapshot.tag}", loop)

    @property
    def sync(self) -> Snapshot:
        return self._snapshot

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._snapshot, name)

    def __repr__(self) -> str:
        return f"<AsyncSnapshot {self._snapshot.tag} backend={self._snapshot.backend}>"

    async def fork(self, n: int = 1, *, network: NetworkChoice = None) -> list[AsyncVM]:
        """``Snapshot.fork``, awaited: ``n`` copy-on-write children, started concurrently."""
        loop = self._guard.check(f"forking {n} children")
        owner = self._snapshot.owner
        children = await offload(
            loop,
            functools.partial(self._snapshot.fork, n, network=network),
            name=f"forkd-async-fork-{self._snapshot.tag}",
            discard=_close_all,
        )
        return [AsyncVM(child, owner=owner, loop=loop) for child in children]

    async def wait_ready(self, timeout: float | None = None) -> AsyncSnapshot:
        """``Snapshot.wait_ready``, awaited: until memory written in the background is there."""
        loop = self._guard.check("waiting for the snapshot")
        record = await offload(
            loop, functools.partial(self._snapshot.wait_ready, timeout), name=f"forkd-async-wait-{self._snapshot.tag}"
        )
        return AsyncSnapshot(record, loop=loop)

    async def export(self, path: Path | str) -> Path:
        """``Snapshot.export``, awaited: write this snapshot and its image into one portable archive."""
        loop = self._guard.check(f"exporting snapshot {self._snapshot.tag}")
        return await offload(
            loop, functools.partial(self._snapshot.export, path), name=f"forkd-async-export-{self._snapshot.tag}"
        )

    async def save_to(self, directory: Path | str) -> Path:
        """``Snapshot.save_to``, awaited: write ``snapshot.json`` into ``directory`` atomically."""
        loop = self._guard.check(f"saving snapshot {self._snapshot.tag}")
        return await offload(
            loop, functools.partial(self._snapshot.save_to, directory), name=f"forkd-async-save-{self._snapshot.tag}"
        )

    @classmethod
    def load_from(
        cls,
        directory: Path | str,
        *,
        remedy: str = "remove the snapshot directory and take the snapshot again",
    ) -> AsyncSnapshot:
        """``Snapshot.load_from``: the record in ``directory/snapshot.json`` (one small file, read at once)."""
        from pytest_forkd.storage.snapshot import Snapshot

        return cls(Snapshot.load_from(directory, remedy=remedy))

    def replace(self, **changes: Any) -> AsyncSnapshot:
        """``Snapshot.replace``: a handle of a copy with some fields changed."""
        return AsyncSnapshot(self._snapshot.replace(**changes), loop=self._guard.loop)

    def with_owner(self, owner: SnapshotOwner | None) -> AsyncSnapshot:
        """``Snapshot.with_owner``: a handle of a copy attached to ``owner``, so that :meth:`fork` can start VMs."""
        return AsyncSnapshot(self._snapshot.with_owner(owner), loop=self._guard.loop)


class AsyncCheckpoint(_AsyncContext):
    """asyncio handle of a :class:`~pytest_forkd.core.checkpoint.Checkpoint`.

    ``async with vm.checkpoint() as cp:`` rolls the VM back when the block
    ends, unless ``cp.keep()`` was called; ``await cp.rollback()``,
    ``await cp.fork(n)``.
    """

    def __init__(self, vm: AsyncVM, checkpoint: Checkpoint[VM]) -> None:
        self.vm = vm
        self._checkpoint = checkpoint
        self.snapshot = AsyncSnapshot(checkpoint.snapshot, loop=vm._guard.loop)

    @property
    def sync(self) -> Checkpoint[VM]:
        return self._checkpoint

    @property
    def tag(self) -> str:
        return self._checkpoint.tag

    def keep(self) -> None:
        """Keep the changes made since the checkpoint when the block ends."""
        self._checkpoint.keep()

    async def rollback(self) -> None:
        """Restore the VM to the checkpoint now (a cancellation waits until it is done)."""
        await self.vm._offload(
            f"rolling back to checkpoint {self.tag}", "rollback", self._checkpoint.rollback, in_place=True
        )

    async def fork(self, n: int = 1) -> list[AsyncVM]:
        """Start ``n`` children of the checkpoint, to try alternatives side by side."""
        return await self.snapshot.fork(n)

    async def changes(self, *, include: Iterable[str] = (), exclude: Iterable[str] = ()) -> Changes:
        """``Checkpoint.changes``, awaited: what changed in the VM's filesystem since this checkpoint."""
        return await self.vm._offload(
            f"computing changes since checkpoint {self.tag}",
            "changes",
            functools.partial(self._checkpoint.changes, include=include, exclude=exclude),
        )

    async def __aexit__(self, *exc_info: object) -> None:
        if self.vm.closed:
            return  # as Checkpoint.__exit__: nothing to roll back
        await self.vm._offload(
            f"leaving checkpoint {self.tag}",
            "rollback",
            functools.partial(self._checkpoint.__exit__, *exc_info),
            in_place=True,
        )

    def __repr__(self) -> str:
        return f"<AsyncCheckpoint {self.tag} of {self.vm.name}>"


def aboot(
    image: str = "default",
    *,
    memory_mib: int = 256,
    vcpus: int = 1,
    accel: str = "auto",
    network: NetworkChoice = None,
) -> Starting[AsyncVM]:
    """Boot a root VM from ``image`` (a name or a container reference, as for ``boot``) without blocking the loop.

    ``async with aboot() as vm:`` closes it when the block ends; ``vm = await
    aboot()`` leaves that to you (``await vm.close()``). Cancelled while it
    boots, the VM is closed as soon as it is up.
    """

    async def start() -> AsyncVM:
        from pytest_forkd.core.factory import boot

        loop = running_loop("aboot()")
        vm = await offload(
            loop,
            lambda: boot(image, memory_mib=memory_mib, vcpus=vcpus, accel=accel, network=network),
            name="forkd-async-boot",
            discard=_close,
        )
        return AsyncVM(vm, loop=loop)

    return Starting(start)


def _kill_process(process: GuestProcess) -> None:
    """A spawn whose awaiter was cancelled: the process it started must not run on unseen."""
    process.__exit__(None, None, None)


def _close_all(vms: list[VM]) -> None:
    for vm in vms:
        vm.close()


def _close(vm: VM) -> None:
    vm.close()


_END_OF_CHUNKS = object()


def _pulled_from_loop(
    chunks: AsyncIterable[bytes], loop: asyncio.AbstractEventLoop, stop: threading.Event, what: str
) -> Iterator[bytes]:
    """The chunks of an async iterable, for a worker thread: each is awaited in ``loop`` when the thread asks."""
    iterator = aiter(chunks)

    async def next_chunk() -> object:
        try:
            return await anext(iterator)
        except StopAsyncIteration:
            return _END_OF_CHUNKS

    while True:
        future = asyncio.run_coroutine_threadsafe(next_chunk(), loop)
        while True:
            if stop.is_set():
                future.cancel()
                raise VMError(f"{what} was cancelled")
            try:
                item = future.result(timeout=0.5)
                break
            except concurrent.futures.TimeoutError:
                continue
        if item is _END_OF_CHUNKS:
            return
        yield item  # type: ignore[misc]
