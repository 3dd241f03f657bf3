"""``forkd bench``: measure boots, forks, execs and branches on this host, in one run.

Absolute times on shared, TCG-emulated machines are noisy; what is meant to
be compared are ratios measured in the same run (fork vs cold boot, full
branch pause vs a plain file copy of the same size on the same filesystem).
Every figure is a summary ``{"n", "min", "p50", "p95", "max"}`` of its samples.

One module per measurement, each returning the JSON fields it adds:
``run`` (the whole run: the core part, then the parts in :data:`PARTS`),
``guest_io`` (exec output, spawn, copy throughput), ``forks`` (restore
breakdown, serial versus parallel ``fork(n)``, per-test overhead through the
plugin), ``changes`` (manifests and ``changes()``), ``branches`` (the branch
table, the memory sweep and its plot), ``pauses`` (live branch pause against
memory, diff pause over successive branches), ``pss`` (memory of children and
parents, from /proc), ``speed`` (guest Python against the host's);
``common`` holds the plan, :func:`figure` and the run's conditions.
"""

from __future__ import annotations

from .branches import SWEEP_MEMORY, measure_branches, plot_sweep, run_sweep
from .common import FIGURE_KEYS, PARTS, BenchPlan, figure
from .forks import measure_parallel_fork, restore_breakdown
from .pauses import drift_ratios
from .run import run_bench

__all__ = [
    "FIGURE_KEYS",
    "PARTS",
    "SWEEP_MEMORY",
    "BenchPlan",
    "drift_ratios",
    "figure",
    "measure_branches",
    "measure_parallel_fork",
    "plot_sweep",
    "restore_breakdown",
    "run_bench",
    "run_sweep",
]
