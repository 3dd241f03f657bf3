"""Throughput of what tests do in a guest: large exec output, spawned processes, copies in and out."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from pytest_forkd.core.vm import VM

from .common import _ms

# Size of the large exec whose output throughput is measured.
OUTPUT_MIB = 32


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
