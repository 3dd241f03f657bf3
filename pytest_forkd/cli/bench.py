"""``forkd bench``: measure boots, forks, execs and branches on this host, in one run.

Absolute times on shared, TCG-emulated machines are noisy; what is meant to
be compared are ratios measured in the same run (fork vs cold boot, full
branch pause vs a plain file copy of the same size on the same filesystem).
Every figure is a summary ``{"n", "min", "p50", "p95", "max"}`` of its samples.
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pytest_forkd.core.factory import VMFactory
from pytest_forkd.core.pool import park_vm, unpark_vm
from pytest_forkd.core.vm import VM
from pytest_forkd.engine import memory
from pytest_forkd.engine.qemu.accel import AccelVerdict
from pytest_forkd.errors import InvalidArgument
from pytest_forkd.image import ensure_image
from pytest_forkd.latency.stats import summarize
from pytest_forkd.storage.backend import registry
from pytest_forkd.storage.store import SnapshotStore
from pytest_forkd.waiting import poll_until

FIGURE_KEYS = ("n", "min", "p50", "p95", "max")
# Size of the large exec whose output throughput is measured.
OUTPUT_MIB = 32


def figure(values: list[float]) -> dict[str, float]:
    """The bench's summary of one list of samples (ms or MiB/s)."""
    summary = summarize(values).to_dict()
    return {key: summary[key] for key in FIGURE_KEYS}


PARTS: tuple[str, ...] = ("core", "uffd", "diff", "memory", "speed")
"""core: boots, forks, execs, changes, branch table; uffd: live pause vs memory; diff: pause over
successive branches; memory: PSS of idle children and a parent; speed: guest Python vs host."""


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


def _ms(since: float) -> float:
    return (time.perf_counter() - since) * 1000


def copy_reference_mib_s(directory: Path, size_mib: int, repeats: int) -> list[float]:
    """Throughput of a plain copy of a ``size_mib`` file on the filesystem of ``directory``."""
    results = []
    scratch = Path(tempfile.mkdtemp(prefix="copyref-", dir=directory))
    try:
        source = scratch / "source"
        chunk = os.urandom(1 << 20)
        with open(source, "wb") as handle:
            for _ in range(size_mib):
                handle.write(chunk)
        for index in range(repeats):
            target = scratch / f"copy{index}"
            started = time.perf_counter()
            shutil.copyfile(source, target)
            results.append(size_mib / (time.perf_counter() - started))
            target.unlink()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return results


def exec_output_mib_s(vm: VM, mib: int, repeats: int) -> list[float]:
    """Throughput of one exec whose command prints ``mib`` MiB, all of it kept and shipped to the host."""
    size = mib << 20
    results = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = vm.exec(["head", "-c", str(size), "/dev/zero"], max_output=size)
        results.append(mib / (time.perf_counter() - started))
        if len(result.stdout_bytes) != size:
            raise RuntimeError(f"exec output bench: got {len(result.stdout_bytes)} of {size} bytes")
    return results


def spawn_first_line_ms(vm: VM, repeats: int) -> list[float]:
    """From ``vm.spawn(["echo", ...])`` until its first stdout line is on the host, then reaped."""
    samples: list[float] = []
    for _ in range(repeats):
        started = time.perf_counter()
        process = vm.spawn(["echo", "ready"])
        line = process.stdout.readline(timeout=60)
        samples.append(_ms(started))
        if line != b"ready\n":
            raise RuntimeError(f"spawn bench: expected b'ready\\n', got {line!r}")
        process.wait(timeout=60)
    return samples


# Size of the tree (64 files) whose copy_in/copy_out throughput is measured; /tmp in the guest has room for it.
COPY_TREE_MIB = 16
_COPY_GUEST_DIR = "/tmp/forkd-bench-copy"


