"""AsyncGuestProcess: a spawned guest process, awaited (``proc = await avm.spawn(...)``).

A thin layer over :class:`~pytest_forkd.core.process.GuestProcess`, like
:class:`~pytest_forkd.aio.vm.AsyncVM` over the VM: every blocking call runs
in a worker thread (see :mod:`pytest_forkd.aio.offload`) and the event loop
awaits it. ``async for line in proc.stdout`` yields lines as the process
writes them; ``await proc.wait()``, ``await proc.write_stdin(...)``,
``await proc.kill()`` mirror the sync handle.

Cancelling an awaited read or wait does not lose anything: the worker
thread waits in slices of :data:`SLICE` seconds and stops at the next one,
and a line it had already taken is put back for the next read, which starts
only once that worker is done (reads of one stream run one at a time). The process
itself keeps running (kill it to stop it); an ``async with`` block kills it
when it ends.
"""

from __future__ import annotations

import signal as signal_module
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

from ..errors import ProcessTimeout

if TYPE_CHECKING:
    from pytest_forkd.core.process import GuestProcess, ProcessOutput

T = TypeVar("T")


class _Offloading(Protocol):
    """The :class:`~pytest_forkd.aio.vm.AsyncVM` of a process, as its handle uses it: to run blocking calls."""

    async def _offload(
        self,
        what: str,
        name: str,
        call: Callable[[], T],
        *,
        discard: Callable[[T], None] | None = None,
        in_place: bool = False,
    ) -> T: ...


#: How often a worker thread waiting for output or for the process checks whether its awaiter went away.
SLICE = 0.5


def _sliced(wait: Callable[[float | None], T], timeout: float | None, stop: threading.Event, what: str) -> T | None:
    """Call ``wait(seconds)`` in slices until it returns, ``timeout`` runs out (ProcessTimeout) or ``stop`` is set."""
    import time

    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        step = SLICE if left is None else max(min(SLICE, left), 0.0)
        try:
            return wait(step)
        except ProcessTimeout:
            if stop.is_set():
                return None
            if left is not None and left <= step:
                raise ProcessTimeout(
                    f"{what} did not finish within {timeout:g} s; the process keeps running, "
                    "and output that arrived stays for the next read"
                ) from None


class AsyncProcessOutput:
    """``stdout`` or ``stderr`` of an :class:`AsyncGuestProcess`: ``async for line in proc.stdout``."""

    def __init__(self, output: ProcessOutput, process: AsyncGuestProcess) -> None:
        self._output = output
        self._process = process
        self._reading = threading.Lock()

    @property
    def sync(self) -> ProcessOutput:
        return self._output

    @property
    def skipped(self) -> int:
        return self._output.skipped

    def __aiter__(self) -> AsyncProcessOutput:
        return self

    async def __anext__(self) -> bytes:
        line = await self.readline()
        if not line:
            raise StopAsyncIteration
        return line

    async def readline(self, timeout: float | None = None) -> bytes:
        """The next line (``b""`` at the end of the stream); ProcessTimeout after ``timeout`` seconds."""
        return await self._read("readline", self._output.readline, timeout)

    async def read(self, timeout: float | None = None) -> bytes:
        """Everything up to the end of the stream."""
        return await self._read("read", self._output.read, timeout)

    async def read_chunk(self, timeout: float | None = None) -> bytes:
        """Whatever arrived and was not read yet, as soon as there is any (``b""`` at the end)."""
        return await self._read("read_chunk", self._output.read_chunk, timeout)

    async def _read(self, name: str, read: Callable[[float | None], bytes], timeout: float | None) -> bytes:
        stop = threading.Event()
        what = f"reading the {self._output.name} of process {self._process.pid}"

        def take() -> bytes:
            # One worker reads this stream at a time: the worker of a cancelled read may still be
            # in its slice, and a line it takes then must be back before the next read starts.
            with self._reading:
                data = _sliced(read, timeout, stop, what) or b""
                if stop.is_set():  # its awaiter went away meanwhile
                    self._output._unread(data)
                    return b""
                return data

        try:
            data = await self._process._vm._offload(
                what, f"{name}-{self._process.pid}", take, discard=self._output._unread
            )
        finally:
            stop.set()
        return data


class AsyncGuestProcess:
    """asyncio handle of a :class:`~pytest_forkd.core.process.GuestProcess` (see :meth:`AsyncVM.spawn`)."""

    def __init__(self, process: GuestProcess, vm: _Offloading) -> None:
        self._process = process
        self._vm = vm
        self.stdout = AsyncProcessOutput(process.stdout, self)
        self.stderr = AsyncProcessOutput(process.stderr, self)

    @property
    def sync(self) -> GuestProcess:
        """The synchronous handle (same process; for synchronous code)."""
        return self._process

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def command(self) -> str | tuple[str, ...]:
        return self._process.command

    @property
    def returncode(self) -> int | None:
        """None while the process runs; then its exit code, ``-N`` if signal N killed it."""
        return self._process.returncode

    @property
    def truncated(self) -> bool:
        return self._process.truncated

    def __repr__(self) -> str:
        return f"<AsyncGuestProcess of {self._process!r}>"

    async def wait(self, timeout: float | None = None) -> int:
        """``GuestProcess.wait``, awaited; cancelling it leaves the process running."""
        stop = threading.Event()
        try:
            what = f"waiting for process {self.pid}"
            code = await self._vm._offload(
                what, f"wait-{self.pid}", lambda: _sliced(self._process.wait, timeout, stop, what)
            )
        finally:
            stop.set()
        assert code is not None
        return code

    async def write_stdin(self, data: bytes | str) -> None:
        """``GuestProcess.write_stdin``, awaited."""
        await self._vm._offload(
            f"writing to the stdin of process {self.pid}", f"stdin-{self.pid}", lambda: self._process.write_stdin(data)
        )

    async def close_stdin(self) -> None:
        await self._vm._offload(
            f"closing the stdin of process {self.pid}", f"stdin-{self.pid}", self._process.close_stdin
        )

    async def kill(self, sig: int = signal_module.SIGTERM) -> None:
        """``GuestProcess.kill``, awaited: send ``sig`` (default SIGTERM)."""
        await self._vm._offload(f"signalling process {self.pid}", f"kill-{self.pid}", lambda: self._process.kill(sig))

    send_signal = kill

    async def terminate(self) -> None:
        await self.kill(signal_module.SIGTERM)

    async def resize(self, rows: int, columns: int) -> None:
        await self._vm._offload(
            f"resizing the terminal of process {self.pid}",
            f"resize-{self.pid}",
            lambda: self._process.resize(rows, columns),
        )

    async def __aenter__(self) -> AsyncGuestProcess:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Kill the process (SIGKILL, with its process group) if it still runs."""
        await self._vm._offload(
            f"ending process {self.pid}", f"exit-{self.pid}", lambda: self._process.__exit__(None, None, None)
        )
