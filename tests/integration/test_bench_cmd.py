"""`forkd bench` against real VMs: the JSON it prints and the sweep's PNG."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_forkd.core.runtime import Runtime
from pytest_forkd.engine import memory

FORKD = str(Path(sys.executable).parent / "forkd")
FIGURE_KEYS = {"n", "min", "p50", "p95", "max"}


def unavailable(backend: str) -> str | None:
    """Why the built-in ``backend`` cannot work on this host (as the forkd command sees it), or None."""
    return Runtime().backends.get(backend).unavailable_reason()


def run_forkd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([FORKD, *args], capture_output=True, text=True, timeout=600)


def assert_figure(figure: dict, n: int) -> None:
    assert set(figure) == FIGURE_KEYS
    assert figure["n"] == n
    assert 0 < figure["min"] <= figure["p50"] <= figure["p95"] <= figure["max"]


def test_bench_prints_every_figure_as_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = run_forkd(
        "bench",
        "--memory",
        "256",
        "--backends",
        "full,diff",
        "--dirty",
        "0,8",
        "--repeats",
        "2",
        "--boots",
        "1",
        "--overhead-tests",
        "2",
        "--parallel",
        "3",
        "--parts",
        "core,speed",
        "--json",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    assert json.loads(out.read_text()) == printed
    for group in ("0ms", "10ms", "100ms"):  # per-test overhead through the plugin, 2 tests per group
        figure = printed[f"overhead_{group}"]
        assert figure["n"] == 2 and 0 < figure["p50"] <= figure["p95"] <= figure["max"]
    assert printed["overhead_terminal_summary"]["n"] == 6
    assert printed["overhead_suite"]["pool_prefill"]["children"] >= 1
    assert printed["overhead_p95_over_pooled_fork_p50"] > 0 and printed["overhead_p50_over_pooled_fork_p50"] > 0
    assert printed["fork3_parallel_speedup"] > 0 and printed["fork3_serial_s"] > 0
    assert printed["fork3_speedup_over_closed_serial"] > 0 and printed["fork3_serial_closed_s"] > 0
    assert printed["prefill3_s"] > 0 and printed["fork3_warm_s"] > 0 and printed["prefill3_over_fork_warm"] > 0
    phases = printed["restore_phases_ms"]
    assert {"qemu_start_ms", "device_state_ms", "first_reply_ms", "warm_ms"} <= set(phases)
    assert_figure(phases["first_reply_ms"], 2)
    assert_figure(printed["cold_boot_ms"], 1)
    for name in ("fork_ms", "fork_pooled_ms", "fixture_overhead_ms"):
        assert_figure(printed[name], 2)
    assert_figure(printed["exec_rtt_ms"], 10)
    assert_figure(printed["exec_output_mib_s"], 3)
    assert_figure(printed["spawn_ms"], 10)  # time to the first output line of a spawned command
    assert_figure(printed["copy_in_mib_s"], 2)
    assert_figure(printed["copy_out_mib_s"], 2)
    for name in ("async_gather_3vm_ms", "async_gather_1vm_ms", "async_cancel_ms"):
        assert_figure(printed[name], 2)
    assert_figure(printed["copy_reference_mib_s"], 2)
    # Manifest and changes() on a generated 20,000-file tree (the figures, not a limit, are the point).
    assert_figure(printed["manifest_ms"], 2)
    assert_figure(printed["changes_ms"], 2)
    assert_figure(printed["manifest_cold_ms"], 1)
    tree = printed["changes_tree"]
    assert tree["files"] == 20000 and tree["paths"] > 20000
    assert (tree["added"], tree["modified"], tree["deleted"]) == (100, 150, 100)
    assert printed["conditions"]["accel"] in ("kvm", "tcg") and printed["conditions"]["parts"] == ["core", "speed"]
    assert printed["conditions"]["free_page_reporting"] is memory.free_page_reporting()
    # The speed part: guest Python against the host's, on children of the parts' own base.
    assert printed["guest_python_slowdown"] > 0
    assert_figure(printed["guest_python_s"], 3)
    rows = {(row["backend"], row["memory_mib"], row["dirty_mib"]): row for row in printed["branch"]}
    assert set(rows) == {("full", 256, 0), ("full", 256, 8), ("diff", 256, 0), ("diff", 256, 8)}
    for row in rows.values():
        assert_figure(row["pause_ms"], 2)
        assert_figure(row["total_ms"], 2)
        assert row["pause_ms"]["min"] <= row["total_ms"]["max"]


def test_bench_images_part_compares_children_of_container_images() -> None:
    """A tiny and a (here small) large image made by the bench, pulled, booted, forked; the busybox image's CPU."""
    result = run_forkd("bench", "--parts", "images", "--image-mib", "64", "--repeats", "3")
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    for image in ("image_tiny", "image_large", "image_default"):
        for name in ("fork_first_true_ms", "cpu_to_first_true_ms", "idle_pss_mib"):
            assert_figure(printed[image][name], 3)
    ratio = printed["image_large"]["fork_first_true_ms"]["p50"] / printed["image_tiny"]["fork_first_true_ms"]["p50"]
    assert printed["image_large_over_tiny_fork_first_true"] == pytest.approx(ratio, abs=0.01)
    assert printed["image_busybox_over_default_cpu_to_first_true"] > 0
    assert printed["image_large_contents_match"] is True
    assert printed["image_conditions"]["large_image_mib"] == 64 and printed["conditions"]["parts"] == ["images"]


