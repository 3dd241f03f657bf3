"""The asyncio plumbing without VMs: loop binding, worker threads, discarding, uninterruptible waits."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pytest_forkd.aio.offload import LoopGuard, offload, running_loop, uninterruptible
from pytest_forkd.errors import ForkdError, WrongEventLoop


def test_a_guard_binds_to_the_first_loop_and_refuses_others() -> None:
    guard = LoopGuard("handle H")

    async def use() -> asyncio.AbstractEventLoop:
        return guard.check("doing X")

    first = asyncio.run(use())
    assert guard.loop is first

    with pytest.raises(WrongEventLoop, match="handle H belongs to the event loop that first used it .closed."):
        asyncio.run(use())


def test_a_guard_made_inside_a_loop_belongs_to_it() -> None:
    async def make() -> LoopGuard:
        return LoopGuard("handle H")

    guard = asyncio.run(make())

    assert guard.loop is not None and guard.loop.is_closed()


def test_awaiting_outside_a_loop_is_a_forkd_error() -> None:
    with pytest.raises(WrongEventLoop, match="running asyncio event loop") as caught:
        running_loop("exec")
    assert isinstance(caught.value, ForkdError)


def test_offloaded_calls_run_concurrently_and_return_their_results() -> None:
    barrier = threading.Barrier(3, timeout=5)

    def meet(n: int) -> int:
        barrier.wait()  # only passes if all three run at the same time
        return n

    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        return await asyncio.gather(*(offload(loop, lambda n=n: meet(n), name=f"t{n}") for n in range(3)))

    assert asyncio.run(main()) == [0, 1, 2]


def test_errors_of_offloaded_calls_reach_the_awaiting_task() -> None:
    def fail() -> None:
        raise ForkdError("boom")

    async def main() -> None:
        await offload(asyncio.get_running_loop(), fail, name="fail")

    with pytest.raises(ForkdError, match="boom"):
        asyncio.run(main())


def test_the_result_of_a_cancelled_call_is_discarded() -> None:
    release = threading.Event()
    discarded: list[str] = []
    done = threading.Event()

    def slow() -> str:
        release.wait(5)
        return "started VM"

    def discard(result: str) -> None:
        discarded.append(result)
        done.set()

    async def main() -> None:
        future = offload(asyncio.get_running_loop(), slow, name="slow", discard=discard)
        task = asyncio.ensure_future(future)
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        for _ in range(500):  # the loop stays up until the finished call's result was discarded
            if done.is_set():
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())

    assert done.wait(5) and discarded == ["started VM"]


def test_an_uninterruptible_call_finishes_before_the_cancellation_goes_through() -> None:
    finished: list[float] = []

    def change_in_place() -> None:
        time.sleep(0.15)
        finished.append(time.monotonic())

    async def main() -> float:
        task = asyncio.create_task(uninterruptible(offload(asyncio.get_running_loop(), change_in_place, name="c")))
        await asyncio.sleep(0.03)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic()

    cancelled_at = asyncio.run(main())

    assert finished and finished[0] <= cancelled_at


def test_a_following_guard_moves_to_the_loop_in_use_when_idle_only() -> None:
    guard = LoopGuard("parent P", follow=True)

    async def use() -> asyncio.AbstractEventLoop:
        return guard.check("doing X")

    first = asyncio.run(use())
    second = asyncio.run(use())
    assert first is not second and guard.loop is second

    async def hold_then_let_another_thread_try() -> BaseException | None:
        guard.acquire("a long operation")
        try:
            errors: list[BaseException] = []

            def other_loop() -> None:
                try:
                    asyncio.run(use())
                except BaseException as exc:  # noqa: BLE001 - inspected below
                    errors.append(exc)

            await asyncio.to_thread(other_loop)
            return errors[0] if errors else None
        finally:
            guard.release()

    error = asyncio.run(hold_then_let_another_thread_try())
    assert isinstance(error, WrongEventLoop) and "in use by another event loop" in str(error)
