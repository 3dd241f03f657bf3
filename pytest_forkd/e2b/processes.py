"""The processes envd's ``Process`` service started in one sandbox, and the streams that follow them.

A process started by ``Start`` is a forkd guest process (``vm.spawn``): it
lives in the guest, so it keeps running when the client's stream goes away,
and in every VM started from a snapshot of the sandbox (fork, pause and
resume), where :meth:`ProcessTable.hub` attaches to it again by pid. What
envd knows of it besides the pid (command, arguments, envs, cwd, tag,
deadline) is kept here, and copied to such children.

Each attached process has one :class:`ProcessHub`: forkd relays the
process's output to it as it comes (:meth:`GuestProcess.relay
<pytest_forkd.core.process.GuestProcess.relay>`: no thread waits on a read),
and the hub hands every chunk, in the event loop, to the streams following
it (``Start``, any number of ``Connect``), one bounded queue each, waiting
for the slowest before it lets the guest send more (so a client that does
not read slows the reading down, and the guest keeps a bounded amount, as
forkd does for any process). A chunk that arrives while no stream follows
is dropped, as envd drops output nobody listens to. When the process ends,
every stream gets the end event, after all its output; when its sandbox
ends first, the error that says why. A process started with a timeout
(envd's ``Connect-Timeout-Ms``) is killed when it runs out, whether a
client still listens or not: that is what keeps a client that went away
from leaving a process behind.
"""

from __future__ import annotations

import asyncio
import collections
import signal as signal_module
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from pytest_forkd.e2b.api_errors import ApiError
from pytest_forkd.errors import NoSuchProcess, ProcessError

if TYPE_CHECKING:
    from pytest_forkd.core.process import GuestProcess, ProcessOutput
    from pytest_forkd.core.vm import VM

#: Chunks waiting for one stream before the reading of the process waits for that stream.
STREAM_BACKLOG = 32


@dataclass(frozen=True)
class ProcessConfig:
    """What envd reports of a process it started (``ProcessInfo``), and when it must be killed."""

    cmd: str
    args: tuple[str, ...] = ()
    envs: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None
    tag: str | None = None
    pty: bool = False
    deadline: float | None = None
    """Wall-clock time at which the process is killed (None: it runs until it ends or its sandbox does)."""


@dataclass(frozen=True)
class ProcessEnd:
    """envd's ``EndEvent`` of a process that ended with ``returncode`` (``-N``: killed by signal N)."""

    exit_code: int
    exited: bool
    status: str

    @classmethod
    def of(cls, returncode: int) -> ProcessEnd:
        if returncode >= 0:
            return cls(returncode, True, f"exit status {returncode}")
        try:
            name = (signal_module.strsignal(-returncode) or f"signal {-returncode}").lower()
        except ValueError:
            name = f"signal {-returncode}"
        return cls(-1, False, f"signal: {name}")