def test_bench_e2b_part_times_the_sdk_against_forkd_own_calls() -> None:
    """E2B's Python SDK through forkd's E2B server, each figure beside forkd's own call; pause frees the VM."""
    from pytest_forkd.cli.bench.e2b import missing_sdk

    if missing_sdk() is not None:
        pytest.skip(missing_sdk())
    result = run_forkd("bench", "--parts", "e2b", "--repeats", "3")
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    figures = printed["e2b"]
    for name in ("create_first_command_ms", "fork_first_exec_ms", "fork10_ms", "vm_fork10_ms", "pause_ms", "resume_ms"):
        assert_figure(figures[name], 3)
    for name in ("fork1_answered_ms", "fork10_answered_ms", "vm_fork10_answered_ms"):  # until every child answered
        assert_figure(figures[name], 3)
    assert figures["fork10_answered_ms"]["min"] > figures["fork10_ms"]["min"]
    assert_figure(figures["paused_store_mib"], 3)  # the paused sandbox's own snapshot, on disk
    commands = (
        "command_ms",
        "exec_ms",
        "exec_beside_same_work_ms",
        "bash_login_exec_ms",
        "bash_login_exec_as_user_ms",
        "bash_login_spawn_as_user_ms",
    )
    for name in commands[:2]:  # the target's pair, sampled twice as often
        assert_figure(figures[name], 24)
    for name in commands[2:]:
        assert_figure(figures[name], 12)
    assert_figure(figures["command_beside_same_work_ms"], 4 * 12)  # in turn with each of four calls
    assert printed["e2b_conditions"]["accel"] in ("tcg", "kvm") and printed["e2b_conditions"]["cpus"] >= 1
    ratio = figures["command_ms"]["p50"] / figures["exec_ms"]["p50"]
    assert printed["e2b_ratios"]["command_over_exec"] == pytest.approx(ratio, abs=0.01)
    assert set(printed["e2b_targets"]) == set(printed["e2b_ratios"])
    assert printed["e2b_pause"]["qemu_process_left_after_pause"] is False
    assert printed["conditions"]["parts"] == ["e2b"]


def test_bench_refuses_unknown_parts_before_starting_anything() -> None:
    result = run_forkd("bench", "--parts", "core,warp")
    assert result.returncode == 4
    assert "unknown bench part(s) warp" in result.stderr and "core, uffd, diff, memory, speed" in result.stderr


def test_sweep_writes_json_and_a_png_of_every_backend_that_works_here(tmp_path: Path) -> None:
    """All three backends where userfaultfd is permitted; the others (named, with the reason) elsewhere."""
    pytest.importorskip("matplotlib")
    working = {name for name in ("full", "diff", "uffd") if unavailable(name) is None}
    assert {"full", "diff"} <= working
    plot = tmp_path / "sweep.png"
    result = run_forkd("bench", "--sweep", "--memory", "256", "--repeats", "1", "--plot", str(plot))
    assert result.returncode == 0, result.stderr
    document = json.loads(plot.with_suffix(".json").read_text())
    assert {row["backend"] for row in document["branch"]} == working
    if "uffd" not in working:
        assert "skipping backend uffd: userfaultfd is not permitted" in result.stderr
    assert [row["memory_mib"] for row in document["fork"]] == [256]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot.stat().st_size > 10_000


