"""The VM handle: what tests and agents hold.

A :class:`VM` pairs one QEMU process (:class:`~pytest_forkd.engine.qemu.Machine`)
with the guest agent's connection. It turns channel failures into
:class:`GuestCrashed` errors that carry the console tail, records how long
every operation took, and keeps a short history of recent commands for
failure reports. VMs are created by a :class:`~pytest_forkd.factory.VMFactory`,
which owns them and kills them all on close.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from . import timings
from .engine.qemu import Machine
from .errors import ExecTimeout, VMError
from .exec_result import ExecResult
from .guest.client import AgentClient, AgentTimeout, ChannelClosed

if TYPE_CHECKING:
    from .checkpoint import Checkpoint
    from .factory import VMFactory
    from .image import Image
    from .snapshot import Snapshot

HISTORY_LENGTH = 20


class VM:
    """A running microVM. Use as a context manager or call :meth:`close`."""

    def __init__(self, machine: Machine, agent: AgentClient, *, factory: "VMFactory", image: "Image",
                 origin: "Snapshot | None" = None, memory_base: "Snapshot | None" = None) -> None:
        self._machine = machine
        self._agent = agent
        self._factory = factory
        self.image = image
        self.origin = origin
        """The snapshot this VM was forked or restored from (None for a booted root VM)."""
        self.memory_base = memory_base
        """The snapshot whose flat memory file this VM maps copy-on-write (diffs are taken against it)."""
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_LENGTH)
        self.generation = 0
        """Bumped by every operation that may change guest state (exec, write_file, restore)."""
        self._cold = True
        self._closed = False
        self._lock = threading.RLock()

    # -- identity -------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._machine.name

    @property
    def memory_mib(self) -> int:
        return self._machine.spec.memory_mib

    @property
    def factory(self) -> "VMFactory":
        return self._factory

    @property
    def machine(self) -> Machine:
        """The engine-level process (for storage backends and diagnostics)."""
        return self._machine

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"pid {self._machine.pid}"
        return f"<VM {self.name} {self.memory_mib} MiB image={self.image.name} {state}>"

    # -- guest operations -------------------------------------------------------
    def exec(self, command: str | Sequence[str], *, timeout: float | None = None,
             env: Mapping[str, str] | None = None, cwd: str | None = None,
             stdin: bytes | str | None = None, check: bool = False) -> ExecResult:
        """Run ``command`` in the guest: a str runs under ``/bin/sh -c``, a list is an argv.

        Raises :class:`ExecTimeout` (with the partial output) when ``timeout``
        expires, :class:`GuestCrashed` if the guest dies meanwhile, and
        :class:`ExecError` for a non-zero exit when ``check`` is true.
        """
        started = time.perf_counter()
        self.generation += 1
        entry: dict[str, Any] = {"command": command if isinstance(command, str) else list(command)}
        self.history.append(entry)
        try:
            result = self._call(f"running {command!r}", self._agent.exec, command, timeout=timeout,
                                env=env, cwd=cwd, stdin=stdin)
        except ExecTimeout:
            entry.update(exit_code=None, timed_out=True)
            raise
        finally:
            elapsed = (time.perf_counter() - started) * 1000
            entry["ms"] = round(elapsed, 2)
            self.record_timing("exec", elapsed)
        entry["exit_code"] = result.exit_code
        if check:
            result.check()
        return result

    def write_file(self, path: str, data: bytes | str, *, mode: int | None = None) -> None:
        """Write ``data`` to ``path`` in the guest (atomically, binary-safe)."""
        self.generation += 1
        self._call(f"writing {path}", self._agent.write_file, path, data, mode=mode)

    def read_file(self, path: str) -> bytes:
        """Return the contents of ``path`` in the guest."""
        return self._call(f"reading {path}", self._agent.read_file, path)

    def ping(self, timeout: float = 10.0) -> dict:
        """Round trip to the agent; raises if the guest does not answer."""
        return self._call("answering a ping", self._agent.ping, timeout=timeout)

    def console_tail(self, lines: int = 40) -> str:
        return self._machine.console_tail(lines)

    # -- snapshots --------------------------------------------------------------
    def branch(self, tag: str | None = None, *, backend: str | None = None) -> "Snapshot":
        """Snapshot this running VM (short pause, it keeps running) with a storage backend."""
        from .branching import branch

        return branch(self, tag, backend=backend)

    def fork(self, n: int = 1, *, backend: str | None = None) -> list["VM"]:
        """Branch this VM, then start ``n`` copy-on-write children of that snapshot."""
        return self.branch(backend=backend).fork(n)

    def restore(self, snapshot: "Snapshot") -> None:
        """Roll this VM back to ``snapshot`` in place: same handle, state as at the snapshot."""
        self._ensure_open("restoring a snapshot")
        self._factory.restore_into(self, snapshot)

    def checkpoint(self, tag: str | None = None, *, backend: str | None = None) -> "Checkpoint":
        """Snapshot this VM before something destructive; a context manager that rolls back on exit."""
        from .checkpoint import Checkpoint

        started = time.perf_counter()
        snapshot = self.branch(tag, backend=backend)
        self.record_timing("checkpoint", (time.perf_counter() - started) * 1000, backend=snapshot.backend)
        return Checkpoint(self, snapshot)

    def freeze(self, tag: str, *, store: Any = None, keep_running: bool = True) -> "Snapshot":
        """Turn this booted root VM into base snapshot ``tag`` (it continues as a child if asked)."""
        from .branching import freeze

        return freeze(self, tag, store=store or self._factory.session_store, keep_running=keep_running)

    # -- lifecycle --------------------------------------------------------------
    def close(self) -> None:
        """Kill the VM and remove everything it created. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._agent.close()
        self._machine.kill()
        self._factory._forget(self)

    def __enter__(self) -> "VM":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals used by the factory and storage backends -------------------
    @property
    def agent(self) -> AgentClient:
        return self._agent

    def record_timing(self, op: str, ms: float, **fields: Any) -> None:
        """Record one timed operation on this VM (cold = the first since it started)."""
        timings.record(op, ms, memory_mib=self.memory_mib, cold=self._cold, **fields)
        self._cold = False

    def recover_after_failed_pause(self) -> None:
        """After a failed snapshot: resume the VM and make sure it answers, or report it dead."""
        try:
            if self._machine.alive() and self._machine.status() != "running":
                self._machine.resume()
        except VMError:
            pass
        self.ping(timeout=30)

    def take_over(self, other: "VM", origin: "Snapshot", memory_base: "Snapshot | None") -> None:
        """Become ``other`` (a fresh child of ``origin``): used by restore to keep this handle."""
        with self._lock:
            old_machine, old_agent = self._machine, self._agent
            self._machine, self._agent = other._machine, other._agent
            self.origin, self.memory_base = origin, memory_base
            self._cold = True
            self.generation += 1
            other._closed = True
        self._factory._forget(other)
        old_agent.close()
        old_machine.kill()

    def _ensure_open(self, what: str) -> None:
        if self._closed:
            raise VMError(f"VM {self.name} is closed; it cannot be used for {what}")

    def _call(self, what: str, function: Any, *args: Any, **kwargs: Any) -> Any:
        self._ensure_open(what)
        try:
            return function(*args, **kwargs)
        except ChannelClosed:
            error = self._machine.crash_error(f"guest died while {what}")
            self.close()
            raise error from None
        except AgentTimeout as exc:
            error = self._machine.crash_error(f"guest agent stopped answering while {what} ({exc})")
            self.close()
            raise error from None
