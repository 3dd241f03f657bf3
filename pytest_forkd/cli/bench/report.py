"""``forkd bench --report DIR``: one JSON and one Markdown report of a host, comparable across hosts.

The same figures on every host (a laptop with KVM, a CI runner, a nested
virtual machine under TCG) so that their columns can be put side by side:
the host (kernel, CPUs, accelerator and why, QEMU), cold boot, fork, pooled
fork, the restore phases, ``fork(n)`` against ``n`` serial forks, branch
pauses (live ``uffd`` and successive ``diff``), QEMU CPU per child by phase,
the first-command tax and the PSS of idle children. ``quick`` keeps it to a
few minutes on a 2-core TCG host; without it every figure has more samples.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pytest_forkd.core.factory import VMFactory
from pytest_forkd.storage.store import SnapshotStore

from .common import BenchPlan, _conditions, _ms, _wait_for, figure
from .cpu import CPU_CHILDREN, measure_child_cpu
from .forks import measure_parallel_fork, restore_breakdown
from .pauses import UFFD_SAMPLES, measure_diff_series, measure_uffd_pause
from .pss import measure_memory

REPORT_JSON = "forkd-report.json"
REPORT_MARKDOWN = "forkd-report.md"


@dataclass(frozen=True)
class ReportPlan:
    """How many samples each figure of the report gets."""

    quick: bool = False
    accel: str = "auto"

    @property
    def boots(self) -> int:
        return 1 if self.quick else 3

    @property
    def repeats(self) -> int:
        return 3 if self.quick else 7

    @property
    def fork_n(self) -> int:
        return 10 if self.quick else 20

    @property
    def fork_rounds(self) -> int:
        return 1 if self.quick else 3

    @property
    def uffd_memory(self) -> list[int]:
        return [256, 1024]

    @property
    def uffd_samples(self) -> int:
        return 5 if self.quick else UFFD_SAMPLES

    @property
    def diff_branches(self) -> int:
        return 10 if self.quick else 30

    @property
    def tax_children(self) -> int:
        return 2 if self.quick else 4


def run_report(plan: ReportPlan, progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Measure every figure of the report on this host (see the module's docstring)."""
    started_at = time.perf_counter()
    load_before = os.getloadavg()
    factory = VMFactory(accel=plan.accel)
    try:
        progress(f"cold boots: {plan.boots} x 256 MiB")
        boots = []
        for _ in range(plan.boots):
            started = time.perf_counter()
            factory.boot(memory_mib=256).close()
            boots.append(_ms(started))
        root = factory.boot(memory_mib=256)
        image = root.image
        base = root.freeze("report-base", keep_running=False)
        try:
            result: dict[str, Any] = {"cold_boot_ms": figure(boots)}
            result.update(_forks(factory, base, plan, progress))
            result.update(measure_parallel_fork(factory, base, plan.fork_n, progress, rounds=plan.fork_rounds))
            result.update(measure_child_cpu(factory, base, progress, CPU_CHILDREN, plan.tax_children))
            result.update(measure_diff_series(factory, base, plan.diff_branches, progress))
            result.update(measure_memory(factory, base, 4, progress))
        finally:
            SnapshotStore(base.path.parent).remove(base.tag, cascade=True)
        result.update(measure_uffd_pause(factory, plan.uffd_memory, plan.uffd_samples, progress))
        bench_plan = BenchPlan(repeats=plan.repeats, boots=plan.boots, accel=plan.accel, parts=["report"])
        conditions = _conditions(factory, bench_plan, factory.accel_verdict(image))
        conditions.update(
            quick=plan.quick,
            host_load_1min_before=round(load_before[0], 2),
            host_load_1min_after=round(os.getloadavg()[0], 2),
            duration_s=round(time.perf_counter() - started_at, 1),
            cpu_model=_cpu_model(),
        )
        return {"report_format": 1, "conditions": conditions, **result}
    finally:
        factory.close()


