"""Pauses that must not grow: a live (uffd) branch against memory size, diff branches over a changing guest."""

from __future__ import annotations

import statistics
from typing import Any, Callable

from pytest_forkd.core.factory import VMFactory
from pytest_forkd.storage.store import SnapshotStore

from .common import figure

UFFD_SAMPLES = 15
"""Live branches per memory size at least: a pause of 5-10 ms moves by a few ms with the host's load,
and the growth figure is a ratio of two medians."""


def measure_uffd_pause(
    factory: VMFactory, memory_sizes: list[int], repeats: int, progress: Callable[[str], None]
) -> dict[str, Any]:
    """``uffd_pause_ms`` {memory: p50} of a child that branches live, and the growth between the sizes."""
    reason = factory.runtime.backends.get("uffd").unavailable_reason()
    if reason:
        progress(f"skipping uffd pause: {reason}")
        return {}
    pauses: dict[int, list[float]] = {}
    methods: set[str] = set()
    for memory_mib in memory_sizes:
        progress(f"uffd pause: {memory_mib} MiB guest, x {repeats}")
        root = factory.boot(memory_mib=memory_mib)
        base = root.freeze(f"bench-uffd-m{memory_mib}")  # root continues as a child of its base
        try:
            for _ in range(repeats):
                snapshot = root.branch(backend="uffd")
                snapshot = snapshot.wait_ready(timeout=600) if not snapshot.is_ready else snapshot
                pauses.setdefault(memory_mib, []).append(snapshot.pause_ms or 0.0)
                methods.add(str(snapshot.extra.get("method", "?")))
                SnapshotStore(snapshot.path.parent).remove(snapshot.tag, cascade=True)
        finally:
            root.close()
            SnapshotStore(base.path.parent).remove(base.tag, cascade=True)
    p50 = {size: figure(values)["p50"] for size, values in pauses.items()}
    result: dict[str, Any] = {
        "uffd_pause_ms": p50,
        "uffd_pause_figures": {s: figure(v) for s, v in pauses.items()},
        "uffd_method": ",".join(sorted(methods)),
    }
    if len(p50) >= 2:
        small, large = min(p50), max(p50)
        result["uffd_growth_ratio"] = round(p50[large] / p50[small], 3)
    return result


#: What the guest does between successive diff branches: 1 MiB written into one of 20 files (the
#: guest's tmpfs root fills up past ~50 MiB of files in a 256 MiB guest).
_STEP_COMMAND = "head -c 1048576 /dev/urandom > /root/step-%d"
_STEP_FILES = 20


def drift_ratios(pauses: list[float], run: int = 10) -> list[float]:
    """10th / 2nd pause of each complete run of ``run`` successive branches in ``pauses``.

    One pair of single pauses moves by half either way on a noisy host; every
    run of ten successive branches is an instance of the drift the figure is
    about, so the series of 50 gives five of them and the bench reports their
    median (and each one).
    """
    return [pauses[start + run - 1] / pauses[start + 1] for start in range(0, len(pauses) - run + 1, run)]


def measure_diff_series(
    factory: VMFactory, base: Any, branches: int, progress: Callable[[str], None]
) -> dict[str, Any]:
    """Pause of ``branches`` successive diff branches of one VM that keeps changing (1 MiB written per step).

    Without re-basing the pause follows everything changed since the base;
    the diff backend re-bases the VM past its threshold, so it stays flat.
    """
    progress(f"diff pause over {branches} successive branches (1 MiB written per step)")
    vm = factory.fork_snapshot(base, 1)[0]
    pauses: list[float] = []
    rebased = 0
    taken: list[Any] = []
    try:
        for index in range(branches):
            vm.exec(_STEP_COMMAND % (index % _STEP_FILES), check=True)
            snapshot = vm.branch(backend="diff")
            pauses.append(snapshot.pause_ms or 0.0)
            rebased += bool(snapshot.extra.get("rebased"))
            keep = vm.memory_base.path if vm.memory_base is not None else None
            for old in taken + [snapshot]:  # keep only the snapshot the VM maps (after a re-base)
                if old.path != keep:
                    SnapshotStore(old.path.parent).remove(old.tag, cascade=True)
            taken = [old for old in taken + [snapshot] if old.path == keep]
    finally:
        vm.close()
    p50 = figure(pauses)["p50"]
    drift = drift_ratios(pauses)
    return {
        "diff_pause_ms": figure(pauses),
        "diff_pause_p50_ms": p50,
        "diff_pause_10th_over_2nd": round(statistics.median(drift), 3) if drift else None,
        "diff_pause_10th_over_2nd_runs": [round(ratio, 3) for ratio in drift],
        "diff_pause_max_over_p50": round(max(pauses) / p50, 3),
        "diff_pause_outliers": len([value for value in pauses if value > 3 * p50]),
        "diff_rebases": rebased,
        "diff_pause_series_ms": [round(value, 2) for value in pauses],
    }