def test_bench_report_quick_writes_json_and_markdown_with_cpu_per_child(tmp_path: Path) -> None:
    """`forkd bench --report DIR --quick`: every group of figures, CPU per child by phase, the Markdown of it."""
    result = run_forkd("bench", "--report", str(tmp_path / "report"), "--quick")
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "report" / "forkd-report.json").read_text())
    markdown = (tmp_path / "report" / "forkd-report.md").read_text()
    assert result.stdout.strip() == markdown.strip()
    conditions = report["conditions"]
    assert conditions["quick"] is True and conditions["accel"] in ("kvm", "tcg") and conditions["qemu"]
    assert f"# forkd bench report: {conditions['accel'].upper()}" in markdown
    assert_figure(report["cold_boot_ms"], 1)
    assert_figure(report["fork_ms"], 3)
    assert_figure(report["fork_pooled_ms"], 3)
    assert report["fork10_parallel_speedup"] > 0
    # QEMU CPU per child by phase (the cpu part's measurement: `--parts cpu` runs the same one, see
    # tests/unit/test_bench_parts.py for which part runs what).
    cpu = report["cpu_per_child_ms"]
    for name in ("qemu_start", "device_state", "first_reply", "first_command", "warm_command", "teardown"):
        assert cpu[name]["n"] == 12 and cpu[name]["min"] >= 0, name
    assert cpu["to_first_true"]["n"] == 12 and report["cpu_per_child_conditions"]["children"] == 12
    assert cpu["qemu_start"]["min"] > 0 and cpu["first_reply"]["min"] > 0
    assert cpu["qemu_start"]["mean"] + cpu["first_reply"]["mean"] < cpu["to_first_true"]["mean"]
    parts = sum(cpu[name]["mean"] for name in ("qemu_start", "memory", "device_state", "first_reply", "forwards"))
    assert cpu["to_first_true"]["mean"] == pytest.approx(parts + cpu["first_command"]["mean"], rel=0.01)
    assert set(report["restore_phases_ms"]["cpu_ms"]) >= {"qemu_start_ms", "device_state_ms", "first_reply_ms"}
    if conditions["accel"] == "tcg":  # every child translates the guest code it runs
        assert report["tcg_translation"]["tb_count"]["min"] > 1000
    else:
        assert "tcg_translation" not in report
    tax = report["first_command_tax"]
    assert tax["first_ms"]["n"] == 2 and tax["warm_ms"]["n"] == 2
    assert tax["command"] == "python3 -c 'import json, subprocess'"
    # Successive diff branches (the diff part's measurement), each figure self-consistent.
    assert_figure(report["diff_pause_ms"], 10)
    assert report["diff_pause_p50_ms"] == report["diff_pause_ms"]["p50"]
    series = report["diff_pause_series_ms"]
    assert len(series) == 10 and report["diff_pause_10th_over_2nd"] == pytest.approx(series[9] / series[1], rel=0.01)
    assert report["diff_pause_10th_over_2nd_runs"] == [report["diff_pause_10th_over_2nd"]]  # one run of ten
    assert report["diff_pause_max_over_p50"] >= 1 and report["diff_pause_outliers"] >= 0
    # PSS of idle children and a parent (the memory part's).
    assert report["child_pss_mib"] > 0 and report["parent_pss_mib"] > 0
    assert {"guest_ram", "tcg_code", "qemu_heap", "binaries"} <= set(report["child_pss_parts_mib"])
    assert report["memory_conditions"]["guest_mib"] == 256
    # Live (uffd) branch pauses against memory size (the uffd part's), or the reason they are missing.
    if unavailable("uffd") is None:
        assert set(report["uffd_pause_figures"]) == {"256", "1024"} and report["uffd_growth_ratio"] > 0
        assert all(report["uffd_pause_figures"][size]["n"] >= 5 for size in ("256", "1024"))
        assert report["uffd_method"] == ("precopy" if memory.pagemap_scan_problem() is None else "live_snapshot")
    else:
        assert "uffd_pause_figures" not in report and "skipping uffd pause" in result.stderr
    for heading in ("## Forks", "## CPU per child", "## Branch pauses", "## Memory"):
        assert heading in markdown
