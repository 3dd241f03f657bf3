"""The threads the E2B server reads processes' output in: reused, never fewer than the streams, daemon, ended when idle."""

from __future__ import annotations

import threading

from pytest_forkd.e2b.processes import ReaderThreads
from pytest_forkd.waiting import poll_until


def test_a_stream_after_another_ended_is_read_in_the_same_thread() -> None:
    readers = ReaderThreads()
    ran_in: list[threading.Thread] = []
    done = threading.Semaphore(0)

    def job() -> None:
        ran_in.append(threading.current_thread())
        done.release()

    readers.submit(job)
    assert done.acquire(timeout=10)
    poll_until(lambda: readers._idle == 1, timeout=10, what="the thread to be idle again")
    readers.submit(job)
    assert done.acquire(timeout=10)

    assert ran_in[0] is ran_in[1] and ran_in[0].daemon


def test_streams_that_last_each_get_a_thread_of_their_own() -> None:
    readers = ReaderThreads()
    release = threading.Event()
    running = threading.Semaphore(0)

    def blocking_read() -> None:
        running.release()
        release.wait(10)

    try:
        for _ in range(5):  # five streams at once: none waits behind another
            readers.submit(blocking_read)
        assert all(running.acquire(timeout=10) for _ in range(5))
    finally:
        release.set()


def test_an_idle_thread_ends_and_a_later_stream_still_gets_one() -> None:
    readers = ReaderThreads()
    readers.idle_seconds = 0.05
    first: list[threading.Thread] = []
    done = threading.Event()

    readers.submit(lambda: first.append(threading.current_thread()))
    poll_until(lambda: first and not first[0].is_alive(), timeout=10, what="the idle thread to end")
    assert readers._idle == 0
    readers.submit(done.set)

    assert done.wait(10)
