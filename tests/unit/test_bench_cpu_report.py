"""CPU per child and the host report of ``forkd bench``, without a VM: parsing, summaries, Markdown, arguments."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pytest_forkd.cli import build_parser
from pytest_forkd.cli.bench import restore_breakdown
from pytest_forkd.cli.bench.cpu import tcg_work
from pytest_forkd.cli.bench.report import REPORT_JSON, REPORT_MARKDOWN, ReportPlan, render_markdown, write_report
from pytest_forkd.cli.bench_cmd import run
from pytest_forkd.core.factory import RestorePhases, process_cpu_ms
from pytest_forkd.engine.fake import FakeMachine
from pytest_forkd.engine.qemu.machine import Machine
from pytest_forkd.engine.qemu.qmp import QMPError
from pytest_forkd.errors import ConfigError

# `info jit` of a QEMU 7.2 child after its first reply (trimmed), lines end in CRLF as HMP sends them.
INFO_JIT = (
    "Translation buffer state:\r\n"
    "gen code size       6773347/1073736704\r\n"
    "TB count            12147\r\n"
    "TB avg target size  18 max=465 bytes\r\n"
    "cross page TB count 35 (0%)\r\n"
    "\r\n"
    "Statistics:\r\n"
    "TB flush count      1\r\n"
    "TB invalidate count 0\r\n"
    "TLB full flushes    0\r\n"
)


class FakeQMP:
    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.calls: list[tuple[str, Any]] = []

    def execute(self, command: str, arguments: Any = None) -> Any:
        self.calls.append((command, arguments))
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def qemu_machine(qmp: Any) -> Machine:
    """A QEMU machine object with a stand-in QMP client (no process behind it)."""
    machine = Machine.__new__(Machine)
    machine.qmp = qmp
    return machine


def test_translation_stats_read_blocks_code_size_flushes_and_invalidations() -> None:
    qmp = FakeQMP(INFO_JIT)
    assert qemu_machine(qmp).translation_stats() == {
        "gen_code_bytes": 6773347,
        "tb_count": 12147,
        "tb_flushes": 1,
        "tb_invalidations": 0,
    }
    assert qmp.calls == [("human-monitor-command", {"command-line": "info jit"})]


@pytest.mark.parametrize(
    "answer",
    ["JIT information is only available with accel=tcg\r\n", QMPError("CommandNotFound: no such command")],
    ids=["kvm", "error"],
)
def test_translation_stats_are_empty_without_translation(answer: Any) -> None:
    assert qemu_machine(FakeQMP(answer)).translation_stats() == {}


def test_tcg_work_asks_the_engine_and_is_empty_for_one_that_translates_nothing() -> None:
    assert tcg_work(SimpleNamespace(machine=qemu_machine(FakeQMP(INFO_JIT))))["tb_count"] == 12147  # type: ignore[arg-type]
    assert tcg_work(SimpleNamespace(machine=FakeMachine.__new__(FakeMachine))) == {}  # type: ignore[arg-type]


def test_process_cpu_ms_is_precise_enough_for_a_phase_and_none_for_a_missing_process() -> None:
    before = process_cpu_ms(os.getpid())
    assert before is not None and before > 0
    deadline = time.process_time() + 0.03
    while time.process_time() < deadline:  # 30 ms of CPU: three clock ticks, thousands of schedstat units
        pass
    after = process_cpu_ms(os.getpid())
    assert after is not None and 20 <= after - before < 1000
    assert process_cpu_ms(2**22 + 12345) is None  # above pid_max's largest default: no such process


def test_restore_phases_record_cpu_per_phase_when_given_the_pid() -> None:
    phases = RestorePhases()
    mark = time.perf_counter()
    deadline = time.process_time() + 0.02
    while time.process_time() < deadline:
        pass
    mark = phases.lap("qemu_start_ms", mark, os.getpid())
    phases.lap("device_state_ms", mark)  # no pid: wall time only
    assert phases.qemu_start_ms >= 15
    assert set(phases.cpu_ms) == {"qemu_start_ms"} and phases.cpu_ms["qemu_start_ms"] >= 15
    data = phases.to_dict()
    assert "_cpu_mark" not in data and data["cpu_ms"] == phases.cpu_ms


def test_restore_breakdown_summarises_the_cpu_of_each_phase() -> None:
    rows = [
        {**RestorePhases(qemu_start_ms=50.0, first_reply_ms=100.0).to_dict(), "cpu_ms": {"qemu_start_ms": c}}
        for c in (20.0, 30.0, 40.0)
    ]
    result = restore_breakdown(rows)
    assert result["cpu_ms"]["qemu_start_ms"]["p50"] == 30.0 and result["cpu_ms"]["qemu_start_ms"]["n"] == 3
    assert "cpu_ms" not in result["share_of_p50"]  # shares are of wall time only


def figure(p50: float) -> dict[str, float]:
    return {"n": 3, "min": p50 - 1, "p50": p50, "p95": p50 + 1, "max": p50 + 2}


def sample_result() -> dict[str, Any]:
    cpu = {name: {**figure(value), "mean": value} for name, value in (("qemu_start", 29.5), ("to_first_true", 256.3))}
    return {
        "conditions": {
            "accel": "tcg",
            "accel_reason": "KVM unusable: the probe failed; using TCG",
            "cpus": 2,
            "qemu": "7.2.22",
            "kernel": "6.18",
            "quick": True,
            "date": "2026-12-06T03:00:00+0000",
        },
        "cold_boot_ms": figure(2100.0),
        "fork_ms": figure(140.0),
        "fork_pooled_ms": figure(9.0),
        "restore_phases_ms": {"qemu_start_ms": figure(40.0), "cpu_ms": {"qemu_start_ms": figure(29.0)}},
        "fork10_parallel_s": 1.5,
        "fork10_serial_s": 6.0,
        "fork10_parallel_per_s": 6.7,
        "fork10_parallel_speedup": 4.0,
        "cpu_per_child_ms": cpu,
        "cpu_per_child_conditions": {"children": 12, "host_load_1min_before": 1.0, "host_load_1min_after": 1.5},
        "tcg_translation": {"tb_count": figure(31700.0), "gen_code_bytes": figure(17.0 * 2**20)},
        "uffd_pause_figures": {"1024": figure(12.0), "256": figure(10.0)},
        "uffd_growth_ratio": 1.2,
        "diff_pause_ms": figure(14.0),
        "diff_pause_10th_over_2nd": 0.94,
        "child_pss_mib": 48.7,
        "child_pss_parts_mib": {"tcg_code": 18.0},
        "parent_pss_mib": 67.1,
    }


def test_the_markdown_report_names_the_host_and_every_group_of_figures() -> None:
    text = render_markdown(sample_result())
    assert text.startswith("# forkd bench report: TCG, 2 CPUs")
    assert "KVM unusable: the probe failed" in text and "`forkd bench --report --quick`" in text
    for heading in ("## Forks", "## CPU per child", "## Branch pauses", "## Memory"):
        assert heading in text
    assert "| **spawn to first answered `true`** | 256.3 | 256.3 (257.3) |" in text
    assert "| qemu_start | 40.0 (41.0) | 29.0 (30.0) |" in text
    assert "31700 translation blocks, 17.0 MiB" in text
    assert "**4.0x** the throughput" in text
    # Memory sizes in numeric order, not as strings ("1024" < "256").
    assert text.index("256 MiB guest") < text.index("1024 MiB guest")
    assert "Idle child PSS: **48.7 MiB**" in text


def test_a_report_without_uffd_says_so() -> None:
    result = sample_result()
    del result["uffd_pause_figures"], result["uffd_growth_ratio"]
    assert "| uffd (live) pause | not available on this host | |" in render_markdown(result)


def test_write_report_writes_the_json_and_the_markdown(tmp_path: Path) -> None:
    json_path, markdown_path = write_report(tmp_path / "out", sample_result())
    assert (json_path.name, markdown_path.name) == (REPORT_JSON, REPORT_MARKDOWN)
    assert json.loads(json_path.read_text()) == sample_result()
    assert markdown_path.read_text() == render_markdown(sample_result())


def test_quick_takes_fewer_samples_than_the_full_report() -> None:
    quick, full = ReportPlan(quick=True), ReportPlan()
    for name in ("boots", "repeats", "fork_n", "fork_rounds", "uffd_samples", "diff_branches", "tax_children"):
        assert getattr(quick, name) < getattr(full, name), name
    assert quick.diff_branches >= 10  # the 10th-over-2nd drift figure needs ten branches


def test_quick_without_report_is_refused_with_the_fix() -> None:
    args = build_parser().parse_args(["bench", "--quick"])
    with pytest.raises(ConfigError, match=r"--quick only applies to --report DIR: add --report DIR"):
        run(args)


def test_a_report_path_that_is_a_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "report.json"
    target.write_text("{}")
    args = build_parser().parse_args(["bench", "--report", str(target)])
    with pytest.raises(ConfigError, match="not a directory"):
        run(args)
