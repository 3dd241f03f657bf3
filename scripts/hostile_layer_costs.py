"""What hostile layers cost forkd: time and peak memory until each is refused.

Builds the layers of tests/hostile_layers.py (gzip, level 9) and reads each
in a fresh Python process, as an image's disk build does
(``pytest_forkd.image.oci.layers.flatten``), reporting per layer its size,
the outcome (the error's first words), the seconds until then and the
process's peak RSS (``VmHWM``, the interpreter and forkd's imports
included; not ``ru_maxrss``, which after a fork and exec also counts the
parent's). With ``--exec`` it also runs the whole ``forkd exec --image
oci:LAYOUT:TAG -- true`` on the sparse layer (needs skopeo, e2fsprogs and
the default guest image, which it takes from the user's cache; no VM is
started, the image is refused before) and reports that process's peak RSS.
Prints one JSON object.

    .venv/bin/python scripts/hostile_layer_costs.py [--exec] [--only NAME]

The layers:

- ``sparse-old-240k``: one GNU sparse entry (tar type S) with a
  240,000-block map in its extension blocks;
- ``sparse-pax-1.0-240k``: the same map as a PAX 1.0 sparse entry (map at the
  start of the data);
- ``sparse-pax-0.1``: a PAX 0.1 sparse entry whose map fills most of one
  extended header;
- ``pax-records``: PAX headers of 6-byte records until the image's PAX limit
  (the costliest bytes to parse);
- ``entries-over-limit``: one empty file more than an image may have;
- ``trailing-zeros``: a tar followed by zeros until the metadata limit;
- ``long-name-chain``: 1,000 GNU long-name headers before one entry.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import hostile_layers  # noqa: E402
from oci_images import LayerTar, compress, write_layout  # noqa: E402

from pytest_forkd import paths  # noqa: E402
from pytest_forkd.image.oci import layers  # noqa: E402

MIB = 1 << 20

CHILD = r"""
import json, sys, time
from pathlib import Path
from pytest_forkd.image.oci.layers import flatten
from pytest_forkd.image.oci.store import Layer

path, workdir = Path(sys.argv[1]), Path(sys.argv[2])
layer = Layer("sha256:" + "0" * 64, "application/vnd.oci.image.layer.v1.tar+gzip", path.stat().st_size, path)
started = time.perf_counter()
try:
    flatten([layer], workdir)
    outcome = "accepted"
except Exception as exc:
    outcome = f"{type(exc).__name__}: {exc}"
seconds = time.perf_counter() - started
peak = int(next(line for line in open("/proc/self/status") if line.startswith("VmHWM:")).split()[1]) / 1024
print(json.dumps({"seconds": round(seconds, 2), "peak_rss_mib": round(peak, 1), "outcome": outcome[:300]}))
"""

EXEC_CHILD = r"""
import json, sys, time
from pytest_forkd.cli import main
started = time.perf_counter()
try:
    status = main(["exec", "--image", sys.argv[1], "--", "true"])
except SystemExit as exc:
    status = exc.code
seconds = time.perf_counter() - started
peak = int(next(line for line in open("/proc/self/status") if line.startswith("VmHWM:")).split()[1]) / 1024
print(json.dumps({"status": status, "seconds": round(seconds, 2), "peak_rss_mib": round(peak, 1)}), file=sys.stderr)
"""


def layer_builders() -> dict[str, Callable[[], bytes]]:
    return {
        "sparse-old-240k": lambda: hostile_layers.old_gnu_sparse(240_000),
        "sparse-pax-1.0-240k": lambda: hostile_layers.pax_sparse("1.0", 240_000),
        "sparse-pax-0.1": lambda: hostile_layers.pax_sparse("0.1", 3_000),
        "pax-records": lambda: hostile_layers.huge_pax(layers.MAX_PAX_BYTES + (1 << 20)),
        "entries-over-limit": lambda: hostile_layers.many_entries(layers.MAX_ENTRIES + 1),
        "trailing-zeros": lambda: LayerTar().file("a", "a").tar() + bytes(layers.MAX_METADATA_BYTES + (4 << 20)),
        "long-name-chain": lambda: hostile_layers.chained_long_names(1000),
    }


def measure(name: str, tar: bytes, scratch: Path) -> dict[str, Any]:
    blob = scratch / f"{name}.tar.gz"
    blob.write_bytes(compress(tar, "gzip"))
    workdir = scratch / f"{name}-work"
    workdir.mkdir()
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(blob), str(workdir)], capture_output=True, text=True, cwd=ROOT, timeout=3600
    )
    if child.returncode != 0:
        return {"error": child.stderr.strip()[-500:]}
    result: dict[str, Any] = json.loads(child.stdout.strip().splitlines()[-1])
    return {"layer_mib": round(blob.stat().st_size / MIB, 2), "tar_mib": round(len(tar) / MIB, 1), **result}


def measure_exec(scratch: Path) -> dict[str, Any]:
    layout = scratch / "layout"
    written = write_layout(layout, [(hostile_layers.old_gnu_sparse(240_000), "gzip")], tag="sparse")
    # An image store of its own, and the user's guest images: the default image is booted, not built, here.
    cache = scratch / "cache"
    cache.mkdir()
    for shared in ("images", "debs"):
        if (paths.cache_dir() / shared).is_dir():
            (cache / shared).symlink_to(paths.cache_dir() / shared)
    environment = {**os.environ, "FORKD_CACHE_DIR": str(cache)}
    child = subprocess.run(
        [sys.executable, "-c", EXEC_CHILD, written.reference],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=environment,
        timeout=3600,
    )
    lines = child.stderr.strip().splitlines()
    result: dict[str, Any] = json.loads(lines[-1])
    errors = [line for line in lines[:-1] if "error" in line.lower() or "refused" in line]
    return {**result, "error": errors[-1][:300] if errors else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--exec", action="store_true", help="also measure `forkd exec --image` on the sparse layer")
    parser.add_argument("--only", action="append", help="measure only this layer (repeatable)")
    options = parser.parse_args()
    builders = layer_builders()
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="forkd-hostile-") as folder:
        scratch = Path(folder)
        for name, build in builders.items():
            if options.only and name not in options.only:
                continue
            started = time.perf_counter()
            tar = build()
            built = time.perf_counter() - started
            figures[name] = {**measure(name, tar, scratch), "build_seconds": round(built, 1)}
            del tar
            print(f"{name}: {figures[name]}", file=sys.stderr, flush=True)
        if options.exec:
            figures["forkd exec --image (sparse-old-240k)"] = measure_exec(scratch)
    print(
        json.dumps(
            {
                "layers": figures,
                "conditions": {
                    "python": platform.python_version(),
                    "cpus": os.cpu_count(),
                    "load": os.getloadavg()[0],
                    "date": time.strftime("%Y-%m-%d"),
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
