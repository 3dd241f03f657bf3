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
import functools
import os
from collections.abc import Awaitable, Callable, Generator, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ..errors import ForkdError, VMError
from .cancel import RequestTicket, cancel_request
from .offload import LoopGuard, offload, running_loop, settled, uninterruptible

if TYPE_CHECKING:
    from pytest_forkd.core.checkpoint import Checkpoint
    from pytest_forkd.core.copy import CopyResult
    from pytest_forkd.core.process import GuestProcess
    from pytest_forkd.core.transcript import Transcript
    from pytest_forkd.core.vm import VM
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
    def broken(self) -> str | None:
        """Why this handle cannot be used any more (a cancellation the guest did not confirm), or None."""
        return self._broken

    def console_tail(self, lines: int = 40) -> str:
        return self._vm.console_tail(lines)

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
        )
        return await self._cancellable(what, "exec", call)

    async def write_file(self, path: str, data: bytes | str, *, mode: int | None = None) -> None:
        """``VM.write_file``, awaited. Cancelled while the data is on its way, the file keeps its old contents."""
        await self._cancellable(
            f"writing {path}", "write-file", functools.partial(self._vm.write_file, path, data, mode=mode)
        )

    async def spawn(
        self,
        command: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        pty: bool | tuple[int, int] = False,
        max_output: int | None = None,
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
            functools.partial(self._vm.spawn, command, env=env, cwd=cwd, pty=pty, max_output=max_output),
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

    async def read_file(self, path: str) -> bytes:
        """``VM.read_file``, awaited."""
        return await self._offload(f"reading {path}", "read-file", functools.partial(self._vm.read_file, path))

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

    async def ping(self, timeout: float = 10.0) -> dict[str, Any]:
        """``VM.ping``, awaited: a round trip to the guest agent."""
        return await self._offload("answering a ping", "ping", functools.partial(self._vm.ping, timeout=timeout))

    # -- snapshots --------------------------------------------------------------
    async def branch(self, tag: str | None = None, *, backend: str | None = None) -> AsyncSnapshot:
        """``VM.branch``, awaited: snapshot this VM (it keeps running)."""
        snapshot = await self._offload(
            "taking a snapshot", "branch", lambda: self._owned(self._vm.branch(tag, backend=backend))
        )
        return AsyncSnapshot(snapshot, loop=self._guard.loop)

    async def fork(self, n: int = 1, *, backend: str | None = None) -> list[AsyncVM]:
        """``VM.fork``, awaited: branch this VM and start ``n`` children of the snapshot."""

        def fork() -> list[VM]:
            return self._owned(self._vm.branch(backend=backend)).fork(n)

        children = await self._offload(f"forking {n} children", "fork", fork, discard=_close_all)
        return [AsyncVM(child, owner=self._owner, loop=self._guard.loop) for child in children]

    async def restore(self, snapshot: AsyncSnapshot | Snapshot) -> None:
        """``VM.restore``, awaited: roll this VM back to ``snapshot`` in place."""
        record = snapshot.sync if isinstance(snapshot, AsyncSnapshot) else snapshot
        await self._offload(
            f"restoring snapshot {record.tag}", "restore", functools.partial(self._vm.restore, record), in_place=True
        )

    def checkpoint(self, tag: str | None = None, *, backend: str | None = None) -> Starting[AsyncCheckpoint]:
        """``VM.checkpoint``: ``cp = await vm.checkpoint()``, or ``async with vm.checkpoint() as cp:``.

        As a context manager it rolls the VM back when the block ends unless
        ``cp.keep()`` was called in it.
        """

        async def take() -> AsyncCheckpoint:
            checkpoint = await self._offload(
                "taking a checkpoint", "checkpoint", lambda: self._vm.checkpoint(tag, backend=backend)
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

    async def fork(self, n: int = 1) -> list[AsyncVM]:
        """``Snapshot.fork``, awaited: ``n`` copy-on-write children, started concurrently."""
        loop = self._guard.check(f"forking {n} children")
        owner = self._snapshot.owner
        children = await offload(
            loop,
            functools.partial(self._snapshot.fork, n),
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


class AsyncCheckpoint(_AsyncContext):
    """asyncio handle of a :class:`~pytest_forkd.core.checkpoint.Checkpoint`.

    ``async with vm.checkpoint() as cp:`` rolls the VM back when the block
    ends, unless ``cp.keep()`` was called; ``await cp.rollback()``,
    ``await cp.fork(n)``.
    """

    def __init__(self, vm: AsyncVM, checkpoint: Checkpoint) -> None:
        self.vm = vm
        self._checkpoint = checkpoint
        self.snapshot = AsyncSnapshot(checkpoint.snapshot, loop=vm._guard.loop)

    @property
    def sync(self) -> Checkpoint:
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


def aboot(image: str = "default", *, memory_mib: int = 256, vcpus: int = 1, accel: str = "auto") -> Starting[AsyncVM]:
    """Boot a root VM from ``image`` without blocking the event loop.

    ``async with aboot() as vm:`` closes it when the block ends; ``vm = await
    aboot()`` leaves that to you (``await vm.close()``). Cancelled while it
    boots, the VM is closed as soon as it is up.
    """

    async def start() -> AsyncVM:
        from pytest_forkd.core.factory import boot

        loop = running_loop("aboot()")
        vm = await offload(
            loop,
            lambda: boot(image, memory_mib=memory_mib, vcpus=vcpus, accel=accel),
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
