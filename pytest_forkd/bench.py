"""``forkd bench``: measure boots, forks, execs and branches on this host, in one run.

Absolute times on shared, TCG-emulated machines are noisy; what is meant to
be compared are ratios measured in the same run (fork vs cold boot, full
branch pause vs a plain file copy of the same size on the same filesystem).
Every figure is a summary ``{"n", "min", "p50", "p95", "max"}`` of its samples.
"""

from __future__ import annotations

import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .backend import registry
from .engine.accel import AccelVerdict
from .factory import VMFactory
from .image import ensure_image
from .stats import summarize
from .store import SnapshotStore

FIGURE_KEYS = ("n", "min", "p50", "p95", "max")


def figure(values: list[float]) -> dict[str, float]:
    """The bench's summary of one list of samples (ms or MiB/s)."""
    summary = summarize(values).to_dict()
    return {key: summary[key] for key in FIGURE_KEYS}


@dataclass
class BenchPlan:
    memory_mib: list[int] = field(default_factory=lambda: [256, 1024])
    backends: list[str] = field(default_factory=lambda: ["full", "diff", "uffd"])
    dirty_mib: list[int] = field(default_factory=lambda: [0, 16, 64])
    repeats: int = 5
    boots: int = 3
    accel: str = "auto"


def _ms(since: float) -> float:
    return (time.perf_counter() - since) * 1000


def copy_reference_mib_s(directory: Path, size_mib: int, repeats: int) -> list[float]:
    """Throughput of a plain copy of a ``size_mib`` file on the filesystem of ``directory``."""
    results = []
    scratch = Path(tempfile.mkdtemp(prefix="copyref-", dir=directory))
    try:
        source = scratch / "source"
        chunk = os.urandom(1 << 20)
        with open(source, "wb") as handle:
            for _ in range(size_mib):
                handle.write(chunk)
        for index in range(repeats):
            target = scratch / f"copy{index}"
            started = time.perf_counter()
            shutil.copyfile(source, target)
            results.append(size_mib / (time.perf_counter() - started))
            target.unlink()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return results


def dirty(vm, mib: int) -> None:
    """Make the guest write ``mib`` MiB of memory (a process fills a buffer, then exits)."""
    if mib:
        vm.exec(["python3", "-c", f"b = bytearray(b'\\x01') * ({mib} << 20)"], check=True)