def _forks(factory: VMFactory, base: Any, plan: ReportPlan, progress: Callable[[str], None]) -> dict[str, Any]:
    """fork(1) without a pool (with its restore phases) and from a pool of one."""
    progress(f"forks: {plan.repeats} without pool, {plan.repeats} from a pool of 1")
    forks, pooled, phases = [], [], []
    for _ in range(plan.repeats):
        started = time.perf_counter()
        child = factory.fork_snapshot(base, 1)[0]
        forks.append(_ms(started))
        if child.restore_phases is not None:
            phases.append(child.restore_phases.to_dict())
        child.close()
    pool = factory.pool(base, 1)
    try:
        for _ in range(plan.repeats):
            _wait_for(lambda: len(pool) >= 1, timeout=120)
            started = time.perf_counter()
            child = factory.fork_snapshot(base, 1)[0]
            child.ping()
            pooled.append(_ms(started))
            child.close()
    finally:
        factory.drop_pool(base)
    return {"fork_ms": figure(forks), "fork_pooled_ms": figure(pooled), "restore_phases_ms": restore_breakdown(phases)}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def write_report(directory: Path, result: dict[str, Any]) -> tuple[Path, Path]:
    """Write ``forkd-report.json`` and ``forkd-report.md`` into ``directory`` (created if missing)."""
    directory.mkdir(parents=True, exist_ok=True)
    json_path = directory / REPORT_JSON
    markdown_path = directory / REPORT_MARKDOWN
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    markdown_path.write_text(render_markdown(result))
    return json_path, markdown_path


def _p50(fig: Any, digits: int = 1) -> str:
    """``p50 (p95)`` of a figure, or a dash when the run has no such figure."""
    if not isinstance(fig, dict) or "p50" not in fig:
        return "-"
    return f"{fig['p50']:.{digits}f} ({fig['p95']:.{digits}f})"


def render_markdown(result: dict[str, Any]) -> str:
    """The report as Markdown: the conditions first, then one table per group of figures."""
    c = result.get("conditions", {})
    lines = [
        f"# forkd bench report: {c.get('accel', '?').upper()}, {c.get('cpus', '?')} CPUs",
        "",
        f"Measured {c.get('date', '?')} by `forkd bench --report{' --quick' if c.get('quick') else ''}` "
        f"in {c.get('duration_s', '?')} s.",
        "",
        "| condition | value |",
        "|---|---|",
        f"| accelerator | {c.get('accel', '?')} ({c.get('accel_reason', '')}) |",
        f"| QEMU | {c.get('qemu', '?')} |",
        f"| kernel | {c.get('kernel', '?')} |",
        f"| CPUs | {c.get('cpus', '?')} x {c.get('cpu_model', '?')} |",
        f"| load average (1 min) before, after | {c.get('host_load_1min_before', '?')}, "
        f"{c.get('host_load_1min_after', '?')} |",
        f"| free page reporting | {c.get('free_page_reporting', '?')} |",
        f"| VMs' files | {c.get('store', '?')} |",
        "",
        "Figures are `p50 (p95)` in ms over their samples (`n`); absolute times move with the host's "
        "load, ratios within one run much less.",
        "",
        "## Forks",
        "",
        "| figure | p50 (p95) | n |",
        "|---|---|---|",
    ]
    for name, label in (
        ("cold_boot_ms", "cold boot (process start to first agent reply)"),
        ("fork_ms", "fork(1), no pool (snapshot to first reply)"),
        ("fork_pooled_ms", "fork(1) from a pool (pre-restored child to first reply)"),
    ):
        fig = result.get(name)
        lines.append(f"| {label} | {_p50(fig)} | {fig.get('n', '-') if isinstance(fig, dict) else '-'} |")
    phases = result.get("restore_phases_ms", {})
    cpu_phases = phases.get("cpu_ms", {})
    lines += ["", "Restore phases of fork(1), wall and QEMU CPU:", "", "| phase | wall | CPU |", "|---|---|---|"]
    for name in ("qemu_start_ms", "memory_ms", "device_state_ms", "first_reply_ms", "forwards_ms"):
        lines.append(f"| {name.removesuffix('_ms')} | {_p50(phases.get(name))} | {_p50(cpu_phases.get(name))} |")
    fork_n = next((key for key in result if key.startswith("fork") and key.endswith("_parallel_speedup")), None)
    if fork_n is not None:
        n = fork_n.removeprefix("fork").removesuffix("_parallel_speedup")
        lines += [
            "",
            f"fork({n}) against {n} serial kept fork(1): {result[f'fork{n}_parallel_s']} s against "
            f"{result[f'fork{n}_serial_s']} s, **{result[fork_n]}x** the throughput "
            f"({result[f'fork{n}_parallel_per_s']} children/s).",
        ]
        if f"prefill{n}_s" in result:
            lines += [
                "",
                f"A pool's prefill of {n} children: {result[f'prefill{n}_s']} s against "
                f"{result[f'fork{n}_warm_s']} s for fork({n}) and a first command in each "
                f"(**{result[f'prefill{n}_over_fork_warm']}x**).",
            ]
    lines += _cpu_section(result)
    lines += ["", "## Branch pauses", "", "| figure | p50 (p95) | n |", "|---|---|---|"]
    for size, fig in sorted(result.get("uffd_pause_figures", {}).items(), key=lambda item: int(item[0])):
        lines.append(f"| uffd (live) pause, {size} MiB guest | {_p50(fig)} | {fig['n']} |")
    if "uffd_growth_ratio" in result:
        lines.append(f"| uffd pause, largest over smallest guest | {result['uffd_growth_ratio']}x | |")
    if "diff_pause_ms" in result:
        fig = result["diff_pause_ms"]
        lines.append(f"| diff pause, {fig['n']} successive branches of one VM | {_p50(fig)} | {fig['n']} |")
        lines.append(f"| diff pause, 10th over 2nd | {result.get('diff_pause_10th_over_2nd')}x | |")
    if "uffd_pause_figures" not in result:
        lines.append("| uffd (live) pause | not available on this host | |")
    lines += [
        "",
        "## Memory",
        "",
        f"Idle child PSS: **{result.get('child_pss_mib', '-')} MiB** "
        f"(by kind: {', '.join(f'{k} {v}' for k, v in result.get('child_pss_parts_mib', {}).items())}); "
        f"working parent PSS: {result.get('parent_pss_mib', '-')} MiB.",
        "",
    ]
    return "\n".join(lines)


