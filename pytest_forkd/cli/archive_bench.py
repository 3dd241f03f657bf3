"""``forkd bench --archive``: what moving the default snapshot between hosts costs.

Builds ``base`` (the default image booted and ready, 256 MiB) into a
temporary store, then times ``repeats`` exports and imports into empty
caches, as a CI shard does. Sizes are MiB; times are seconds, since an
export reads and compresses the whole snapshot and its image.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pytest_forkd import zstdio
from pytest_forkd.archives.archive import SUFFIX, export_snapshot, import_archive
from pytest_forkd.cli.bench import figure
from pytest_forkd.core.factory import VMFactory
from pytest_forkd.project.config import EMPTY_PROJECT
from pytest_forkd.project.snapshot_builder import SnapshotBuilder
from pytest_forkd.storage.store import SnapshotStore

_MIB = float(1 << 20)


def run_archive_bench(
    repeats: int = 5, accel: str = "auto", progress: Callable[[str], None] = lambda line: None
) -> dict[str, Any]:
    """Export and import the default ``base`` snapshot ``repeats`` times; figures per step, sizes in MiB."""
    with tempfile.TemporaryDirectory(prefix="forkd-archive-bench-") as scratch:
        root = Path(scratch)
        store = SnapshotStore(root / "store")
        factory = VMFactory(accel=accel, progress=progress)
        try:
            snapshot = SnapshotBuilder(factory, store, EMPTY_PROJECT, progress=progress).get("base")
            verdict = factory.accel_verdict(factory._image_of(snapshot))
        finally:
            factory.close()
        exports, imports = [], []
        info = None
        for index in range(repeats):
            progress(f"export/import {index + 1}/{repeats}")
            target = root / f"base{SUFFIX}"
            target.unlink(missing_ok=True)
            started = time.perf_counter()
            info = export_snapshot(snapshot, target)
            exports.append(time.perf_counter() - started)
            fresh = root / f"cache-{index}"
            previous = os.environ.get("FORKD_CACHE_DIR")
            os.environ["FORKD_CACHE_DIR"] = str(fresh)
            try:
                started = time.perf_counter()
                import_archive(target, store=fresh / "snapshots")
                imports.append(time.perf_counter() - started)
            finally:
                if previous is None:
                    del os.environ["FORKD_CACHE_DIR"]
                else:
                    os.environ["FORKD_CACHE_DIR"] = previous
        assert info is not None
        memory = snapshot.memory_path
        assert memory is not None
        image_bytes = sum(entry["size"] for entry in info.manifest["files"] if entry["path"].startswith("image/"))
        return {
            "export_s": figure(exports),
            "import_s": figure(imports),
            "archive_mib": round(info.archive_bytes / _MIB, 1),
            "memory_mib": round(info.memory_bytes / _MIB, 1),
            "memory_allocated_mib": round(os.stat(memory).st_blocks * 512 / _MIB, 1),
            "memory_non_zero_mib": round(info.stored_memory_bytes / _MIB, 1),
            "image_mib": round(image_bytes / _MIB, 1),
            "conditions": {
                "host": platform.node(),
                "kernel": platform.release(),
                "cpus": os.cpu_count(),
                "qemu": info.manifest["qemu_version"],
                "accel": verdict.accel,
                "zstd": zstdio.implementation(),
                "scratch": scratch,
                "repeats": repeats,
                "load_average": os.getloadavg()[0],
                "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            },
        }