def run_bench(plan: BenchPlan, progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    factory = VMFactory(accel=plan.accel)
    try:
        return _run(factory, plan, progress)
    finally:
        factory.close()


def _run(factory: VMFactory, plan: BenchPlan, progress: Callable[[str], None]) -> dict[str, Any]:
    boots, forks, pooled, overhead, execs, pings = [], [], [], [], [], []
    first_memory = plan.memory_mib[0]
    progress(f"cold boots: {plan.boots} x {first_memory} MiB")
    for _ in range(plan.boots):
        started = time.perf_counter()
        vm = factory.boot(memory_mib=first_memory)
        boots.append(_ms(started))
        vm.close()

    root = factory.boot(memory_mib=first_memory)
    image = root.image
    base = root.freeze("bench-base", keep_running=False)
    progress(f"forks: {plan.repeats} without pool, {plan.repeats} from a pool of 1")
    for _ in range(plan.repeats):
        started = time.perf_counter()
        child = factory.fork_snapshot(base, 1)[0]
        forks.append(_ms(started))
        child.close()
    pool = factory.pool(base, 1)
    for _ in range(plan.repeats):
        _wait_for(lambda: len(pool) >= 1, timeout=120)
        started = time.perf_counter()
        child = factory.fork_snapshot(base, 1)[0]
        child.ping()  # "to first reply", like fork_ms
        pooled.append(_ms(started))
        child.close()
    progress(f"fixture overhead: {plan.repeats} x (pooled child, one command, close)")
    for _ in range(plan.repeats):
        # What the forkd_vm fixture costs a test when the pool has refilled since the last
        # test (tests longer than one restore): setup (take) plus teardown (close).
        _wait_for(lambda: len(pool) >= 1, timeout=120)
        started = time.perf_counter()
        child = factory.fork_snapshot(base, 1)[0]
        setup_ms = _ms(started)
        child.exec(["true"])
        started = time.perf_counter()
        child.close()
        overhead.append(setup_ms + _ms(started))
    factory.drop_pool(base)

    progress("exec round trips")
    child = factory.fork_snapshot(base, 1)[0]
    child.exec(["true"])
    for _ in range(max(10, plan.repeats * 4)):
        started = time.perf_counter()
        child.exec(["true"])
        execs.append(_ms(started))
        started = time.perf_counter()
        child.ping()
        pings.append(_ms(started))
    child.close()

    copy_reference: list[float] = []
    for memory_mib in plan.memory_mib:
        progress(f"copy reference: {memory_mib} MiB on {factory.run_dir.path.parent}")
        copy_reference += copy_reference_mib_s(factory.run_dir.path, memory_mib, max(2, plan.repeats // 2))
    branch_rows = measure_branches(factory, plan, progress)

    return {
        "conditions": _conditions(factory, plan, factory.accel_verdict(image)),
        "cold_boot_ms": figure(boots),
        "fork_ms": figure(forks),
        "fork_pooled_ms": figure(pooled),
        "fixture_overhead_ms": figure(overhead),
        "exec_rtt_ms": figure(execs),
        "ping_rtt_ms": figure(pings),
        "copy_reference_mib_s": figure(copy_reference),
        "branch": branch_rows,
    }


def measure_branches(factory: VMFactory, plan: BenchPlan, progress: Callable[[str], None],
                     fork_rows: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One row per (backend, memory, dirty MiB) with pause and total figures.

    Each sample starts from the same state: the VM is restored to its base,
    dirties ``dirty_mib`` MiB, then branches. With ``fork_rows`` the fork
    latency of each memory size is measured too (for the sweep plot).
    """
    rows = []
    available = {b.id: b.unavailable_reason() for b in registry().all()}
    for memory_mib in plan.memory_mib:
        root = factory.boot(memory_mib=memory_mib)
        base = root.freeze(f"bench-m{memory_mib}")  # root continues as a child of its base
        if fork_rows is not None:
            forks = []
            for _ in range(plan.repeats):
                started = time.perf_counter()
                child = factory.fork_snapshot(base, 1)[0]
                forks.append(_ms(started))
                child.close()
            fork_rows.append({"memory_mib": memory_mib, "fork_ms": figure(forks)})
        for backend in plan.backends:
            if available.get(backend, "unknown backend"):
                progress(f"skipping backend {backend}: {available.get(backend, 'not registered')}")
                continue
            for dirty_mib in plan.dirty_mib:
                progress(f"branch {backend}: {memory_mib} MiB guest, {dirty_mib} MiB dirty, x {plan.repeats}")
                pauses, totals = [], []
                for _ in range(plan.repeats):
                    root.restore(base)
                    dirty(root, dirty_mib)
                    started = time.perf_counter()
                    snapshot = root.branch(backend=backend)
                    if not snapshot.is_ready:
                        snapshot = snapshot.wait_ready(timeout=600)
                    totals.append(_ms(started))
                    pauses.append(snapshot.pause_ms)
                    SnapshotStore(snapshot.path.parent).remove(snapshot.tag, cascade=True)
                rows.append({"backend": backend, "memory_mib": memory_mib, "dirty_mib": dirty_mib,
                             "pause_ms": figure(pauses), "total_ms": figure(totals)})
        root.close()
        SnapshotStore(base.path.parent).remove(base.tag, cascade=True)
    return rows


SWEEP_MEMORY = [256, 512, 1024, 2048]


def run_sweep(plan: BenchPlan, progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Pause window versus memory size per backend, and fork latency versus memory size."""
    factory = VMFactory(accel=plan.accel)
    try:
        fork_rows: list[dict[str, Any]] = []
        branch_rows = measure_branches(factory, plan, progress, fork_rows)
        return {
            "conditions": _conditions(factory, plan, factory.accel_verdict(ensure_image("default"))),
            "branch": branch_rows,
            "fork": fork_rows,
        }
    finally:
        factory.close()


def plot_sweep(result: dict[str, Any], path: Path) -> Path:
    """Write a PNG: branch pause (p50, p5-p95 band) versus memory per backend, and fork latency.

    Needs matplotlib (``pip install 'pytest-forkd[plot]'``); raises ImportError otherwise.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure_, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for backend in sorted({row["backend"] for row in result["branch"]}):
        for dirty_mib in sorted({row["dirty_mib"] for row in result["branch"]}):
            rows = sorted((r for r in result["branch"] if r["backend"] == backend and r["dirty_mib"] == dirty_mib),
                          key=lambda r: r["memory_mib"])
            if not rows:
                continue
            xs = [r["memory_mib"] for r in rows]
            left.plot(xs, [r["pause_ms"]["p50"] for r in rows], marker="o", label=f"{backend} ({dirty_mib} MiB dirty)")
            left.fill_between(xs, [r["pause_ms"]["min"] for r in rows], [r["pause_ms"]["p95"] for r in rows],
                              alpha=0.15)
    left.set(xlabel="guest memory (MiB)", ylabel="branch pause (ms, p50; band min-p95)",
             title="BRANCH pause window vs memory", xscale="log")
    left.set_xticks(sorted({r["memory_mib"] for r in result["branch"]}))
    left.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    left.get_xaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())
    left.set_ylim(bottom=0)
    left.legend(fontsize=8)
    forks = sorted(result.get("fork", []), key=lambda r: r["memory_mib"])
    if forks:
        right.plot([r["memory_mib"] for r in forks], [r["fork_ms"]["p50"] for r in forks], marker="o",
                   label="fork to first reply (p50)")
        right.fill_between([r["memory_mib"] for r in forks], [r["fork_ms"]["min"] for r in forks],
                           [r["fork_ms"]["p95"] for r in forks], alpha=0.15)
        right.set(xlabel="guest memory (MiB)", ylabel="ms", title="fork latency vs memory", xscale="log")
        right.set_xticks([r["memory_mib"] for r in forks])
        right.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        right.get_xaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())
        right.set_ylim(bottom=0)
        right.legend(fontsize=8)
    conditions = result.get("conditions", {})
    figure_.suptitle(f"pytest-forkd on {conditions.get('cpus', '?')} CPUs, QEMU {conditions.get('qemu', '?')}, "
                     f"accel {conditions.get('accel', '?')}", fontsize=9)
    figure_.tight_layout()
    figure_.savefig(path, dpi=110)
    plt.close(figure_)
    return path


def _conditions(factory: VMFactory, plan: BenchPlan, verdict: AccelVerdict) -> dict[str, Any]:
    return {
        "host": platform.node(), "kernel": platform.release(), "cpus": os.cpu_count(),
        "qemu": factory.qemu.version, "accel": verdict.accel, "accel_reason": verdict.reason,
        "store": "run directory on " + str(factory.run_dir.path.parent),
        "repeats": plan.repeats, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _wait_for(predicate: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the child pool did not refill in time")
        time.sleep(0.01)