def _cpu_section(result: dict[str, Any]) -> list[str]:
    cpu = result.get("cpu_per_child_ms", {})
    conditions = result.get("cpu_per_child_conditions", {})
    lines = [
        "",
        "## CPU per child",
        "",
        f"QEMU CPU (user + system) of {conditions.get('children', '?')} serial fork(1), by phase "
        f"(load average {conditions.get('host_load_1min_before', '?')} before, "
        f"{conditions.get('host_load_1min_after', '?')} after):",
        "",
        "| phase | mean | p50 (p95) |",
        "|---|---|---|",
    ]
    for name, label in (
        ("qemu_start", "QEMU start until QMP answers"),
        ("memory", "guest memory prepared"),
        ("device_state", "device state load and resume"),
        ("first_reply", "guest resume to first reply"),
        ("first_command", "first command (`true`)"),
        ("warm_command", "second command (`true`), for comparison"),
        ("teardown", "teardown"),
        ("to_first_true", "**spawn to first answered `true`**"),
        ("total", "total with teardown"),
    ):
        fig = cpu.get(name)
        if isinstance(fig, dict):
            lines.append(f"| {label} | {fig.get('mean', '-')} | {_p50(fig)} |")
    jit = result.get("tcg_translation")
    if jit:
        lines += [
            "",
            f"TCG translation after the first `true`: {jit['tb_count']['p50']:.0f} translation blocks, "
            f"{jit['gen_code_bytes']['p50'] / 2**20:.1f} MiB of generated code per child (p50).",
        ]
    tax = result.get("first_command_tax")
    if tax:
        lines += [
            "",
            f"First-command tax (`{tax['command']}`): first in a fresh child {_p50(tax['first_ms'], 0)} ms, "
            f"again in the same child {_p50(tax['warm_ms'], 0)} ms ({tax['first_over_warm']}x); QEMU CPU "
            f"{_p50(tax.get('first_cpu_ms'), 0)} against {_p50(tax.get('warm_cpu_ms'), 0)} ms.",
        ]
    return lines
