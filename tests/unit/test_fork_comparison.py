"""The fork(n) comparison of ``forkd bench`` times equal work, on the fake engine (no VM needed)."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from pytest_forkd.cli.bench import forks as bench
from pytest_forkd.core.factory import VMFactory
from pytest_forkd.storage.snapshot import Snapshot
from pytest_forkd.storage.store import SnapshotStore

N = 4


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

    result = bench.measure_parallel_fork(factory, base, N, lambda message: None, rounds=3)

    # Per round: N fork(1) closed at once, N fork(1) kept, one fork(N).
    assert calls == ([1] * (2 * N) + [N]) * 3
    # The kept loop resumes its children only once all N are there, as fork(N) does.
    assert live_at_resume == [N] * N * 3
    assert factory.vms == []
    for key in ("serial_s", "serial_closed_s", "parallel_s"):
        assert result[f"fork{N}_{key}"] > 0
    parallel_s = result[f"fork{N}_parallel_s"]
    assert result[f"fork{N}_parallel_speedup"] == pytest.approx(result[f"fork{N}_serial_s"] / parallel_s, abs=0.02)
    assert result[f"fork{N}_speedup_over_closed_serial"] == pytest.approx(
        result[f"fork{N}_serial_closed_s"] / parallel_s, abs=0.02
    )
