"""Checkpoints: a snapshot taken before something destructive, with a way back."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, Iterable, Protocol, TypeVar

from pytest_forkd.storage.snapshot import Snapshot

if TYPE_CHECKING:
    from pytest_forkd.analysis.changes import Changes


class CheckpointedVM(Protocol):
    """What a checkpoint asks of its VM: to roll back, and to compare with the checkpoint."""

    @property
    def name(self) -> str: ...

    @property
    def closed(self) -> bool: ...

    def restore(self, snapshot: Snapshot) -> None: ...

    def changes(self, since: Any = None, *, include: Iterable[str] = (), exclude: Iterable[str] = ()) -> Changes: ...


_V = TypeVar("_V", bound=CheckpointedVM)


class Checkpoint(Generic[_V]):
    """A snapshot of ``vm`` plus the means to roll back to it or fork from it.

    As a context manager it rolls the VM back when the block ends (whether it
    raised or not) unless :meth:`keep` was called inside the block::

        with vm.checkpoint() as cp:
            agent.run("rm -rf /srv/data")
            if looks_good(vm):
                cp.keep()
    """

    def __init__(self, vm: _V, snapshot: Snapshot) -> None:
        self.vm = vm
        self.snapshot = snapshot
        self._keep = False

    @property
    def tag(self) -> str:
        return self.snapshot.tag

    def keep(self) -> None:
        """Keep the changes made since the checkpoint when the block ends."""
        self._keep = True

    def rollback(self) -> None:
        """Restore the VM to the checkpoint now."""
        self.vm.restore(self.snapshot)

    def changes(self, *, include: Iterable[str] = (), exclude: Iterable[str] = ()) -> Changes:
        """What changed in the VM's filesystem since this checkpoint (see :meth:`VM.changes`)."""
        return self.vm.changes(self, include=include, exclude=exclude)

    def fork(self, n: int = 1) -> list[_V]:
        """Start ``n`` children of the checkpoint (alternatives to try side by side)."""
        return self.snapshot.fork(n)

    def __enter__(self) -> Checkpoint[_V]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self._keep and not self.vm.closed:
            self.rollback()

    def __repr__(self) -> str:
        return f"<Checkpoint {self.tag} of {self.vm.name} backend={self.snapshot.backend}>"
