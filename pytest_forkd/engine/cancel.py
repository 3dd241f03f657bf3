"""Cancellation: SIGTERM, SIGHUP and SIGINT stop a process that runs VMs within seconds, leaving nothing.

CI cancels a job with SIGTERM and kills it with SIGKILL after a grace period
(GitLab and GitHub Actions: about 10 s); a closed terminal sends SIGHUP,
Ctrl-C SIGINT. By default SIGTERM and SIGHUP end Python at once, without
``finally`` blocks: QEMU processes still die with their owner (see
:mod:`.spawner`), but the run directory stays until the next run cleans it.

So the first of these signals becomes a :class:`KeyboardInterrupt`, as Ctrl-C
already is: pytest stops, fixtures and sessions close, a snapshot being
written is discarded (it was never published, so it is not listed and the
next run builds it again), and the run directory is removed. A watchdog
bounds the wait: if the process has not ended :data:`GRACE_S` seconds after
the signal (a cleanup that hangs, a thread that does not stop), it kills
every QEMU of this process, removes its run directories and exits with
128 + the signal number. A second signal does that at once.

Handlers are installed only from the main thread, and only over the default
disposition: a signal someone else handles (or ignores, as ``nohup`` does
with SIGHUP) is left alone.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Callable

#: Seconds from the first signal to the forced exit: inside CI's usual 10 s before SIGKILL would be too tight
#: for a clean stop of several VMs, so the forced exit comes after 8 s.
GRACE_S = 8.0
SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)

_lock = threading.Lock()
_installed: set[int] = set()
_received: list[int] = []
_emergency: list[Callable[[], None]] = []


def on_emergency(cleanup: Callable[[], None]) -> None:
    """Run ``cleanup`` (fast, never raising) before a forced exit: kill VMs, remove run directories."""
    with _lock:
        _emergency.append(cleanup)


def install() -> bool:
    """Install the handlers (idempotent); False when not in the main thread, where Python allows none."""
    if threading.current_thread() is not threading.main_thread():
        return False
    for number in SIGNALS:
        if number in _installed:
            continue
        current = signal.getsignal(number)
        default = signal.default_int_handler if number == signal.SIGINT else signal.SIG_DFL
        if current is not default:
            continue  # handled (or ignored) by someone else
        signal.signal(number, _handle)
        _installed.add(number)
    return True


def _handle(number: int, frame: FrameType | None) -> None:
    if _received:  # the second signal: no more waiting
        _force_exit(number, "a second signal")
    _received.append(number)
    threading.Thread(target=_watchdog, args=(number,), name="forkd-cancel-watchdog", daemon=True).start()
    raise KeyboardInterrupt(f"{signal.Signals(number).name} received: stopping, and killing this run's VMs")


def _watchdog(number: int) -> None:
    time.sleep(GRACE_S)
    _force_exit(number, f"still running {GRACE_S:g} s after the signal")


def _force_exit(number: int, why: str) -> None:
    try:
        sys.stderr.write(f"forkd: {signal.Signals(number).name}: {why}; killing this run's VMs and exiting\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    with _lock:
        cleanups = list(_emergency)
    for cleanup in cleanups:
        try:
            cleanup()
        except BaseException:  # noqa: BLE001 - exiting anyway; the next run cleans what is left
            pass
    os._exit(128 + number)
