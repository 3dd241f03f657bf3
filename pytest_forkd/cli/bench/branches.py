"""The branch table: pause and total per backend, memory size and dirty MiB; the memory sweep and its plot."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from pytest_forkd.core.factory import VMFactory
from pytest_forkd.core.vm import VM
from pytest_forkd.image import ensure_image
from pytest_forkd.storage.store import SnapshotStore

from .common import BenchPlan, _conditions, _ms, figure


def dirty(vm: VM, mib: int) -> None:
    """Make the guest write ``mib`` MiB of memory (a process fills a buffer, then exits)."""
    if mib:
        vm.exec(["python3", "-c", f"b = bytearray(b'\\x01') * ({mib} << 20)"], check=True)


def measure_branches(
    factory: VMFactory, plan: BenchPlan, progress: Callable[[str], None], fork_rows: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """One row per (backend, memory, dirty MiB) with pause and total figures.

    Each sample starts from the same state: the VM is restored to its base,
    dirties ``dirty_mib`` MiB, then branches. With ``fork_rows`` the fork
    latency of each memory size is measured too (for the sweep plot).
    """
    rows = []
    available = {b.id: b.unavailable_reason() for b in factory.runtime.backends.all()}
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
                pauses: list[float] = []
                totals: list[float] = []
                for _ in range(plan.repeats):
                    root.restore(base)
                    dirty(root, dirty_mib)
                    started = time.perf_counter()
                    snapshot = root.branch(backend=backend)
                    if not snapshot.is_ready:
                        snapshot = snapshot.wait_ready(timeout=600)
                    totals.append(_ms(started))
                    if snapshot.pause_ms is not None:  # always set by branch()
                        pauses.append(snapshot.pause_ms)
                    SnapshotStore(snapshot.path.parent).remove(snapshot.tag, cascade=True)
                rows.append(
                    {
                        "backend": backend,
                        "memory_mib": memory_mib,
                        "dirty_mib": dirty_mib,
                        "pause_ms": figure(pauses),
                        "total_ms": figure(totals),
                    }
                )
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
            rows = sorted(
                (r for r in result["branch"] if r["backend"] == backend and r["dirty_mib"] == dirty_mib),
                key=lambda r: r["memory_mib"],
            )
            if not rows:
                continue
            xs = [r["memory_mib"] for r in rows]
            left.plot(xs, [r["pause_ms"]["p50"] for r in rows], marker="o", label=f"{backend} ({dirty_mib} MiB dirty)")
            left.fill_between(
                xs, [r["pause_ms"]["min"] for r in rows], [r["pause_ms"]["p95"] for r in rows], alpha=0.15
            )
    left.set(
        xlabel="guest memory (MiB)",
        ylabel="branch pause (ms, p50; band min-p95)",
        title="BRANCH pause window vs memory",
        xscale="log",
    )
    left.set_xticks(sorted({r["memory_mib"] for r in result["branch"]}))
    left.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    left.get_xaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())
    left.set_ylim(bottom=0)
    left.legend(fontsize=8)
    forks = sorted(result.get("fork", []), key=lambda r: r["memory_mib"])
    if forks:
        right.plot(
            [r["memory_mib"] for r in forks],
            [r["fork_ms"]["p50"] for r in forks],
            marker="o",
            label="fork to first reply (p50)",
        )
        right.fill_between(
            [r["memory_mib"] for r in forks],
            [r["fork_ms"]["min"] for r in forks],
            [r["fork_ms"]["p95"] for r in forks],
            alpha=0.15,
        )
        right.set(xlabel="guest memory (MiB)", ylabel="ms", title="fork latency vs memory", xscale="log")
        right.set_xticks([r["memory_mib"] for r in forks])
        right.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        right.get_xaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())
        right.set_ylim(bottom=0)
        right.legend(fontsize=8)
    conditions = result.get("conditions", {})
    figure_.suptitle(
        f"pytest-forkd on {conditions.get('cpus', '?')} CPUs, QEMU {conditions.get('qemu', '?')}, "
        f"accel {conditions.get('accel', '?')}",
        fontsize=9,
    )
    figure_.tight_layout()
    figure_.savefig(path, dpi=110)
    plt.close(figure_)
    return path
