"""Trajectory and bisect on a fake VM: restores are O(log n), replays are listed, bad predicates explained."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pytest_forkd.analysis.trajectory import Trajectory, _ranges
from pytest_forkd.analysis.transcript import Transcript
from pytest_forkd.errors import BisectError, ForkdError


@dataclass
class FakeSnapshot:
    tag: str
    path: Path
    state: tuple


@dataclass
class FakeVM:
    """Its state is the tuple of commands applied; branch/restore copy it."""

    name: str = "fake"
    state: tuple = ()
    restores: int = 0
    origin: object = None
    memory_base: object = None
    transcript: Transcript = field(default_factory=lambda: Transcript("fake"))
    _count: int = 0

    def exec(self, command):
        self.state = (*self.state, command)
        return command

    def branch(self, backend=None):
        self._count += 1
        return FakeSnapshot(f"s{self._count}", Path(f"/nowhere/s{self._count}"), self.state)

    def restore(self, snapshot):
        self.restores += 1
        self.state = snapshot.state


def _steps(n: int, bad: int) -> list[str]:
    return [f"step {i}" + (" BREAK" if i == bad else "") for i in range(1, n + 1)]


def _good(vm: FakeVM) -> bool:
    return not any("BREAK" in command for command in vm.state)


@pytest.mark.parametrize("bad", [1, 2, 57, 100, 101, 199, 200])
def test_bisect_finds_the_bad_step_among_200_with_at_most_10_restores(bad: int) -> None:
    vm = FakeVM()
    trajectory = Trajectory(vm, every=10)
    trajectory.run(_steps(200, bad))
    assert len(trajectory.checkpoints) == 21
    result = trajectory.bisect(_good)
    assert result.found and result.first_bad == bad
    assert result.step.name == f"step {bad} BREAK"
    assert result.restores == vm.restores <= 10
    assert vm.state == tuple(_steps(200, bad)[:bad])  # left right after the bad step
    assert result.replayed and all(1 <= index <= 200 for index in result.replayed)
    assert result.evaluations[0] is True and result.evaluations[200] is False
    assert f"first bad step: {bad} of 200" in result.report()


def test_bisect_when_nothing_or_everything_is_bad() -> None:
    vm = FakeVM()
    trajectory = Trajectory(vm, every=5)
    trajectory.run(_steps(12, bad=0))
    result = trajectory.bisect(_good)
    assert not result.found and "holds after all 12 steps" in result.message and result.restores == 0
    assert trajectory.bisect(lambda vm: False).message.startswith("the predicate is already false")


def test_a_raising_predicate_is_a_bisect_error_and_the_trajectory_goes_on() -> None:
    vm = FakeVM()
    trajectory = Trajectory(vm, every=3)
    trajectory.run(_steps(7, bad=4))

    def broken(vm):
        raise KeyError("oops")

    with pytest.raises(BisectError, match="predicate raised KeyError.*state after 7 of 7 steps"):
        trajectory.bisect(broken)
    trajectory.step("step 8")
    assert len(vm.state) == 8 and trajectory.bisect(_good).first_bad == 4


def test_steps_can_be_callables_and_are_tagged_in_the_transcript() -> None:
    vm = FakeVM()
    trajectory = Trajectory(vm, every=2)

    def write_twice(vm):
        vm.transcript.record("exec", command="a")
        vm.exec("a")
        vm.exec("a")
        return "done"

    assert trajectory.step(write_twice) == "done"
    assert trajectory.steps[0].name == "write_twice"
    assert [entry["step"] for entry in vm.transcript.entries] == [1]


def test_bad_arguments() -> None:
    with pytest.raises(ForkdError, match="every"):
        Trajectory(FakeVM(), every=0)
    with pytest.raises(BisectError, match="no steps"):
        Trajectory(FakeVM()).bisect(_good)


def test_ranges_compacts_replayed_steps() -> None:
    assert _ranges([3, 4, 5, 9, 12, 13]) == "3-5, 9, 12-13"
