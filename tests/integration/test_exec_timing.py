"""Exec samples carry their timing tag: harness commands and the test's own workload are separate rows."""

from __future__ import annotations

import pytest

from pytest_forkd.core.factory import VMFactory
from pytest_forkd.errors import InvalidArgument
from pytest_forkd.latency import timings


@pytest.fixture
def recorder(factory: VMFactory, monkeypatch: pytest.MonkeyPatch) -> timings.Recorder:
    """A fresh recorder for the factory's runtime during the test: the samples of the test's VM."""
    fresh = timings.Recorder()
    monkeypatch.setattr(factory.runtime, "recorder", fresh)
    return fresh


def test_workload_and_harness_execs_are_recorded_apart(vm, recorder):
    assert vm.exec("true").ok
    assert vm.exec(["sh", "-c", "exit 3"], timing="workload").exit_code == 3
    assert vm.exec("true", timing="harness").ok
    rows = [(sample.op, sample.extra["timing"]) for sample in recorder.samples() if sample.op.startswith("exec")]
    assert rows == [("exec", "harness"), ("exec[workload]", "workload"), ("exec", "harness")]


def test_an_unknown_timing_tag_is_refused_and_the_vm_stays_usable(vm, recorder):
    before = len(vm.transcript)
    with pytest.raises(InvalidArgument, match="timing='setup' is not a timing tag"):
        vm.exec("true", timing="setup")
    assert len(vm.transcript) == before  # refused before anything reached the guest
    assert vm.exec("echo still here").stdout == "still here\n"
    assert [sample.op for sample in recorder.samples() if sample.op.startswith("exec")] == ["exec"]