@dataclass
class Subscription:
    """One stream following a process: a bounded queue of ``(kind, value)`` events."""

    queue: asyncio.Queue[tuple[str, Any]] = field(default_factory=lambda: asyncio.Queue(STREAM_BACKLOG))
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    async def put(self, event: tuple[str, Any]) -> None:
        if self.closed.is_set():
            return
        putting = asyncio.ensure_future(self.queue.put(event))
        closing = asyncio.ensure_future(self.closed.wait())
        try:
            await asyncio.wait({putting, closing}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            putting.cancel()
            closing.cancel()


class ProcessHub:
    """One attached guest process: its output, relayed from the guest, handed to the streams that follow it.

    The relay (:class:`~pytest_forkd.core.process.ProcessSink`) is called in
    forkd's reader thread; it only posts to the loop, where one task at a
    time hands the chunks on in order and then gives their credit back.
    """

    def __init__(
        self,
        process: GuestProcess,
        config: ProcessConfig,
        loop: asyncio.AbstractEventLoop,
        on_end: Callable[[ProcessHub], None],
    ) -> None:
        self.process = process
        self.config = config
        self._loop = loop
        self._on_end = on_end
        self._subscriptions: list[Subscription] = []
        self.end: ProcessEnd | None = None
        self.failure: ApiError | None = None
        self._arrived: collections.deque[tuple[ProcessOutput, bytes] | None] = collections.deque()
        """Chunks not handed on yet, in order; None: everything arrived. Bounded by the relay's credit."""
        self._handing: asyncio.Task[None] | None = None
        self._deadline_timer: asyncio.TimerHandle | None = None
        self.done = asyncio.Event()

    @property
    def pid(self) -> int:
        return self.process.pid

    def start(self) -> None:
        """Follow the output, and arm the deadline (in the loop)."""
        self.process.relay(self)
        if self.config.deadline is not None:
            delay = max(0.0, self.config.deadline - time.time())
            self._deadline_timer = self._loop.call_later(delay, self._expire)

    def subscribe(self) -> Subscription:
        subscription = Subscription()
        if self.end is not None:
            subscription.queue.put_nowait(("end", self.end))
        elif self.failure is not None:
            subscription.queue.put_nowait(("error", self.failure))
        else:
            self._subscriptions.append(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        subscription.closed.set()
        if subscription in self._subscriptions:
            self._subscriptions.remove(subscription)

    def fail(self, error: ApiError) -> None:
        """The sandbox ended (or was paused) under the process: every stream ends with ``error``."""
        if self.end is not None or self.failure is not None:
            return
        self.failure = error
        if self._handing is not None:
            self._handing.cancel()
        self._finish(("error", error))

    async def kill(self, sig: int) -> bool:
        """Send ``sig`` to the process (and its group); False when it had already ended."""
        if self.end is not None:
            return False
        try:
            await asyncio.to_thread(self.process.kill, sig)
        except NoSuchProcess:
            return False
        return True

    # -- the relay (forkd's reader thread: post to the loop, never block) -------------------------------
    def output(self, stream: ProcessOutput, data: bytes) -> None:
        self._post((stream, data))

    def finished(self, process: GuestProcess) -> None:
        self._post(None)

    def _post(self, item: tuple[ProcessOutput, bytes] | None) -> None:
        try:
            self._loop.call_soon_threadsafe(self._take, item)
        except RuntimeError:
            pass  # the server stopped

    # -- in the loop ------------------------------------------------------------------------------------
    def _take(self, item: tuple[ProcessOutput, bytes] | None) -> None:
        self._arrived.append(item)
        if self._handing is None:
            self._handing = self._loop.create_task(self._hand_on())

    async def _hand_on(self) -> None:
        """Hand the chunks to the streams in order (waiting while the slowest is full), then the end.

        The credit of what was handed on goes back to the guest once nothing
        more waits here (in a thread: it may write to the VM's channel).
        """
        owed: dict[ProcessOutput, int] = {}
        try:
            while self._arrived:
                item = self._arrived.popleft()
                if item is None:
                    returncode = self.process.returncode
                    if returncode is not None:
                        self._exited(ProcessEnd.of(returncode))
                    # else the VM ended under it: its sandbox calls fail() with the reason
                    return
                stream, data = item
                kind = "pty" if self.config.pty else stream.name
                for subscription in list(self._subscriptions):
                    await subscription.put((kind, data))
                owed[stream] = owed.get(stream, 0) + len(data)
                if not self._arrived:
                    await asyncio.to_thread(_give_back, owed)
                    owed = {}
        finally:
            self._handing = None

    def _exited(self, end: ProcessEnd) -> None:
        if self.end is not None or self.failure is not None:
            return
        self.end = end
        self._finish(("end", end))

    def _finish(self, event: tuple[str, Any]) -> None:
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        for subscription in self._subscriptions:
            if not subscription.closed.is_set():
                try:
                    subscription.queue.put_nowait(event)
                except asyncio.QueueFull:  # a stream that does not read gets the end next
                    asyncio.ensure_future(subscription.put(event))
        self._subscriptions = []
        self.done.set()
        self._on_end(self)

    def _expire(self) -> None:
        asyncio.ensure_future(self.kill(signal_module.SIGKILL))


class ProcessTable:
    """The processes envd started in one sandbox: their configs (copied to forks), and hubs once attached."""

    def __init__(self, configs: dict[int, ProcessConfig] | None = None) -> None:
        self.configs: dict[int, ProcessConfig] = dict(configs or {})
        self._hubs: dict[int, ProcessHub] = {}
        self._vm: VM | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed: ApiError | None = None

    def bind(self, vm: VM, loop: asyncio.AbstractEventLoop) -> None:
        """Serve the processes of ``vm`` (a sandbox's VM, after it started, forked or resumed)."""
        self._vm, self._loop, self._closed = vm, loop, None
        self._hubs = {}

    def copy(self) -> dict[int, ProcessConfig]:
        """The configs of the processes still running, for a VM started from a snapshot of this one."""
        ended = {pid for pid, hub in self._hubs.items() if hub.end is not None}
        return {pid: config for pid, config in self.configs.items() if pid not in ended}

    def running(self) -> list[tuple[int, ProcessConfig]]:
        return sorted(self.configs.items())

    def find(self, pid: int | None = None, tag: str | None = None) -> int:
        """The pid of the process a selector names; 404 (NotFoundException) when there is none."""
        if tag is not None:
            for number, config in self.configs.items():
                if config.tag == tag:
                    return number
            raise ApiError(404, f"process with tag {tag!r} not found")
        if pid is None or pid not in self.configs:
            raise ApiError(404, f"process with pid {pid} not found")
        return pid

    async def start(
        self, command: list[str], config: ProcessConfig, spawn: Callable[[], GuestProcess]
    ) -> tuple[ProcessHub, Subscription]:
        """Spawn a process with ``spawn`` (blocking, in a thread) and follow it; the starting stream's subscription.

        The stream is subscribed before the output is read at all, so nothing the process writes at once is lost.
        """
        self._check_open()
        process = await asyncio.to_thread(spawn)
        self.configs[process.pid] = config
        hub = self._follow(process, config, start=False)
        subscription = hub.subscribe()
        hub.start()
        return hub, subscription

    async def hub(self, pid: int) -> ProcessHub:
        """The hub of process ``pid``, attaching to it first in a VM that has not yet (a fork, a resume)."""
        self._check_open()
        existing = self._hubs.get(pid)
        if existing is not None:
            return existing
        config = self.configs.get(pid)
        if config is None:
            raise ApiError(404, f"process with pid {pid} not found")
        vm = self._vm
        assert vm is not None
        try:
            process = await asyncio.to_thread(vm.process, pid)
        except (NoSuchProcess, ProcessError):
            self.configs.pop(pid, None)
            raise ApiError(404, f"process with pid {pid} not found (it ended)") from None
        existing = self._hubs.get(pid)  # attached meanwhile by another call
        return existing if existing is not None else self._follow(process, config)

    async def attach_all(self) -> None:
        """Follow every process this sandbox had (after a fork or resume), so deadlines and ends are seen."""
        for pid in list(self.configs):
            try:
                await self.hub(pid)
            except ApiError:
                pass

    def close(self, error: ApiError) -> None:
        """The sandbox's VM ended: every stream ends with ``error`` (the configs stay for a resume)."""
        self._closed = error
        for hub in list(self._hubs.values()):
            hub.fail(error)
        self._hubs = {}

    def _follow(self, process: GuestProcess, config: ProcessConfig, *, start: bool = True) -> ProcessHub:
        assert self._loop is not None
        hub = ProcessHub(process, config, self._loop, self._ended)
        self._hubs[process.pid] = hub
        if start:
            hub.start()
        return hub

    def _ended(self, hub: ProcessHub) -> None:
        if hub.end is not None:  # ended in the guest: forgotten (a failure keeps it for a resume)
            self.configs.pop(hub.pid, None)
            if self._hubs.get(hub.pid) is hub:
                del self._hubs[hub.pid]

    def _check_open(self) -> None:
        if self._closed is not None:
            raise self._closed


def _give_back(owed: dict[ProcessOutput, int]) -> None:
    for stream, nbytes in owed.items():
        stream.consumed(nbytes)


def with_deadline(config: ProcessConfig, timeout_ms: float | None) -> ProcessConfig:
    """``config`` with the deadline a ``Connect-Timeout-Ms`` of ``timeout_ms`` sets (none for None or 0)."""
    if not timeout_ms:
        return config
    return replace(config, deadline=time.time() + timeout_ms / 1000)