def copy_mib_s(vm: VM, mib: int, repeats: int) -> tuple[list[float], list[float]]:
    """Throughput of VM.copy_in and VM.copy_out of a ``mib`` MiB tree (file data per second), in and out."""
    scratch = Path(tempfile.mkdtemp(prefix="forkd-bench-copy-"))
    ins: list[float] = []
    outs: list[float] = []
    try:
        source = scratch / "tree"
        for index in range(64):
            (source / f"d{index % 8}").mkdir(parents=True, exist_ok=True)
            (source / f"d{index % 8}" / f"f{index}").write_bytes(os.urandom((mib << 20) // 64))
        for index in range(repeats):
            ins.append(vm.copy_in(source, _COPY_GUEST_DIR).mib_per_s)
            outs.append(vm.copy_out(_COPY_GUEST_DIR, scratch / f"out{index}").mib_per_s)
            vm.exec(["rm", "-rf", _COPY_GUEST_DIR], check=True)
            shutil.rmtree(scratch / f"out{index}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return ins, outs


def dirty(vm: VM, mib: int) -> None:
    """Make the guest write ``mib`` MiB of memory (a process fills a buffer, then exits)."""
    if mib:
        vm.exec(["python3", "-c", f"b = bytearray(b'\\x01') * ({mib} << 20)"], check=True)


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
    """The uffd, diff, memory and speed parts: each a few figures with ratios taken in this run."""
    result: dict[str, Any] = {}
    if "uffd" in plan.parts:
        result.update(
            measure_uffd_pause(
                factory, sorted({min(plan.memory_mib), max(plan.memory_mib)}), max(plan.repeats, UFFD_SAMPLES), progress
            )
        )
    if {"diff", "memory", "speed"} & set(plan.parts):
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
        finally:
            SnapshotStore(base.path.parent).remove(base.tag, cascade=True)
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
    parallel = (
        measure_parallel_fork(factory, base, plan.parallel_n, progress, rounds=max(3, plan.repeats))
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


def restore_breakdown(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """Per restore phase (see ``RestorePhases``), the figure of its samples; each phase's share of the p50 total."""
    if not phases:
        return {}
    names = [name for name in phases[0] if all(isinstance(row.get(name), (int, float)) for row in phases)]
    result: dict[str, Any] = {name: figure([float(row[name]) for row in phases]) for name in names}
    timed = [name for name in names if name.endswith("_ms") and name != "qemu_cpu_ms"]
    total = sum(result[name]["p50"] for name in timed) or 1.0
    result["share_of_p50"] = {name: round(result[name]["p50"] / total, 3) for name in timed}
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


#: The generated tree of the manifest and changes() figures: DIRS x DIRS directories of FILES files.
TREE_ROOT = "/tmp/forkd-bench-tree"
TREE_DIRS, TREE_FILES = 20, 50
_TREE_SCRIPT = f"""
import os
for a in range({TREE_DIRS}):
    for b in range({TREE_DIRS}):
        d = "{TREE_ROOT}/d%d/e%d" % (a, b)
        os.makedirs(d)
        for c in range({TREE_FILES}):
            with open("%s/f%d.txt" % (d, c), "w") as f:
                if c % 10 == 0:
                    f.write("file %d %d %d\\n" % (a, b, c))
"""
# What the agent does between checkpoint and changes() in round %(i)d: 100 files added, 100
# modified (half keep their size, so only a content hash tells), 100 deleted, 50 chmod-ed;
# each round in directories of its own, so rounds run one after the other in one VM.
_MUTATE_SCRIPT = """
import os
root, i = "%(root)s", %(i)d
for n in range(100):
    open("%%s/d0/e%%d/new%%d.txt" %% (root, i, n), "w").write("new\\n")
for n in range(100):
    path = "%%s/d%%d/e%%d/f%%d.txt" %% (root, 1 + i, n %% 20, 10 * (n // 20))
    data = open(path).read()
    open(path, "w").write(data.upper() if n %% 2 else data + "more\\n")
for n in range(100):
    os.unlink("%%s/d%%d/e%%d/f%%d.txt" %% (root, 7 + i, n %% 20, n // 20))
for n in range(50):
    os.chmod("%%s/d%%d/e%%d/f%%d.txt" %% (root, 13 + i, n %% 20, n // 20), 0o600)
"""
_CHANGE_ROUNDS = 6


def measure_changes(factory: VMFactory, base: Any, plan: BenchPlan, progress: Callable[[str], None]) -> dict[str, Any]:
    """``manifest_ms`` and ``changes_ms`` on a 20,000-file tree in a running VM; ``manifest_cold_ms`` after a restore.

    Each round records a checkpoint's manifest (what ``vm.checkpoint()`` adds
    to the branch), lets the guest change 350 paths, then calls ``changes()``:
    a second walk, the comparison, and content hashes of the 50 same-size
    modifications in the VM and in a child of the checkpoint.
    """
    from pytest_forkd.core.changes import record_manifest
    from pytest_forkd.core.checkpoint import Checkpoint

    files = TREE_DIRS * TREE_DIRS * TREE_FILES
    rounds = max(1, min(plan.repeats, _CHANGE_ROUNDS))
    progress(f"manifest and changes(): {files} files in {TREE_ROOT}, x {rounds}")
    vm = factory.fork_snapshot(base, 1)[0]
    manifests, changes_ms, cold = [], [], []
    try:
        vm.exec(["python3", "-c", _TREE_SCRIPT], check=True)
        paths = (
            int(
                vm.exec(
                    "find / -path /proc -prune -o -path /sys -prune -o -path /dev -prune -o -path /run "
                    "-prune -o -print | wc -l"
                ).stdout
            )
            - 1
        )
        for index in range(rounds):
            tag = f"bench-changes-{index}"
            started = time.perf_counter()
            record_manifest(vm, tag)  # what vm.checkpoint() does before branching
            manifests.append(_ms(started))
            checkpoint = Checkpoint(vm, vm.branch(tag))
            vm.exec(["python3", "-c", _MUTATE_SCRIPT % {"root": TREE_ROOT, "i": index}], check=True)
            started = time.perf_counter()
            with checkpoint.changes(include=(TREE_ROOT,)) as changes:
                changes_ms.append(_ms(started))
                counts = (len(changes.added), len(changes.modified), len(changes.deleted))
            if counts != (100, 150, 100):
                raise RuntimeError(
                    f"changes() on the bench tree found {counts} (added, modified, deleted), expected (100, 150, 100)"
                )
        vm.restore(checkpoint.snapshot)
        started = time.perf_counter()
        record_manifest(vm, "bench-changes-cold")
        cold.append(_ms(started))
    finally:
        vm.close()
    return {
        "manifest_ms": figure(manifests),
        "changes_ms": figure(changes_ms),
        "manifest_cold_ms": figure(cold),
        "changes_tree": {
            "paths": paths,
            "files": files,
            "added": 100,
            "modified": 150,
            "deleted": 100,
            "host_load_1min": round(os.getloadavg()[0], 2),
        },
    }


def measure_branches(
    factory: VMFactory, plan: BenchPlan, progress: Callable[[str], None], fork_rows: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """One row per (backend, memory, dirty MiB) with pause and total figures.

    Each sample starts from the same state: the VM is restored to its base,
    dirties ``dirty_mib`` MiB, then branches. With ``fork_rows`` the fork
    latency of each memory size is measured too (for the sweep plot).
    """
    rows = []
    available = {b.id: b.unavailable_reason() for b in registry().all()}
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


def _conditions(factory: VMFactory, plan: BenchPlan, verdict: AccelVerdict) -> dict[str, Any]:
    return {
        "host": platform.node(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "qemu": factory.qemu.version,
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


# -- issue figures: live-branch pause vs memory, diff pause over successive branches, PSS, guest speed ----


UFFD_SAMPLES = 15
"""Live branches per memory size at least: a pause of 5-10 ms moves by a few ms with the host's load,
and the growth figure is a ratio of two medians."""


def measure_uffd_pause(
    factory: VMFactory, memory_sizes: list[int], repeats: int, progress: Callable[[str], None]
) -> dict[str, Any]:
    """``uffd_pause_ms`` {memory: p50} of a child that branches live, and the growth between the sizes."""
    if registry().get("uffd").unavailable_reason():
        progress(f"skipping uffd pause: {registry().get('uffd').unavailable_reason()}")
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


def pss_mib(pid: int) -> float:
    """Proportional set size of a process (MiB): its private pages plus its share of shared ones."""
    with open(f"/proc/{pid}/smaps_rollup") as handle:
        for line in handle:
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no Pss line in /proc/{pid}/smaps_rollup")


def pss_parts_mib(pid: int, ram_path: Path) -> dict[str, float]:
    """A QEMU process's PSS by kind of mapping: guest RAM, translated code, QEMU's heap, binaries."""
    parts: dict[str, float] = {}
    kind = "other"
    with open(f"/proc/{pid}/smaps") as handle:
        for line in handle:
            head = line.split(None, 5)
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                name = head[5].strip() if len(head) > 5 else ""
                perms = head[1]
                if name.startswith(str(ram_path)):
                    kind = "guest_ram"
                elif not name:
                    kind = "tcg_code" if "x" in perms else "qemu_heap"
                elif name == "[heap]":
                    kind = "qemu_heap"
                elif name.startswith("["):
                    kind = "other"
                else:
                    kind = "binaries"
            elif line.startswith("Pss:"):
                parts[kind] = parts.get(kind, 0.0) + int(line.split()[1]) / 1024
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmPTE:"):
                parts["page_tables"] = int(line.split()[1]) / 1024
    return {key: round(value, 2) for key, value in sorted(parts.items())}


def measure_memory(factory: VMFactory, base: Any, children: int, progress: Callable[[str], None]) -> dict[str, Any]:
    """``child_pss_mib`` of idle pool-like children of ``base`` and ``parent_pss_mib`` of a working parent.

    The children are restored and have answered one command (as pooled
    children have), then sit idle; shared pages of the snapshot's memory are
    split between the processes mapping them, as the kernel's PSS does. The
    parent is a child of the same snapshot that ran a Python program and took
    a diff and a live (uffd, when available) branch, as a session's parent does.
    """
    progress(f"memory: PSS of {children} idle children and of a working parent ({base.memory_mib} MiB guests)")
    kids = factory.fork_snapshot(base, children)
    parent = factory.fork_snapshot(base, 1)[0]
    taken = []
    try:
        for kid in kids:
            kid.exec(["true"])
        parent.exec(["python3", "-c", "import json, hashlib; print(len(json.dumps(list(range(100000)))))"], check=True)
        backends = ["diff"] + ([] if registry().get("uffd").unavailable_reason() else ["uffd"])
        for backend in backends:
            snapshot = parent.branch(backend=backend)
            taken.append(snapshot.wait_ready(timeout=600) if not snapshot.is_ready else snapshot)
        time.sleep(1.0)  # idle: background copies and translations settle
        per_child = [pss_mib(kid.machine.pid) for kid in kids]
        return {
            "child_pss_mib": round(sum(per_child) / len(per_child), 2),
            "child_pss_parts_mib": pss_parts_mib(kids[0].machine.pid, kids[0].machine.ram_path),
            "parent_pss_mib": round(pss_mib(parent.machine.pid), 2),
            "memory_conditions": {
                "guest_mib": base.memory_mib,
                "idle_children": children,
                "parent_branches": backends,
                "host_load_1min": round(os.getloadavg()[0], 2),
            },
        }
    finally:
        for vm in kids + [parent]:
            vm.close()
        for snapshot in taken:
            SnapshotStore(snapshot.path.parent).remove(snapshot.tag, cascade=True)


#: The CPU-bound loop timed in the guest and on the host (same interpreter version where possible).
SPEED_LOOP = (
    "import time\nstarted = time.perf_counter()\ntotal = 0\nfor i in range(%d):\n    total += i * i\n"
    "print(time.perf_counter() - started)"
)


def measure_guest_speed(
    factory: VMFactory, base: Any, repeats: int, progress: Callable[[str], None], iterations: int = 1_000_000
) -> dict[str, Any]:
    """``guest_python_slowdown``: a CPU-bound Python loop in the guest over the same loop on the host (best of n)."""
    import subprocess
    import sys

    progress(f"guest speed: a {iterations}-iteration Python loop in the guest and on the host, x {repeats}")
    script = SPEED_LOOP % iterations
    vm = factory.fork_snapshot(base, 1)[0]
    try:
        guest = [float(vm.exec(["python3", "-c", script], check=True, timeout=600).stdout) for _ in range(repeats)]
        guest_version = vm.exec(["python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"]).stdout.strip()
    finally:
        vm.close()
    host = [
        float(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout)
        for _ in range(repeats)
    ]
    return {
        "guest_python_s": figure(guest),
        "host_python_s": figure(host),
        "guest_python_slowdown": round(min(guest) / min(host), 2),
        "guest_speed_conditions": {
            "guest_python": guest_version,
            "host_python": "%d.%d" % sys.version_info[:2],
            "iterations": iterations,
            "host_load_1min": round(os.getloadavg()[0], 2),
        },
    }
