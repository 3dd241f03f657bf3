"""Forks: the restore breakdown, serial versus parallel ``fork(n)``, and the per-test overhead through the plugin."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from pytest_forkd.core.factory import VMFactory
from pytest_forkd.core.pool import park_vm, unpark_vm
from pytest_forkd.core.vm import VM

from .common import BenchPlan, figure


def restore_breakdown(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """Per restore phase (see ``RestorePhases``), the figure of its samples; each phase's share of the p50 total."""
    if not phases:
        return {}
    names = [name for name in phases[0] if all(isinstance(row.get(name), (int, float)) for row in phases)]
    result: dict[str, Any] = {name: figure([float(row[name]) for row in phases]) for name in names}
    timed = [name for name in names if name.endswith("_ms") and name != "qemu_cpu_ms"]
    total = sum(result[name]["p50"] for name in timed) or 1.0
    result["share_of_p50"] = {name: round(result[name]["p50"] / total, 3) for name in timed}
    cpu_rows = [row["cpu_ms"] for row in phases if isinstance(row.get("cpu_ms"), dict) and row["cpu_ms"]]
    if cpu_rows:  # the QEMU CPU of each phase (RestorePhases.cpu_ms), where every sample has it
        cpu_names = [name for name in cpu_rows[0] if all(name in row for row in cpu_rows)]
        result["cpu_ms"] = {name: figure([float(row[name]) for row in cpu_rows]) for name in cpu_names}
    return result


#: Seconds the fork(n) comparison waits before each of the two loops it compares, so that both
#: start from the same memory state: a virtual machine with free page reporting (virtio-balloon)
#: hands freed memory back to its host within about 2 s, and a page the host took back costs a
#: host fault when it is used again (on this machine kind, 20 restores that got such pages used
#: 1.5x the QEMU CPU of 20 that reused the pages of the child closed just before).
SETTLE_S = 3.0


