"""Memory limits of the cgroup forkd runs in, and pools and forks that respect them (no VM).

The cgroup filesystems are built under tmp_path: a fake /proc (self/cgroup,
self/mounts) pointing at fake v1 and v2 hierarchies. The real thing, a suite
in a 1 GiB cgroup, is scripts/memory-limit-suite.
"""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import pytest
from cgroupfs import fake_proc

from pytest_forkd.core import pool as pools
from pytest_forkd.core.pool import ChildPool
from pytest_forkd.engine import cgroup

MIB = 1 << 20


def write(directory: Path, **files: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("_", ".", 1)).write_text(text)


def test_cgroup_v2_limit_with_reclaimable_cache_not_counted_and_the_tightest_ancestor(tmp_path: Path) -> None:
    root = tmp_path / "unified"
    write(root / "ci", memory_max=str(1024 * MIB), memory_current=str(600 * MIB), memory_stat="inactive_file 0\n")
    write(
        root / "ci/job",
        memory_max="max",
        memory_current=str(500 * MIB),
        memory_stat=f"anon 1\ninactive_file {200 * MIB}\n",
    )
    proc = fake_proc(tmp_path, ["0::/ci/job"], [f"cgroup2 {root} cgroup2 rw,nosuid 0 0"])
    limit = cgroup.memory_limit(proc)
    assert limit is not None and limit.version == 2 and limit.cgroup == root / "ci"
    assert (limit.limit, limit.used, limit.free_mib) == (1024 * MIB, 600 * MIB, 424)
    assert "limit 1024 MiB, 600 MiB in use, 424 MiB free" in limit.describe()


def test_cgroup_v1_memory_controller_and_its_no_limit_value(tmp_path: Path) -> None:
    root = tmp_path / "memory"
    write(root, memory_limit_in_bytes="9223372036854771712", memory_usage_in_bytes="1", memory_stat="")
    write(
        root / "job",
        memory_limit_in_bytes=str(1024 * MIB),
        memory_usage_in_bytes=str(900 * MIB),
        memory_stat=f"cache 5\ntotal_inactive_file {100 * MIB}\n",
    )
    proc = fake_proc(
        tmp_path,
        ["5:cpu,cpuacct:/", "4:memory:/job", "0::/"],
        [f"cgroup {tmp_path / 'cpu'} cgroup rw,cpu,cpuacct 0 0", f"cgroup {root} cgroup rw,relatime,memory 0 0"],
    )
    limit = cgroup.memory_limit(proc)
    assert limit is not None and limit.version == 1 and limit.cgroup == root / "job"
    assert limit.free_mib == 224


def test_no_limit_anywhere_is_none(tmp_path: Path) -> None:
    root = tmp_path / "unified"
    write(root, memory_max="max", memory_current="5")
    assert cgroup.memory_limit(fake_proc(tmp_path, ["0::/"], [f"cgroup2 {root} cgroup2 rw 0 0"])) is None
    assert cgroup.memory_limit(tmp_path / "no-proc") is None


def test_available_memory_is_the_smaller_of_host_and_cgroup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pools, "host_available_mib", lambda: 20000)
    monkeypatch.setattr(cgroup, "memory_limit", lambda: cgroup.MemoryLimit(Path("/cg"), 2, 1024 * MIB, 724 * MIB))
    assert pools.available_memory_mib() == 300
    assert pools.memory_room(child_mib=40, reserve_mib=256)
    assert not pools.memory_room(child_mib=80, reserve_mib=256)
    problem = pools.fork_memory_problem(8)
    assert problem is not None and "640 MiB" in problem and "cgroup v2 /cg" in problem and "fork fewer" in problem
    assert pools.fork_memory_problem(3) is None
    monkeypatch.setattr(cgroup, "memory_limit", lambda: None)
    assert pools.available_memory_mib() == 20000


class Child:
    def __init__(self, number: int) -> None:
        self.number = number
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_a_pool_keeps_fewer_children_ready_when_memory_runs_out_and_prefill_ends_with_what_fits() -> None:
    """A prefill wanting 10 children in memory for 3: it returns with 3, promptly, and restores no more."""
    counter = itertools.count()
    launched: list[Child] = []
    lock = threading.Lock()

    def launch() -> Child:
        with lock:
            child = Child(next(counter))
            launched.append(child)
            return child

    def room() -> bool:
        with lock:
            return len(launched) < 3

    pool: ChildPool[Child] = ChildPool(launch, 2, maximum=10, demand=lambda: 10, room=room, cpus=2)
    try:
        ready = pool.prefill(timeout=30)
        assert ready == 3 and pool.memory_capped
        assert len(launched) == 3
        taken = pool.take()
        assert taken is not None
    finally:
        pool.close()
    assert all(child.closed for child in launched if child is not taken)
