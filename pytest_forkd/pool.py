"""A pool of pre-restored children of one snapshot.

Restoring a child costs ~150 ms under TCG, most of it the guest's first reply
(code translated for the first time). A pool keeps ``size`` children restored
and answering in the background, so handing one out costs a few tens of ms.
Children nobody took are killed when the pool closes.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .vm import VM

log = logging.getLogger(__name__)


class ChildPool:
    """Keeps up to ``size`` ready children made by ``launch``; refills in one background thread."""

    def __init__(self, launch: Callable[[], "VM"], size: int, name: str = "pool") -> None:
        self.size = size
        self._launch = launch
        self._ready: deque[VM] = deque()
        self._lock = threading.Lock()
        self._wanted = threading.Event()
        self._closed = False
        self.failures = 0
        self._thread = threading.Thread(target=self._refill, name=f"forkd-{name}", daemon=True)
        if size > 0:
            self._wanted.set()
            self._thread.start()

    def take(self) -> "VM | None":
        """A ready child, or None when the pool is empty (the caller then restores one itself)."""
        with self._lock:
            while self._ready:
                vm = self._ready.popleft()
                if not vm.closed and vm.machine.alive():
                    self._wanted.set()
                    return vm
                vm.close()
            self._wanted.set()
            return None

    def __len__(self) -> int:
        with self._lock:
            return len(self._ready)

    def _refill(self) -> None:
        while not self._closed:
            self._wanted.wait()
            with self._lock:
                if self._closed:
                    return
                if len(self._ready) >= self.size:
                    self._wanted.clear()
                    continue
            try:
                vm = self._launch()
            except Exception:  # noqa: BLE001 - a pool is an optimisation; forks still work without it
                self.failures += 1
                log.warning("pre-restoring a pooled child failed", exc_info=True)
                if self.failures >= 3:
                    return
                continue
            with self._lock:
                if self._closed:
                    vm.close()
                    return
                self._ready.append(vm)

    def close(self) -> None:
        """Stop refilling and kill every child nobody took."""
        with self._lock:
            self._closed = True
            ready, self._ready = list(self._ready), deque()
        self._wanted.set()
        for vm in ready:
            vm.close()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)
