"""What every measurement shares: the plan, the summary of samples, the run's conditions."""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pytest_forkd.core.factory import VMFactory
from pytest_forkd.engine import memory
from pytest_forkd.engine.host import AccelVerdict
from pytest_forkd.latency.stats import summarize
from pytest_forkd.waiting import poll_until

FIGURE_KEYS = ("n", "min", "p50", "p95", "max")


def figure(values: list[float]) -> dict[str, float]:
    """The bench's summary of one list of samples (ms or MiB/s)."""
    summary = summarize(values).to_dict()
    return {key: summary[key] for key in FIGURE_KEYS}


PARTS: tuple[str, ...] = ("core", "uffd", "diff", "memory", "speed", "cpu", "images", "e2b")
"""core: boots, forks, execs, changes, branch table; uffd: live pause vs memory; diff: pause over
successive branches; memory: PSS of idle children and a parent; speed: guest Python vs host;
cpu: QEMU CPU per child by phase, TCG translation work and the first-command tax; images: children
of a large and a tiny container image, and QEMU CPU of a busybox image's child against the default's;
e2b: E2B's Python SDK through `forkd e2b serve`'s server against forkd's own fork and exec."""


@dataclass
class BenchPlan:
    memory_mib: list[int] = field(default_factory=lambda: [256, 1024])
    backends: list[str] = field(default_factory=lambda: ["full", "diff", "uffd"])
    dirty_mib: list[int] = field(default_factory=lambda: [0, 16, 64])
    repeats: int = 5
    boots: int = 3
    accel: str = "auto"
    network: str = "none"
    """Network of the VMs whose boots, forks and execs are timed (the branch table boots without)."""
    parallel_n: int = 20
    """Children of the serial-versus-parallel fork(n) comparison (0 skips it)."""
    overhead_tests: int = 50
    """Tests per group (0, 10, 100 ms) of the per-test overhead measured through the plugin (0 skips it)."""
    external_suite: Path | None = None
    """A test suite from elsewhere, run through the plugin with a forkd_vm per test."""
    external_command: str = "true"
    """What each test of the external suite runs in its VM."""
    overhead_only: bool = False
    """Only forks, the restore breakdown, fork(n) and the per-test overhead (no boots, execs, branches)."""
    prefill: bool = True
    """Run the overhead suites with ``--forkd-pool-prefill`` (its wait is reported next to the figures)."""
    parts: list[str] = field(default_factory=lambda: list(PARTS))
    """Which parts to run (see PARTS); each adds its own fields to the JSON."""
    diff_branches: int = 50
    """Successive diff branches of one VM for the ``diff_pause_*`` figures."""
    idle_children: int = 4
    """Idle children whose PSS gives ``child_pss_mib``."""
    cpu_children: int = 12
    """Serial ``fork(1)`` children whose QEMU CPU per phase gives ``cpu_per_child_ms``."""
    image_mib: int = 1024
    """Size of the large container image of the ``images`` part."""


def _ms(since: float) -> float:
    return (time.perf_counter() - since) * 1000


def _conditions(factory: VMFactory, plan: BenchPlan, verdict: AccelVerdict) -> dict[str, Any]:
    return {
        "host": platform.node(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "qemu": factory.engine.describe()["version"],
        "accel": verdict.accel,
        "accel_reason": verdict.reason,
        "store": "run directory on " + str(factory.run_dir.path.parent),
        "free_page_reporting": memory.free_page_reporting(),
        "repeats": plan.repeats,
        "network": plan.network,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _wait_for(predicate: Callable[[], bool], timeout: float) -> None:
    poll_until(predicate, timeout=timeout, interval=0.01, what="the child pool to refill")
