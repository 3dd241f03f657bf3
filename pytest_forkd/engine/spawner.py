"""Start VMM processes that die with their owner.

``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child exits, not
the process. Forks are started from worker threads (``snapshot.fork(n)``
starts children concurrently), so every ``Popen`` goes through one long-lived
daemon thread: the children then die exactly when this process dies, even on
``kill -9``.
"""

from __future__ import annotations

import ctypes
import queue
import signal
import subprocess
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Sequence, cast

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


#: Seconds a process start (fork, then exec) may take before the caller gives up on it.
SPAWN_TIMEOUT_S = 30.0


class SpawnTimeout(OSError):
    """Starting a process did not complete in time (an OSError, so callers report it as a failed start)."""


def _kill_late(future: Future[subprocess.Popen[bytes]]) -> None:
    """A process started after its caller gave up: nobody owns it, so it is killed."""
    if future.exception() is None:
        process = future.result()
        process.kill()
        process.wait()


# What a caller hands the spawner thread: the command, Popen's keyword arguments, whether the child's
# death signal is set between fork and exec, and where the child goes.
_Request = tuple[Sequence[str], dict[str, Any], bool, Future[subprocess.Popen[bytes]]]


class _Spawner:
    def __init__(self) -> None:
        self._requests: queue.SimpleQueue[_Request] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _serve(self) -> None:
        requests = self._requests  # a spawner given up on keeps serving only its own queue
        while True:
            argv, kwargs, die_with_parent, future = requests.get()
            try:
                preexec = _die_with_parent if die_with_parent else None
                # Children talk bytes: the opaque keyword arguments never select text mode.
                process = cast("subprocess.Popen[bytes]", subprocess.Popen(argv, preexec_fn=preexec, **kwargs))
                future.set_result(process)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)

    def popen(
        self, argv: Sequence[str], *, timeout: float = SPAWN_TIMEOUT_S, die_with_parent: bool = True, **kwargs: Any
    ) -> subprocess.Popen[bytes]:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="forkd-spawner", daemon=True)
                self._thread.start()
            requests = self._requests
        future: Future[subprocess.Popen[bytes]] = Future()
        requests.put((argv, kwargs, die_with_parent, future))
        try:
            return future.result(timeout=timeout)
        except FutureTimeout:
            pass
        # The spawner is stuck (a fork that never reached exec): give up on it, kill what it may
        # still start, and let the next spawn start a fresh spawner with a queue of its own.
        future.add_done_callback(_kill_late)
        with self._lock:
            if self._requests is requests:
                self._requests = queue.SimpleQueue()
                self._thread = None
        raise SpawnTimeout(
            f"starting {argv[0]} did not complete within {timeout:.0f} s (fork and exec of the process "
            "hung); the next start uses a fresh spawner thread"
        )


_spawner = _Spawner()


def spawn(
    argv: Sequence[str], *, timeout: float = SPAWN_TIMEOUT_S, die_with_parent: bool = True, **kwargs: Any
) -> subprocess.Popen[bytes]:
    """``subprocess.Popen`` whose child is SIGKILLed when this process dies.

    Bounded: a start that does not complete within ``timeout`` seconds raises
    :class:`SpawnTimeout` (an OSError) instead of blocking its caller forever.

    ``die_with_parent=False`` is for a program that sets ``PR_SET_PDEATHSIG``
    itself, first thing (it still counts from the spawner thread, its parent):
    with no Python code to run between fork and exec, the start can use
    ``vfork``, a millisecond instead of some 15 from a process of a few hundred
    MB (a test run's), which copies its page tables to fork.
    """
    return _spawner.popen(argv, timeout=timeout, die_with_parent=die_with_parent, **kwargs)
