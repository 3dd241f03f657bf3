"""Children of container images: a large image against a tiny one, and a busybox image against forkd's own.

Three claims of the container-image design are measured here, in one run,
back to back, so that ratios compare like with like:

- the image's root filesystem is a read-only disk, not guest RAM, so a child
  of a large image (``--image-mib``, 1 GiB by default, in a 256 MiB guest)
  forks and answers its first command about as fast as a child of a tiny
  image, and idles with about the same PSS;
- the agent brings its own runtime, so a child of a busybox-only image costs
  no more QEMU CPU up to its first answered ``true`` than a child of the
  default image;
- a file of the large image reads back in the guest with the host's contents.

The images are made here as OCI image layouts (one uncompressed layer: the
static busybox of the default image, plus incompressible files for the large
one) and go through the same path as any reference: ``oci:DIR:TAG``, pulled
into the image store, a disk built per digest.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from pytest_forkd.core.factory import VMFactory, process_cpu_ms
from pytest_forkd.image import ensure_container_image, load_image
from pytest_forkd.storage.snapshot import Snapshot
from pytest_forkd.storage.store import SnapshotStore

from .common import _ms, figure
from .pss import pss_mib

#: Files the large image's size is made of (incompressible, so no layer compression hides it).
LARGE_FILE_MIB = 64
IMAGE_GUEST_MIB = 256


def busybox_binary() -> bytes:
    """The static busybox the default image carries (its initramfs is a cpio archive)."""
    from pytest_forkd.image.cpio import read_member

    return read_member(load_image("default").initrd, "usr/bin/busybox")


class _RandomFile(io.RawIOBase):
    """``size`` incompressible bytes, read once into a layer while their sha256 is taken."""

    def __init__(self, size: int) -> None:
        self.left = size
        self.sha256 = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        count = min(len(buffer), self.left, 1 << 20)
        chunk = os.urandom(count)
        buffer[:count] = chunk
        self.sha256.update(chunk)
        self.left -= count
        return count


def write_layout(layout: Path, tag: str, files: dict[str, int]) -> tuple[str, dict[str, str]]:
    """An OCI image layout with one uncompressed layer: busybox, a few applet links and random ``files``.

    ``files`` maps a path to a size in bytes; returns the ``oci:`` reference and each file's sha256.
    """
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)

    def put(data: bytes) -> dict[str, Any]:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return {"digest": f"sha256:{digest}", "size": len(data)}

    sums: dict[str, str] = {}
    scratch = blobs / "layer.tmp"
    with tarfile.open(scratch, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for directory in ("bin", "data", "tmp"):
            entry = tarfile.TarInfo(directory)
            entry.type, entry.mode = tarfile.DIRTYPE, 0o1777 if directory == "tmp" else 0o755
            archive.addfile(entry)
        busybox = busybox_binary()
        entry = tarfile.TarInfo("bin/busybox")
        entry.size, entry.mode = len(busybox), 0o755
        archive.addfile(entry, io.BytesIO(busybox))
        for applet in ("sh", "true", "sha256sum", "cat"):
            link = tarfile.TarInfo(f"bin/{applet}")
            link.type, link.linkname = tarfile.SYMTYPE, "busybox"
            archive.addfile(link)
        for name, size in files.items():
            entry = tarfile.TarInfo(name)
            entry.size, entry.mode = size, 0o644
            source = _RandomFile(size)
            archive.addfile(entry, source)
            sums[name] = source.sha256.hexdigest()
    digest = hashlib.sha256()
    with scratch.open("rb") as stream:
        while chunk := stream.read(1 << 20):
            digest.update(chunk)
    layer_blob = {"digest": f"sha256:{digest.hexdigest()}", "size": scratch.stat().st_size}
    scratch.rename(blobs / digest.hexdigest())
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": ["PATH=/bin"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [layer_blob["digest"]]},
    }
    config_blob = put(json.dumps(config).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **config_blob},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", **layer_blob}],
    }
    manifest_blob = put(json.dumps(manifest).encode())
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                **manifest_blob,
                "annotations": {"org.opencontainers.image.ref.name": tag},
            }
        ],
    }
    (layout / "index.json").write_text(json.dumps(index))
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return f"oci:{layout}:{tag}", sums


def _freeze(factory: VMFactory, image: Any, tag: str) -> Snapshot:
    root = factory.boot(image, memory_mib=IMAGE_GUEST_MIB)
    return root.freeze(tag, keep_running=False)


def _child_figures(factory: VMFactory, base: Snapshot, repeats: int) -> dict[str, list[float]]:
    """Per child: fork(1) plus a first ``true`` (wall), QEMU CPU to that answer, idle PSS."""
    rows: dict[str, list[float]] = {"fork_first_true_ms": [], "cpu_to_first_true_ms": [], "idle_pss_mib": []}
    for _ in range(repeats):
        started = time.perf_counter()
        child = factory.fork_snapshot(base, 1)[0]
        try:
            child.agent.exec(["true"])
            rows["fork_first_true_ms"].append(_ms(started))
            spent = process_cpu_ms(child.machine.pid)  # the whole QEMU process: spawn to this answer
            if spent is not None:
                rows["cpu_to_first_true_ms"].append(spent)
            time.sleep(1.0)  # idle: late translations and page faults settle
            rows["idle_pss_mib"].append(pss_mib(child.machine.pid))
        finally:
            child.close()
    return rows


def measure_images(
    factory: VMFactory, repeats: int, progress: Callable[[str], None], *, large_mib: int = 1024
) -> dict[str, Any]:
    """``image_*`` figures: tiny vs large image children, busybox image vs default image CPU, contents check."""
    repeats = max(repeats, 3)
    progress(f"images: a tiny and a {large_mib} MiB container image in {IMAGE_GUEST_MIB} MiB guests")
    with tempfile.TemporaryDirectory(prefix="forkd-bench-images-") as folder:
        tiny_ref, _ = write_layout(Path(folder) / "tiny", "1", {"data/hello": 6})
        count = max(1, large_mib // LARGE_FILE_MIB)
        large_ref, sums = write_layout(
            Path(folder) / "large", "1", {f"data/file{index:03d}": LARGE_FILE_MIB << 20 for index in range(count)}
        )
        checked_name = f"data/file{count // 2:03d}"
        started = time.perf_counter()
        tiny = ensure_container_image(tiny_ref, policy="always", progress=progress)
        large = ensure_container_image(large_ref, policy="always", progress=progress)
        prepare_s = round(time.perf_counter() - started, 1)
    bases: list[Snapshot] = []
    try:
        bases = [
            _freeze(factory, load_image("default"), "bench-image-default"),
            _freeze(factory, tiny, "bench-image-tiny"),
            _freeze(factory, large, "bench-image-large"),
        ]
        default_rows, tiny_rows, large_rows = (_child_figures(factory, base, repeats) for base in bases)
        child = factory.fork_snapshot(bases[2], 1)[0]
        try:
            guest_sum = child.exec(["sha256sum", f"/{checked_name}"], check=True).stdout.split()[0]
        finally:
            child.close()
    finally:
        for base in bases:
            SnapshotStore(base.path.parent).remove(base.tag, cascade=True)

    def p50(rows: dict[str, list[float]], key: str) -> float:
        return figure(rows[key])["p50"]

    return {
        "image_tiny": {key: figure(values) for key, values in tiny_rows.items()},
        "image_large": {key: figure(values) for key, values in large_rows.items()},
        "image_default": {key: figure(values) for key, values in default_rows.items()},
        "image_large_over_tiny_fork_first_true": round(
            p50(large_rows, "fork_first_true_ms") / p50(tiny_rows, "fork_first_true_ms"), 2
        ),
        "image_large_minus_tiny_idle_pss_mib": round(
            p50(large_rows, "idle_pss_mib") - p50(tiny_rows, "idle_pss_mib"), 2
        ),
        "image_busybox_over_default_cpu_to_first_true": round(
            p50(tiny_rows, "cpu_to_first_true_ms") / p50(default_rows, "cpu_to_first_true_ms"), 2
        ),
        "image_large_contents_match": guest_sum == sums[checked_name],
        "image_conditions": {
            "guest_mib": IMAGE_GUEST_MIB,
            "large_image_mib": large_mib,
            "children": repeats,
            "prepare_s": prepare_s,
            "cpu_source": "QEMU process CPU (/proc/PID/task/*/schedstat) from spawn to the first answered `true`",
        },
    }
