"""Trajectories: an agent's steps run in a VM with cheap checkpoints, and bisection to the first bad step.

A :class:`Trajectory` runs steps (a shell string, an argv, or a callable taking
the VM) and snapshots the VM every ``every`` steps with the ``diff`` backend
(a pause of a few milliseconds, no filesystem manifest). When the end state is
bad, :meth:`Trajectory.bisect` finds the first step after which a predicate
fails: it evaluates the predicate on O(log n) states, each reached by
restoring the nearest checkpoint at or before it (or by going on from the
current state when that is closer) and replaying the steps in between.

Replay assumes steps are deterministic; whether they are is the caller's
concern, which is why the result lists every replayed step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

from pytest_forkd.errors import BisectError, ForkdError

if TYPE_CHECKING:
    from pytest_forkd.core.vm import VM
    from pytest_forkd.storage.snapshot import Snapshot

StepAction = Union[str, Sequence[str], Callable[["VM"], Any]]
Predicate = Callable[["VM"], Any]
DEFAULT_EVERY = 10


@dataclass(frozen=True)
class Step:
    """Step ``index`` (1-based) of a trajectory."""

    index: int
    action: StepAction
    name: str

    def run(self, vm: VM) -> Any:
        if callable(self.action):
            return self.action(vm)
        return vm.exec(self.action)


def describe(action: StepAction) -> str:
    if isinstance(action, str):
        return action
    if callable(action):
        return getattr(action, "label", None) or getattr(action, "__name__", None) or repr(action)
    return " ".join(action)


@dataclass
class BisectResult:
    """Where a trajectory went wrong.

    ``first_bad`` is the index of the first step after which the predicate was
    false (None if it held at the end, or already before step 1, see
    ``message``); ``evaluations`` maps each state evaluated (number of steps
    applied) to the predicate's verdict; ``replayed`` lists the step indices
    that were run again, in order; ``restores`` counts checkpoint restores.
    """

    first_bad: int | None
    step: Step | None
    steps: int
    restores: int
    replayed: list[int] = field(default_factory=list)
    evaluations: dict[int, bool] = field(default_factory=dict)
    message: str = ""
    seconds: float = 0.0

    @property
    def found(self) -> bool:
        return self.first_bad is not None

    def report(self) -> str:
        lines = [self.message]
        if self.step is not None:
            lines.append(f"first bad step: {self.step.index} of {self.steps}: {self.step.name}")
        states = ", ".join(f"{state}:{'good' if ok else 'bad'}" for state, ok in sorted(self.evaluations.items()))
        lines.append(f"states evaluated (steps applied: verdict): {states}")
        lines.append(
            f"{self.restores} checkpoint restores, {len(self.replayed)} steps replayed"
            + (f": {_ranges(self.replayed)}" if self.replayed else "")
        )
        lines.append(f"took {self.seconds:.1f} s")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.report()


def _ranges(indices: list[int]) -> str:
    """'3-7, 9, 12-14' for [3, 4, 5, 6, 7, 9, 12, 13, 14] (in the order replayed)."""
    parts: list[list[int]] = []
    for index in indices:
        if parts and parts[-1][1] + 1 == index:
            parts[-1][1] = index
        else:
            parts.append([index, index])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in parts)


def _cheapest_backend(vm: VM) -> str:
    """``diff`` where the diff backend of the VM's factory works on this host, else ``full``."""
    runtime = getattr(getattr(vm, "factory", None), "runtime", None)  # None for a stand-in without a factory
    if runtime is None:
        return "full"
    try:
        return "diff" if runtime.backends.get("diff").unavailable_reason() is None else "full"
    except ForkdError:
        return "full"