def measure_parallel_fork(
    factory: VMFactory, base: Any, n: int, progress: Callable[[str], None], rounds: int = 3
) -> dict[str, Any]:
    """``n`` children restored one after another versus one ``fork(n)``; rounds alternate, medians compared.

    The speedup compares equal work: the serial loop keeps its children as
    ``fork(n)`` does (each paused once it answers, all resumed at the end), so
    both end with ``n`` ready children and ``n`` children's memory, and each
    starts :data:`SETTLE_S` after the previous loop freed its children. A loop
    that closes each child as soon as it answers is timed too
    (``..._speedup_over_closed_serial``): each restore then reuses the pages
    the previous child just gave back, which are cheaper than new ones (on a
    virtual machine whose free memory goes back to its host, much cheaper),
    so that figure mixes parallelism with memory reuse.
    """
    progress(f"fork({n}): {rounds} rounds of {n} x fork(1) (kept, then closed at once) against one fork({n})")
    closed, kept, together = [], [], []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(n):
            factory.fork_snapshot(base, 1)[0].close()
        closed.append(time.perf_counter() - started)
        time.sleep(SETTLE_S)
        started = time.perf_counter()
        serial: list[VM] = []
        try:
            for _ in range(n):
                serial.append(factory.fork_snapshot(base, 1)[0])
                park_vm(serial[-1])
            for child in serial:
                unpark_vm(child)
            kept.append(time.perf_counter() - started)
        finally:
            for child in serial:
                child.close()
        time.sleep(SETTLE_S)
        started = time.perf_counter()
        children = factory.fork_snapshot(base, n)
        together.append(time.perf_counter() - started)
        answering = sum(1 for child in children if child.ping())
        for child in children:
            child.close()
        if answering != n:
            raise RuntimeError(f"fork({n}): only {answering} children answered")
    closed_s, serial_s, parallel_s = (sorted(times)[len(times) // 2] for times in (closed, kept, together))
    return {
        f"fork{n}_serial_s": round(serial_s, 3),
        f"fork{n}_serial_closed_s": round(closed_s, 3),
        f"fork{n}_parallel_s": round(parallel_s, 3),
        f"fork{n}_serial_per_s": round(n / serial_s, 2),
        f"fork{n}_parallel_per_s": round(n / parallel_s, 2),
        f"fork{n}_parallel_speedup": round(serial_s / parallel_s, 2),
        f"fork{n}_speedup_over_closed_serial": round(closed_s / parallel_s, 2),
        f"fork{n}_host_load_1min": round(os.getloadavg()[0], 2),
    }


def measure_prefill(
    factory: VMFactory, base: Any, n: int, progress: Callable[[str], None], rounds: int = 3
) -> dict[str, Any]:
    """A pool's prefill of ``n`` children against ``fork(n)`` and a first ``true`` in each; medians of ``rounds``.

    Both end with ``n`` children that ran one guest command (what a pool
    does before it parks a child, so that a test's first command is not its
    first-ever one). The prefill restores on every core and parks each
    child paused once warm; ``fork(n)`` resumes all of its children at once
    and the commands then run on parallel threads. ``prefill{n}_over_fork_warm``
    below 1 means prefill readies children at least at ``fork(n)`` throughput.
    """
    progress(f"prefill: {rounds} rounds of a pool prefill of {n} against fork({n}) and a first command in each")
    prefills, forks = [], []
    for _ in range(rounds):
        time.sleep(SETTLE_S)
        started = time.perf_counter()
        children = factory.fork_snapshot(base, n)
        try:
            with ThreadPoolExecutor(max_workers=len(children)) as executor:
                list(executor.map(lambda child: child.agent.exec(["true"]), children))
            forks.append(time.perf_counter() - started)
        finally:
            for child in children:
                child.close()
        time.sleep(SETTLE_S)
        started = time.perf_counter()
        pool = factory.pool(base, 0, maximum=n, demand=lambda: n)
        try:
            ready = pool.prefill(timeout=max(120.0, 10.0 * n))
            prefills.append(time.perf_counter() - started)
        finally:
            factory.drop_pool(base)
        if ready != n:
            raise RuntimeError(f"prefill: only {ready} of {n} children were made ready")
    prefill_s, fork_s = (sorted(times)[len(times) // 2] for times in (prefills, forks))
    return {
        f"prefill{n}_s": round(prefill_s, 3),
        f"fork{n}_warm_s": round(fork_s, 3),
        f"prefill{n}_over_fork_warm": round(prefill_s / fork_s, 2),
    }


def measure_plugin_overhead(plan: BenchPlan, pooled_p50: float, progress: Callable[[str], None]) -> dict[str, Any]:
    """Per-test overhead through the real plugin (generated suite, and an external one when given), with ratios."""
    from pytest_forkd.cli.overhead_bench import measure_external, measure_overhead

    result: dict[str, Any] = {"overhead_pool_prefill": plan.prefill}
    if plan.overhead_tests > 0:
        result.update(measure_overhead(plan.overhead_tests, accel=plan.accel, prefill=plan.prefill, progress=progress))
        result["overhead_p95_over_pooled_fork_p50"] = round(result["overhead_10ms"]["p95"] / pooled_p50, 2)
        result["overhead_p50_over_pooled_fork_p50"] = round(result["overhead_0ms"]["p50"] / pooled_p50, 2)
        result["overhead_100ms_p95_over_pooled_fork_p50"] = round(result["overhead_100ms"]["p95"] / pooled_p50, 2)
    if plan.external_suite is not None:
        external = measure_external(
            plan.external_suite,
            command=plan.external_command,
            accel=plan.accel,
            extra_args=["--forkd-pool-prefill"] if plan.prefill else [],
            progress=progress,
        )
        external["overhead_p95_over_pooled_fork_p50"] = round(external["overhead_ms"]["p95"] / pooled_p50, 2)
        external["overhead_p50_over_pooled_fork_p50"] = round(external["overhead_ms"]["p50"] / pooled_p50, 2)
        result["external_suite"] = external
    return result
