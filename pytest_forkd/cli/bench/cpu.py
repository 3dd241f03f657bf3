"""CPU per child: what the QEMU process of one ``fork(1)`` spends, by phase, and its translation work.

Under TCG a child costs CPU rather than waiting: every QEMU process
translates the guest code it runs for the first time, so the CPU a child
uses (not the wall time, which the host's load stretches) is what bounds how
many children a second a host can make. The figures are read from /proc at
each phase boundary (see ``RestorePhases.cpu_ms``); the teardown from the
resource usage of the reaped process. Children are forked one after another,
without a pool, and closed once measured.
"""

from __future__ import annotations

import os
import resource
import shlex
import time
from typing import Any, Callable

from pytest_forkd.core.factory import VMFactory, process_cpu_ms
from pytest_forkd.core.vm import VM

from .common import figure

#: Children measured: the mean over 12 ``fork(1)`` is the figure the CPU target is stated in.
CPU_CHILDREN = 12
#: The phases of :class:`~pytest_forkd.core.factory.RestorePhases` with their CPU, in order.
RESTORE_PHASES = ("qemu_start_ms", "memory_ms", "device_state_ms", "first_reply_ms", "forwards_ms")
#: A first command that runs real guest code (an interpreter and two modules), for the first-command tax.
TAX_COMMAND = ["python3", "-c", "import json, subprocess"]


def _children_cpu_ms() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (usage.ru_utime + usage.ru_stime) * 1000


def tcg_work(vm: VM) -> dict[str, int]:
    """The TCG translation state of ``vm``'s QEMU process, empty when it has none.

    ``tb_count``: translation blocks alive; ``gen_code_bytes``: host code
    generated for them; ``tb_flushes`` and ``tb_invalidations``: how often
    translated code was thrown away (all of it, or the blocks of a page the
    guest wrote). Under KVM there is no translation and the answer is empty.
    """
    return vm.machine.translation_stats()


def _command_cpu(vm: VM, argv: list[str]) -> tuple[float, float | None]:
    """Wall ms and QEMU CPU ms of one guest command, through the agent (no history, no timing rows)."""
    before = process_cpu_ms(vm.machine.pid)
    started = time.perf_counter()
    vm.agent.exec(argv)
    wall = (time.perf_counter() - started) * 1000
    after = process_cpu_ms(vm.machine.pid)
    return wall, (after - before) if before is not None and after is not None else None


def measure_child_cpu(
    factory: VMFactory,
    base: Any,
    progress: Callable[[str], None],
    children: int = CPU_CHILDREN,
    tax_children: int = 3,
) -> dict[str, Any]:
    """Per-child QEMU CPU by phase over ``children`` serial ``fork(1)``, and the first-command tax.

    Returns ``cpu_per_child_ms`` (a figure per phase: the restore phases,
    ``first_command`` (``true``), ``warm_command`` (a second ``true``),
    ``teardown``; ``to_first_true``: spawn to the first answered ``true``, the
    figure the per-child target is stated in; ``total``), ``tcg_translation``
    (``info jit`` after the first ``true``) and ``first_command_tax`` (wall and
    CPU of :data:`TAX_COMMAND` run first in ``tax_children`` fresh children,
    then again in the same child).
    """
    progress(f"CPU per child: {children} x fork(1), QEMU CPU read at each phase boundary")
    load_before = os.getloadavg()
    rows: list[dict[str, float]] = []
    jit: list[dict[str, int]] = []
    tax: dict[str, list[float]] = {"first_ms": [], "warm_ms": [], "first_cpu_ms": [], "warm_cpu_ms": []}
    for index in range(children):
        child = factory.fork_snapshot(base, 1)[0]
        row: dict[str, float] = {}
        try:
            phases = child.restore_phases
            cpu_phases = dict(phases.cpu_ms) if phases is not None else {}
            for name in RESTORE_PHASES:
                if name in cpu_phases:
                    row[name.removesuffix("_ms")] = cpu_phases[name]
            _, first = _command_cpu(child, ["true"])
            if first is not None:
                row["first_command"] = first
            jit.append(tcg_work(child))
            _, warm = _command_cpu(child, ["true"])
            if warm is not None:
                row["warm_command"] = warm
            if index < tax_children:
                first_wall, first_cpu = _command_cpu(child, TAX_COMMAND)
                warm_wall, warm_cpu = _command_cpu(child, TAX_COMMAND)
                tax["first_ms"].append(first_wall)
                tax["warm_ms"].append(warm_wall)
                if first_cpu is not None and warm_cpu is not None:
                    tax["first_cpu_ms"].append(first_cpu)
                    tax["warm_cpu_ms"].append(warm_cpu)
            last = process_cpu_ms(child.machine.pid)
        finally:
            reaped_before = _children_cpu_ms()
            child.close()
        # The reaped process's whole CPU lands in this process's children's usage when it is
        # reaped; minus what it had used before close, that is its teardown (exit, unmapping).
        lifetime = _children_cpu_ms() - reaped_before
        if last is not None and lifetime >= last:
            row["teardown"] = lifetime - last
        if all(key in row for key in ("qemu_start", "device_state", "first_reply", "first_command")):
            row["to_first_true"] = (
                sum(row.get(name.removesuffix("_ms"), 0.0) for name in RESTORE_PHASES) + row["first_command"]
            )
            if "teardown" in row:
                row["total"] = row["to_first_true"] + row["teardown"]
        rows.append(row)
    names = [name for name in rows[0] if all(name in row for row in rows)] if rows else []
    per_phase: dict[str, Any] = {name: figure([row[name] for row in rows]) for name in names}
    for name in names:
        per_phase[name]["mean"] = round(sum(row[name] for row in rows) / len(rows), 2)
    result: dict[str, Any] = {
        "cpu_per_child_ms": per_phase,
        "cpu_per_child_conditions": {
            "children": children,
            "source": "sum of /proc/PID/task/*/schedstat at phase boundaries; teardown from RUSAGE_CHILDREN",
            "host_load_1min_before": round(load_before[0], 2),
            "host_load_1min_after": round(os.getloadavg()[0], 2),
        },
    }
    jit = [work for work in jit if work]
    if jit:
        result["tcg_translation"] = {key: figure([float(work[key]) for work in jit]) for key in sorted(jit[0])}
    if tax["first_ms"]:
        summary: dict[str, Any] = {"command": shlex.join(TAX_COMMAND)}
        summary.update({name: figure(values) for name, values in tax.items() if values})
        summary["first_over_warm"] = round(summary["first_ms"]["p50"] / max(summary["warm_ms"]["p50"], 1e-3), 2)
        if tax["first_cpu_ms"]:
            summary["first_over_warm_cpu"] = round(
                summary["first_cpu_ms"]["p50"] / max(summary["warm_cpu_ms"]["p50"], 1e-3), 2
            )
        result["first_command_tax"] = summary
    return result
