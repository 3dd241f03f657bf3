"""``forkd bench`` as one run: the core part (boots, forks, execs, copies, branches) and the other parts."""

from __future__ import annotations

import time
from typing import Any, Callable

from pytest_forkd.core.factory import VMFactory
from pytest_forkd.errors import InvalidArgument
from pytest_forkd.image import ensure_image
from pytest_forkd.storage.store import SnapshotStore

from .branches import measure_branches
from .changes import measure_changes
from .common import PARTS, BenchPlan, _conditions, _ms, _wait_for, figure
from .cpu import measure_child_cpu
from .e2b import measure_e2b
from .forks import measure_parallel_fork, measure_plugin_overhead, measure_prefill, restore_breakdown
from .guest_io import (
    COPY_TREE_MIB,
    OUTPUT_MIB,
    copy_mib_s,
    copy_reference_mib_s,
    exec_output_mib_s,
    spawn_first_line_ms,
)
from .images import measure_images
from .pauses import UFFD_SAMPLES, measure_diff_series, measure_uffd_pause
from .pss import measure_memory
from .speed import measure_guest_speed


def run_bench(plan: BenchPlan, progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    unknown = sorted(set(plan.parts) - set(PARTS))
    if unknown or not plan.parts:
        raise InvalidArgument(
            f"unknown bench part(s) {', '.join(unknown) or '(none given)'}: --parts takes a "
            f"comma-separated list of {', '.join(PARTS)}"
        )
    if "diff" in plan.parts and plan.diff_branches < 10:
        raise InvalidArgument(
            f"--diff-branches {plan.diff_branches} is too few: the diff part compares the 10th "
            "branch with the 2nd, so give at least 10"
        )
    factory = VMFactory(accel=plan.accel)
    try:
        result = _run(factory, plan, progress) if "core" in plan.parts else {}
        parts = _run_parts(factory, plan, progress)
        conditions = {**result.get("conditions", {}), **parts.pop("conditions")}
        result.update(parts, conditions=conditions)
        return result
    finally:
        factory.close()


def _run_parts(factory: VMFactory, plan: BenchPlan, progress: Callable[[str], None]) -> dict[str, Any]:
    """The uffd, diff, memory, speed and cpu parts: each a few figures with ratios taken in this run."""
    result: dict[str, Any] = {}
    if "uffd" in plan.parts:
        result.update(
            measure_uffd_pause(
                factory, sorted({min(plan.memory_mib), max(plan.memory_mib)}), max(plan.repeats, UFFD_SAMPLES), progress
            )
        )
    if {"diff", "memory", "speed", "cpu"} & set(plan.parts):
        memory_mib = min(plan.memory_mib)
        root = factory.boot(memory_mib=memory_mib)
        base = root.freeze(f"bench-parts-m{memory_mib}", keep_running=False)
        try:
            if "diff" in plan.parts:
                result.update(measure_diff_series(factory, base, plan.diff_branches, progress))
            if "memory" in plan.parts:
                result.update(measure_memory(factory, base, plan.idle_children, progress))
            if "speed" in plan.parts:
                result.update(measure_guest_speed(factory, base, max(3, plan.repeats // 2), progress))
            if "cpu" in plan.parts:
                result.update(measure_child_cpu(factory, base, progress, children=plan.cpu_children))
        finally:
            SnapshotStore(base.path.parent).remove(base.tag, cascade=True)
    if "images" in plan.parts:
        result.update(measure_images(factory, plan.repeats, progress, large_mib=plan.image_mib))
    if "e2b" in plan.parts:
        result.update(measure_e2b(plan.repeats, progress, accel=plan.accel, required=set(plan.parts) != set(PARTS)))
    if "core" not in plan.parts:
        result["conditions"] = _conditions(factory, plan, factory.accel_verdict(ensure_image("default")))
    result.setdefault("conditions", {})["parts"] = list(plan.parts)
    return result


def _run(factory: VMFactory, plan: BenchPlan, progress: Callable[[str], None]) -> dict[str, Any]:
    boots, forks, pooled, overhead, execs, pings = [], [], [], [], [], []
    first_memory = plan.memory_mib[0]
    if not plan.overhead_only:
        progress(f"cold boots: {plan.boots} x {first_memory} MiB")
    for _ in range(0 if plan.overhead_only else plan.boots):
        started = time.perf_counter()
        vm = factory.boot(memory_mib=first_memory, network=plan.network)
        boots.append(_ms(started))
        vm.close()

    root = factory.boot(memory_mib=first_memory, network=plan.network)
    image = root.image
    base = root.freeze("bench-base", keep_running=False)
    progress(f"forks: {plan.repeats} without pool, {plan.repeats} from a pool of 1")
    phases: list[dict[str, Any]] = []
    for _ in range(plan.repeats):
        started = time.perf_counter()
        child = factory.fork_snapshot(base, 1)[0]
        forks.append(_ms(started))
        started = time.perf_counter()
        child.agent.exec(["true"])  # what a pool adds before parking a child: its first guest command
        if child.restore_phases is not None:
            phases.append({**child.restore_phases.to_dict(), "warm_ms": _ms(started)})
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
    rounds = max(3, plan.repeats)
    parallel = (
        {
            **measure_parallel_fork(factory, base, plan.parallel_n, progress, rounds=rounds),
            **measure_prefill(factory, base, plan.parallel_n, progress, rounds=rounds),
        }
        if plan.parallel_n > 1
        else {}
    )
    if plan.overhead_only:
        return {
            "conditions": _conditions(factory, plan, factory.accel_verdict(image)),
            "fork_ms": figure(forks),
            "restore_phases_ms": restore_breakdown(phases),
            "fork_pooled_ms": figure(pooled),
            **measure_plugin_overhead(plan, figure(pooled)["p50"], progress),
            **parallel,
        }

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
    progress(f"exec output: {max(3, plan.repeats // 2)} x {OUTPUT_MIB} MiB of stdout")
    output = exec_output_mib_s(child, OUTPUT_MIB, max(3, plan.repeats // 2))
    progress("spawn: time to the first output line of a spawned `echo`")
    spawns = spawn_first_line_ms(child, max(10, plan.repeats * 4))
    progress(f"copy_in/copy_out: {max(2, plan.repeats // 2)} x a {COPY_TREE_MIB} MiB tree each way")
    copied_in, copied_out = copy_mib_s(child, COPY_TREE_MIB, max(2, plan.repeats // 2))
    child.close()
    changes_figures = measure_changes(factory, base, plan, progress)

    progress("asyncio: three `sleep 1` gathered in three VMs and in one, a cancelled `sleep 30`")
    from pytest_forkd.aio.bench import measure_async

    async_samples = measure_async(base, max(2, plan.repeats // 2))

    copy_reference: list[float] = []
    for memory_mib in plan.memory_mib:
        progress(f"copy reference: {memory_mib} MiB on {factory.run_dir.path.parent}")
        copy_reference += copy_reference_mib_s(factory.run_dir.path, memory_mib, max(2, plan.repeats // 2))
    branch_rows = measure_branches(factory, plan, progress)
    progress("start-up: import pytest_forkd, pytest --co with and without the plugin")
    from pytest_forkd.cli.startup_bench import startup_samples

    startup = startup_samples(plan.repeats)

    through_plugin = measure_plugin_overhead(plan, figure(pooled)["p50"], progress)

    return {
        "conditions": _conditions(factory, plan, factory.accel_verdict(image)),
        "cold_boot_ms": figure(boots),
        "fork_ms": figure(forks),
        "restore_phases_ms": restore_breakdown(phases),
        "fork_pooled_ms": figure(pooled),
        "fixture_overhead_ms": figure(overhead),
        **through_plugin,
        **parallel,
        "exec_rtt_ms": figure(execs),
        "ping_rtt_ms": figure(pings),
        "exec_output_mib_s": figure(output),
        "spawn_ms": figure(spawns),
        "copy_in_mib_s": figure(copied_in),
        "copy_out_mib_s": figure(copied_out),
        **{name: figure(values) for name, values in async_samples.items()},
        "copy_reference_mib_s": figure(copy_reference),
        **{name: figure(values) for name, values in startup.items()},
        **changes_figures,
        "branch": branch_rows,
    }
