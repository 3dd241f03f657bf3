"""Running the blocking core from asyncio: worker threads, futures, and the loop a handle belongs to.

The engine (QEMU processes, QMP, storage backends, file copies) and the agent
client are blocking and thread-safe, and every VM operation already waits on
its own: the agent client multiplexes any number of requests from any number
of threads over one channel. So an awaited operation runs the blocking call
in a thread of its own and the event loop waits on an :class:`asyncio.Future`
that the thread completes with ``loop.call_soon_threadsafe``. A thread per
operation in flight rather than a pool: a pool would queue the fifth
``sleep 30`` behind four others and turn concurrency back into a queue.

An operation whose awaiting task is cancelled cannot be stopped half-way in
the host (a QEMU being started must be waited for, or it leaks): either its
result is *discarded* when it arrives (``discard`` closes the VMs a cancelled
fork started), or the cancellation waits until the operation is over
(:func:`uninterruptible`, for operations that change an existing VM).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import TypeVar

from ..errors import WrongEventLoop

T = TypeVar("T")

log = logging.getLogger(__name__)


def running_loop(what: str) -> asyncio.AbstractEventLoop:
    """The running event loop, or a WrongEventLoop error saying that ``what`` needs one."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        raise WrongEventLoop(
            f"{what} must be awaited in a running asyncio event loop (inside `async def`, run by "
            "asyncio.run, pytest-asyncio or anyio with its asyncio backend; trio is not supported); "
            "in synchronous code use the VM API instead"
        ) from None


class LoopGuard:
    """Ties an async handle to the event loop that first uses it, and refuses every other loop.

    Futures of one loop cannot be awaited from another, and a handle shared
    by two loops (two threads, or ``asyncio.run`` twice) would mix their
    cancellations: refusing it up front gives one clear error instead.

    ``follow``: the handle moves to whichever loop uses it while no operation
    of it is in flight. That is for a handle whose VM outlives event loops on
    purpose (the session's parent, used by one test loop after another).
    """

    def __init__(self, what: str, loop: asyncio.AbstractEventLoop | None = None, *, follow: bool = False) -> None:
        self._what = what
        self._follow = follow
        self._lock = threading.Lock()
        self._in_flight = 0
        self._loop = loop
        if loop is None:
            try:
                self._loop = asyncio.get_running_loop()
            except RuntimeError:
                pass  # made outside a loop (a fixture, for example): bound when first awaited

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop

    def check(self, operation: str) -> asyncio.AbstractEventLoop:
        """The running loop, after making sure it is this handle's (binding it on first use)."""
        loop = self.acquire(operation)
        self.release()
        return loop

    def acquire(self, operation: str) -> asyncio.AbstractEventLoop:
        """Like :meth:`check`, and count an operation in flight until :meth:`release`."""
        loop = running_loop(f"{self._what}: {operation}")
        with self._lock:
            if self._loop is None or (self._follow and self._in_flight == 0):
                self._loop = loop
            bound = self._loop
            if bound is loop:
                self._in_flight += 1
        if bound is not loop:
            if self._follow:
                raise WrongEventLoop(
                    f"{self._what} is in use by another event loop (an operation of it has not finished), "
                    f"so it cannot be used for {operation} in thread {threading.current_thread().name!r}; "
                    "use it from one event loop at a time"
                )
            state = "closed" if bound.is_closed() else "another, still open"
            raise WrongEventLoop(
                f"{self._what} belongs to the event loop that first used it ({state}), not to the one "
                f"running {operation} in thread {threading.current_thread().name!r}; an async handle "
                "works in one event loop only: wrap the VM again for this loop with "
                "AsyncVM(handle.sync) (the VM itself is shared safely), or keep all its use in one loop"
            )
        return loop

    def release(self) -> None:
        with self._lock:
            self._in_flight -= 1


def offload(
    loop: asyncio.AbstractEventLoop, function: Callable[[], T], *, name: str, discard: Callable[[T], None] | None = None
) -> asyncio.Future[T]:
    """Run blocking ``function`` in a new thread; the returned future completes in ``loop``.

    If the future was cancelled (or the loop closed) by the time ``function``
    returns, its result goes to ``discard`` (in a thread, never in the loop),
    so that what it started is not leaked.
    """
    future: asyncio.Future[T] = loop.create_future()

    def throw_away(result: T) -> None:
        if discard is None:
            return
        try:
            discard(result)
        except Exception:  # noqa: BLE001 - nobody is left to raise to
            log.warning("discarding the result of a cancelled %s failed", name, exc_info=True)

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.cancelled():
            if error is None and discard is not None:
                threading.Thread(target=throw_away, args=(result,), name=f"{name}-discard", daemon=True).start()
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def work() -> None:
        result: T | None = None
        error: BaseException | None = None
        try:
            result = function()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            error = exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is closed: nobody will ever take the result
            if error is None:
                throw_away(result)  # type: ignore[arg-type]

    threading.Thread(target=work, name=name, daemon=True).start()
    return future


async def settled(future: asyncio.Future[T]) -> None:
    """Wait until ``future`` is done, even if the waiting task is cancelled again meanwhile; never raises.

    Used to finish the work a cancellation triggers. Cancellations that arrive
    meanwhile are absorbed: anyio delivers a cancel scope's cancellation again
    at every turn of the loop, and giving up on the first of them would let
    the cancellation through before the guest confirmed it. The futures waited
    on here are bounded (the agent client's own timeouts).
    """
    while not future.done():
        try:
            await asyncio.wait({future})
        except asyncio.CancelledError:
            continue
    if not future.cancelled():
        future.exception()  # retrieved: no "exception was never retrieved" warning


async def uninterruptible(future: asyncio.Future[T]) -> T:
    """Await ``future``; if cancelled meanwhile, let the operation finish first, then re-raise.

    For operations that change a VM in place (restore, rollback, close): a
    cancellation that returned while one runs would leave the VM half
    changed, still changing, and the caller none the wiser.
    """
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await settled(future)
        raise
