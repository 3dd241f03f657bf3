"""The children of ``sandbox.fork(count)``: committed when the call answers, restored in the background.

E2B's fork answers with ``count`` sandboxes that have the source's state and
run under their own ids. Here the state is fixed when the call branches the
source (one snapshot, taken under the source's lock, before the call
answers); what remains per child is starting its VM from that snapshot: a
QEMU process of its own, whose start costs 25-45 ms of CPU under TCG however
little the guest does, and its device state. Done inside the call, ten
children cost the call ten of those on the host's cores; so the call commits
the children (ids, tokens, timeouts, their hold on the snapshot) and answers,
and :class:`ForkRestores` restores each on a thread of its own meanwhile.

A child being restored is a running sandbox to the API (E2B's sandboxes are
``running`` or ``paused``, there is no starting state): ``Sandbox.list()`` and
``get_info`` show it, and every call to it waits for its restore
(:attr:`Sandbox.starting`): an in-sandbox call at the gate, kill, pause,
fork, snapshot and connect on the sandbox's lock, which the restore holds.
Then its first request waits in the VM's channel until its guest agent
answers, within the usual readiness timeout. A child whose restore fails is
removed, and its calls, those already waiting and later ones, get the start
error (502, "was not found", with the reason), as a call to a VM that
never came up does. What the call's time means is in docs/performance.md:
the branch, not the restores; the bench reports the time until every child
has answered a command beside it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from pytest_forkd.core.factory import UNREADY_FORK_THREADS
from pytest_forkd.e2b.api_errors import ApiError, as_api_error

if TYPE_CHECKING:
    from pytest_forkd.core.factory import VMFactory
    from pytest_forkd.core.vm import VM
    from pytest_forkd.e2b.sandbox import Sandbox
    from pytest_forkd.storage.snapshot import Snapshot

log = logging.getLogger("pytest_forkd.e2b")


class ForkRestores:
    """Restores the children of forks on threads of their own (at most :data:`UNREADY_FORK_THREADS` at once).

    Their own pool, not the event loop's default one: ten restores must not
    hold up the calls of every other sandbox (which run there) while they last.
    """

    def __init__(self) -> None:
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    async def start(
        self,
        child: Sandbox,
        snapshot: Snapshot,
        factory: VMFactory,
        *,
        adopt: Callable[[Sandbox, VM], None],
        fail: Callable[[Sandbox, ApiError], None],
        what: str,
    ) -> asyncio.Task[None]:
        """Begin restoring ``child`` from ``snapshot``; returns the task that ends with ``adopt`` or ``fail``.

        The child's lock is taken before this returns and held until the
        restore ended; ``child.starting`` is set until then. ``adopt`` makes
        the restored VM the child's (it is closed instead if the child is gone
        by then); ``fail`` removes the child with the error its calls get.
        """
        loop = asyncio.get_running_loop()
        await child.lock.acquire()  # a fresh child's lock: taken at once
        child.starting = loop.create_future()
        child.starting.add_done_callback(_consume)
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=UNREADY_FORK_THREADS, thread_name_prefix="forkd-e2b-fork"
            )
        restore = functools.partial(factory.fork_snapshot, snapshot, 1, wait_ready=False)
        return asyncio.ensure_future(_restore(self._executor, child, restore, adopt, fail, what))

    def close(self) -> None:
        """No more restores (the server stops once its sandboxes, and so their restores, have ended)."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)


async def _restore(
    executor: concurrent.futures.Executor,
    child: Sandbox,
    restore: Callable[[], list[VM]],
    adopt: Callable[[Sandbox, VM], None],
    fail: Callable[[Sandbox, ApiError], None],
    what: str,
) -> None:
    """The restore, begun once this task first runs: after the fork's answer was written (the task that
    made it does not yield in between), which ten restores starting on the cores would otherwise delay."""
    starting = child.starting
    assert starting is not None
    try:
        try:
            work = asyncio.get_running_loop().run_in_executor(executor, restore)
        except RuntimeError:  # the executor was shut down: the server stops
            _give_up(child, starting, fail, ApiError(503, f"{what}: the server is stopping"))
            return
        try:
            vm = (await asyncio.shield(work))[0]
        except asyncio.CancelledError:  # the server stops: the VM, when it comes, is closed
            work.add_done_callback(_close_result)
            _give_up(child, starting, fail, ApiError(503, f"{what}: the server is stopping"))
            raise
        except Exception as exc:  # noqa: BLE001 - every failure is the child's start error
            log.warning("%s failed: %s", what, exc)
            _give_up(child, starting, fail, as_api_error(exc, what, child.id))
            return
        try:
            adopt(child, vm)
        except BaseException as exc:
            await asyncio.to_thread(vm.close)
            _give_up(child, starting, fail, as_api_error(exc, what, child.id))
            if not isinstance(exc, Exception):
                raise
            return
        child.starting = None
        starting.set_result(None)
    finally:
        child.lock.release()


def _give_up(
    child: Sandbox, starting: asyncio.Future[None], fail: Callable[[Sandbox, ApiError], None], error: ApiError
) -> None:
    """The child is removed, and its calls, waiting and later, get ``error``."""
    fail(child, error)
    starting.set_exception(error)


async def started(sandbox: Sandbox) -> None:
    """Wait until ``sandbox`` (a fork's child) is restored; raises its start error if it never was."""
    starting = sandbox.starting
    if starting is not None:
        await asyncio.shield(starting)


def _consume(future: asyncio.Future[None]) -> None:
    """Nobody may be waiting when a restore fails: its error is read here, so asyncio does not warn of it."""
    if not future.cancelled():
        future.exception()


def _close_result(future: asyncio.Future[list[VM]]) -> None:
    if future.cancelled() or future.exception() is not None:
        return
    for vm in future.result():
        try:
            vm.close()
        except Exception as exc:  # noqa: BLE001 - the factory kills it when it closes anyway
            log.warning("closing VM %s of a fork the server no longer wanted failed: %s", vm.name, exc)