class Trajectory:
    """Runs steps in ``vm`` and keeps a checkpoint every ``every`` steps, for bisection.

    ``backend`` defaults to ``diff`` (the cheapest branch of a copy-on-write
    child), or ``full`` on a host without PAGEMAP_SCAN. Call :meth:`close`
    (the ``forkd_trajectory`` fixture does) to delete the checkpoints.
    """

    def __init__(self, vm: VM, *, every: int = DEFAULT_EVERY, backend: str | None = None) -> None:
        if not isinstance(every, int) or every < 1:
            raise ForkdError(f"Trajectory(every=...) is the number of steps between checkpoints, >= 1; got {every!r}")
        self.vm = vm
        self.every = every
        self.backend = backend or _cheapest_backend(vm)
        self.steps: list[Step] = []
        self.checkpoints: dict[int, Snapshot] = {}
        """Snapshots of the state after that many steps (0: before the first)."""
        self._position: int | None = 0
        """How many steps the VM's current state has applied (None: unknown, e.g. after a failed replay)."""
        self.restores = 0

    # -- running --------------------------------------------------------------------------------------------
    def step(self, action: StepAction, *, name: str | None = None) -> Any:
        """Run one more step now and return what it returned (an ExecResult for a command)."""
        if self._position != len(self.steps):
            self._goto(len(self.steps), [])
        if 0 not in self.checkpoints:
            self._checkpoint(0)
        step = Step(len(self.steps) + 1, action, name or describe(action))
        self.steps.append(step)
        result = self._run(step)
        if step.index % self.every == 0:
            self._checkpoint(step.index)
        return result

    def run(self, actions: Iterable[StepAction]) -> list[Any]:
        """Run each of ``actions`` as a step; return their results."""
        return [self.step(action) for action in actions]

    def __len__(self) -> int:
        return len(self.steps)

    def _run(self, step: Step) -> Any:
        transcript = self.vm.transcript
        transcript.step = step.index
        self._position = None
        try:
            result = step.run(self.vm)
        finally:
            transcript.step = None
        self._position = step.index
        return result

    def _checkpoint(self, state: int) -> None:
        self.checkpoints[state] = self.vm.branch(backend=self.backend)

    def _goto(self, state: int, replayed: list[int]) -> None:
        """Bring the VM to the state after ``state`` steps: go on from here if that is close, else restore."""
        base = max(index for index in self.checkpoints if index <= state)
        position = self._position
        if position is None or position > state or state - position > state - base:
            self.vm.restore(self.checkpoints[base])
            self.restores += 1
            self._position = position = base
        for step in self.steps[position:state]:
            self._run(step)
            replayed.append(step.index)

    # -- bisection ----------------------------------------------------------------------------------------------
    def bisect(self, predicate: Predicate) -> BisectResult:
        """Find the first step after which ``predicate(vm)`` is false.

        The predicate must hold before the first step and fail after the last
        (both are checked); states are assumed to go bad once and stay bad.
        The VM is left in the state right after the first bad step. A
        predicate that raises is a BisectError naming the state it was
        evaluated on; the VM stays usable.
        """
        started = time.perf_counter()
        total = len(self.steps)
        if total == 0:
            raise BisectError("the trajectory has no steps to bisect: run some with trajectory.step()")
        restores_before = self.restores
        replayed: list[int] = []
        evaluations: dict[int, bool] = {}

        def evaluate(state: int) -> bool:
            try:
                self._goto(state, replayed)
            except Exception as exc:
                raise BisectError(
                    f"replaying the steps up to state {state} of {total} failed: {type(exc).__name__}: {exc}"
                ) from exc
            try:
                verdict = bool(predicate(self.vm))
            except ForkdError as exc:
                raise BisectError(f"the predicate failed on the state after {state} of {total} steps: {exc}") from exc
            except Exception as exc:
                raise BisectError(
                    f"the predicate raised {type(exc).__name__}: {exc} on the state after {state} of {total} "
                    f"steps; a predicate returns true for a good state and false for a bad one"
                ) from exc
            evaluations[state] = verdict
            return verdict

        def result(first_bad: int | None, message: str) -> BisectResult:
            return BisectResult(
                first_bad,
                self.steps[first_bad - 1] if first_bad else None,
                total,
                self.restores - restores_before,
                replayed,
                evaluations,
                message,
                time.perf_counter() - started,
            )

        if evaluate(total):
            return result(None, f"the predicate holds after all {total} steps: no bad step to find")
        if not evaluate(0):
            return result(None, "the predicate is already false before the first step: no step made it bad")
        good, bad = 0, total
        while bad - good > 1:
            middle = (good + bad) // 2
            if evaluate(middle):
                good = middle
            else:
                bad = middle
        if self._position != bad:
            self._goto(bad, replayed)
        step = self.steps[bad - 1]
        return result(bad, f"step {bad} of {total} made the predicate false: {step.name}")

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Delete the trajectory's checkpoints (not the one the VM currently runs from)."""
        from pytest_forkd.storage.store import SnapshotStore

        in_use = {
            self.vm.origin.path if self.vm.origin else None,
            self.vm.memory_base.path if self.vm.memory_base else None,
        }
        for snapshot in reversed(list(self.checkpoints.values())):
            if snapshot.path in in_use:
                continue
            try:
                SnapshotStore(snapshot.path.parent).remove(snapshot.tag)
            except ForkdError:
                pass  # another snapshot depends on it; the run directory goes at the end of the session
        self.checkpoints.clear()

    def __enter__(self) -> Trajectory:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Trajectory of {self.vm.name}: {len(self.steps)} steps, {len(self.checkpoints)} checkpoints>"
