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
from typing import Any, Sequence, cast

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


# What a caller hands the spawner thread: the command, Popen's keyword arguments, and where the child goes.
_Request = tuple[Sequence[str], dict[str, Any], Future[subprocess.Popen[bytes]]]


class _Spawner:
    def __init__(self) -> None:
        self._requests: queue.SimpleQueue[_Request] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _serve(self) -> None:
        while True:
            argv, kwargs, future = self._requests.get()
            try:
                # Children talk bytes: the opaque keyword arguments never select text mode.
                process = cast("subprocess.Popen[bytes]", subprocess.Popen(argv, preexec_fn=_die_with_parent, **kwargs))
                future.set_result(process)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="forkd-spawner", daemon=True)
                self._thread.start()
        future: Future[subprocess.Popen[bytes]] = Future()
        self._requests.put((argv, kwargs, future))
        return future.result()


_spawner = _Spawner()


def spawn(argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen`` whose child is SIGKILLed when this process dies."""
    return _spawner.popen(argv, **kwargs)
