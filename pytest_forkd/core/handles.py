"""What the parts of a VM ask of the VM and of its factory, as typed interfaces.

The VM (:mod:`pytest_forkd.core.vm`) is built from parts that each do one job
for it: taking snapshots (:mod:`~pytest_forkd.core.branching`), comparing
filesystems (:mod:`~pytest_forkd.analysis.changes`), following guest processes
(:mod:`~pytest_forkd.core.process`), parking pooled children
(:mod:`~pytest_forkd.core.pool`). They work on a VM, and the VM works with the
factory that started it, but none of them imports the VM or the factory: they
name what they use through the protocols here, so that the core imports in one
direction, factory -> vm -> parts -> handles.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from pytest_forkd.analysis.transcript import Transcript
from pytest_forkd.core.runtime import Runtime
from pytest_forkd.engine.base import AnyEngine, AnyMachine
from pytest_forkd.guest.client import AgentClient
from pytest_forkd.guest.exec_result import ExecResult
from pytest_forkd.image.catalog import Image
from pytest_forkd.storage.snapshot import Snapshot, SnapshotOwner
from pytest_forkd.storage.store import SnapshotStore

_T = TypeVar("_T")


class VMOwner(SnapshotOwner, Protocol):
    """The factory that started a VM, as the VM and its parts use it (it owns the VM's snapshots too)."""

    engine: AnyEngine
    default_backend: str
    runtime: Runtime
    """The storage backends the VM's snapshots are taken with and the recorder its timings go to."""

    @property
    def session_store(self) -> SnapshotStore:
        """Where snapshots taken without a store of their own go."""
        ...

    def fingerprint(self, image: Any, spec: Any) -> dict[str, str]:
        """What a child must match to restore a snapshot of a machine booted from ``image`` with ``spec``."""
        ...

    def restore_into(self, vm: Any, snapshot: Snapshot) -> None:
        """Make ``vm`` a fresh child of ``snapshot``, keeping the handle."""
        ...

    def _forget(self, vm: Any) -> None:
        """Stop tracking ``vm`` (it was closed or taken over)."""
        ...


class VMHandle(Protocol):
    """A running VM, as the parts that work on it (snapshots, changes, processes, pools) use it."""

    image: Image
    origin: Snapshot | None
    memory_base: Snapshot | None
    transcript: Transcript
    default_backend: str | None

    @property
    def name(self) -> str: ...

    @property
    def memory_mib(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    @property
    def machine(self) -> AnyMachine: ...

    @property
    def agent(self) -> AgentClient: ...

    @property
    def factory(self) -> VMOwner: ...

    def defaults(self) -> dict[str, Any]: ...

    def branch(self, tag: str | None = None, *, backend: str | None = None) -> Snapshot: ...

    def restore(self, snapshot: Snapshot) -> None: ...

    def close(self) -> None: ...

    def _network_record(self) -> dict[str, Any] | None: ...

    def _record_timing(self, op: str, ms: float, **fields: Any) -> None: ...

    def _recover_after_failed_pause(self) -> None: ...

    def _exec_untracked(
        self, command: str | Sequence[str], *, stdin: bytes | None = None, timeout: float | None = None
    ) -> ExecResult: ...

    def _read_file_untracked(self, path: str) -> bytes: ...

    def _call(self, what: str, function: Callable[..., _T], *args: Any, **kwargs: Any) -> _T: ...
