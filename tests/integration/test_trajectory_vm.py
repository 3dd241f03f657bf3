"""Trajectory and bisect against a real guest: 200 steps, one injected bad step, at most 10 restores."""

from __future__ import annotations

import pytest

from pytest_forkd.analysis.trajectory import Trajectory
from pytest_forkd.errors import BisectError

BAD = 137


def _step(index: int) -> str:
    command = f"echo {index} >> /root/steps"
    if index == BAD:
        command += " && echo broken > /root/state"
    return command


def _healthy(vm) -> bool:
    return vm.exec("test ! -e /root/state").exit_code == 0


def test_bisect_finds_the_injected_bad_step_among_200_with_at_most_10_restores(vm) -> None:
    with Trajectory(vm, every=10) as trajectory:
        trajectory.run([_step(index) for index in range(1, 201)])
        assert len(trajectory.checkpoints) == 21
        assert not _healthy(vm)
        result = trajectory.bisect(_healthy)
        assert result.found and result.first_bad == BAD
        assert result.step.name == _step(BAD)
        assert result.restores <= 10
        assert 0 < len(result.replayed) < 200
        assert f"first bad step: {BAD} of 200" in result.report()
        # The VM is left right after the bad step.
        assert vm.exec("tail -n 1 /root/steps").stdout == f"{BAD}\n"
        restores = [entry for entry in vm.transcript.entries if entry["kind"] == "restore"]
        assert len(restores) == result.restores


def test_a_predicate_that_raises_is_a_bisect_error_and_the_vm_stays_usable(vm) -> None:
    trajectory = Trajectory(vm, every=4)
    trajectory.run([_step(index) for index in range(1, 9)])

    def predicate(vm):
        raise RuntimeError("no such check")

    with pytest.raises(BisectError, match="predicate raised RuntimeError: no such check"):
        trajectory.bisect(predicate)
    assert vm.exec("wc -l < /root/steps").stdout.strip() == "8"
    trajectory.close()
