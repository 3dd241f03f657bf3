"""The fork(n) comparison of ``forkd bench`` times equal work, on the fake engine (no VM needed)."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from pytest_forkd.cli.bench import forks as bench
from pytest_forkd.core.factory import VMFactory
from pytest_forkd.storage.snapshot import Snapshot
from pytest_forkd.storage.store import SnapshotStore

#: Small, as every fork starts a fake guest: two children still tell "all at once" from "one by one",
#: and two rounds show the pattern repeats.
N = 2
ROUNDS = 2


@pytest.fixture(scope="module")
def base(factory: VMFactory) -> Iterator[Snapshot]:
    snapshot = factory.boot(memory_mib=64).freeze("fork-comparison", keep_running=False)
    yield snapshot
    SnapshotStore(snapshot.path.parent).remove(snapshot.tag, cascade=True)


def test_the_serial_loop_ends_like_fork_n_with_every_child_ready_and_the_closed_loop_is_reported_too(
    factory: VMFactory, base: Snapshot, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench, "SETTLE_S", 0.0)
    live_at_resume: list[int] = []
    calls: list[int] = []
    fork_snapshot, unpark_vm = factory.fork_snapshot, bench.unpark_vm

    def counting_fork(snapshot: Snapshot, n: int = 1, **options: Any) -> list[Any]:
        calls.append(n)
        return fork_snapshot(snapshot, n, **options)

    def counting_unpark(vm: Any) -> None:
        live_at_resume.append(len(factory.vms))
        unpark_vm(vm)

    monkeypatch.setattr(factory, "fork_snapshot", counting_fork)
    monkeypatch.setattr(bench, "unpark_vm", counting_unpark)

    result = bench.measure_parallel_fork(factory, base, N, lambda message: None, rounds=ROUNDS)

    # Per round: N fork(1) closed at once, N fork(1) kept, one fork(N).
    assert calls == ([1] * (2 * N) + [N]) * ROUNDS
    # The kept loop resumes its children only once all N are there, as fork(N) does.
    assert live_at_resume == [N] * N * ROUNDS
    assert factory.vms == []
    for key in ("serial_s", "serial_closed_s", "parallel_s"):
        assert result[f"fork{N}_{key}"] > 0
    parallel_s = result[f"fork{N}_parallel_s"]
    assert result[f"fork{N}_parallel_speedup"] == ratio_of_reported(result[f"fork{N}_serial_s"], parallel_s)
    assert result[f"fork{N}_speedup_over_closed_serial"] == ratio_of_reported(
        result[f"fork{N}_serial_closed_s"], parallel_s
    )


def test_prefill_is_timed_against_fork_n_with_a_first_command_in_each(
    factory: VMFactory, base: Snapshot, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench, "SETTLE_S", 0.0)
    commands: list[list[str]] = []
    calls: list[int] = []
    fork_snapshot = factory.fork_snapshot

    def counting_fork(snapshot: Snapshot, n: int = 1, **options: Any) -> list[Any]:
        calls.append(n)
        children = fork_snapshot(snapshot, n, **options)
        for child in children:
            exec_ = child.agent.exec

            def recording_exec(argv: list[str], *args: Any, _exec: Any = exec_, **kwargs: Any) -> Any:
                commands.append(argv)
                return _exec(argv, *args, **kwargs)

            monkeypatch.setattr(child.agent, "exec", recording_exec)
        return children

    monkeypatch.setattr(factory, "fork_snapshot", counting_fork)

    result = bench.measure_prefill(factory, base, N, lambda message: None, rounds=ROUNDS)

    assert calls == [N] * ROUNDS  # one fork(N) a round; the pool's restores do not go through fork_snapshot
    assert commands == [["true"]] * (N * ROUNDS)  # and a first command in each of its children
    assert factory.vms == []  # every child of both closed, the pool dropped
    assert result[f"prefill{N}_s"] > 0 and result[f"fork{N}_warm_s"] > 0
    assert result[f"prefill{N}_over_fork_warm"] == ratio_of_reported(result[f"prefill{N}_s"], result[f"fork{N}_warm_s"])


def ratio_of_reported(top_s: float, bottom_s: float) -> Any:
    """``top_s / bottom_s`` as closely as the report's rounding allows: times to 1 ms, ratios to 0.01."""
    ratio = top_s / bottom_s
    return pytest.approx(ratio, abs=0.005 + 1.1 * ratio * 0.0005 * (1 / top_s + 1 / bottom_s))
