"""Checkpoints: a snapshot taken before something destructive, with a way back."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from pytest_forkd.core.changes import Changes
    from pytest_forkd.core.vm import VM
    from pytest_forkd.storage.snapshot import Snapshot


class Checkpoint:
    """A snapshot of ``vm`` plus the means to roll back to it or fork from it.

    As a context manager it rolls the VM back when the block ends (whether it
    raised or not) unless :meth:`keep` was called inside the block::

        with vm.checkpoint() as cp:
            agent.run("rm -rf /srv/data")
            if looks_good(vm):
                cp.keep()
    """

    def __init__(self, vm: "VM", snapshot: "Snapshot") -> None:
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

    def changes(self, *, include: Iterable[str] = (), exclude: Iterable[str] = ()) -> "Changes":
        """What changed in the VM's filesystem since this checkpoint (see :meth:`VM.changes`)."""
        return self.vm.changes(self, include=include, exclude=exclude)

    def fork(self, n: int = 1) -> list["VM"]:
        """Start ``n`` children of the checkpoint (alternatives to try side by side)."""
        return self.snapshot.fork(n)

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self._keep and not self.vm.closed:
            self.rollback()

    def __repr__(self) -> str:
        return f"<Checkpoint {self.tag} of {self.vm.name} backend={self.snapshot.backend}>"
