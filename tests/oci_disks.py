"""Image disks for the tests: pulled images made from layers written in the test, and a reader of their ext4.

- :func:`layer_blob` / :func:`pulled_image` turn :class:`oci_images.LayerTar`
  layers into the ``Layer`` and ``PulledImage`` records a pull gives, the
  blobs written as a pull would store them.
- :class:`DiskReader` reads a built disk with ``debugfs`` (``stat``, ``ls``,
  ``ea_list``, ``cat``), which needs no root and no mount.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from oci_images import LAYER_MEDIA_TYPES, Compression, LayerTar, WrittenImage, compress

from pytest_forkd.image.oci.store import ImageConfig, Layer, PulledImage


def debugfs_path() -> str | None:
    return shutil.which("debugfs") or shutil.which("debugfs", path="/usr/sbin:/sbin")


def layer_blob(folder: Path, layer: LayerTar | bytes, compression: Compression = "gzip") -> Layer:
    """The layer's tar, compressed, stored as ``folder/<hex>`` under its digest."""
    data = compress(layer if isinstance(layer, bytes) else layer.tar(), compression)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / digest.split(":")[1]
    path.write_bytes(data)
    return Layer(digest=digest, media_type=LAYER_MEDIA_TYPES[compression], size=len(data), path=path)


def pulled_image(
    folder: Path,
    layers: Sequence[tuple[LayerTar | bytes, Compression]],
    *,
    config: ImageConfig | None = None,
    reference: str = "docker://127.0.0.1:5000/tests/disk:latest",
) -> PulledImage:
    """A ``PulledImage`` of ``layers`` (lowest first); its digest derives from the layers, as a manifest's would."""
    blobs = tuple(layer_blob(folder, layer, compression) for layer, compression in layers)
    digest = "sha256:" + hashlib.sha256("".join(blob.digest for blob in blobs).encode()).hexdigest()
    return PulledImage(
        reference=reference,
        digest=digest,
        config=config or ImageConfig(),
        layers=blobs,
        size=sum(blob.size for blob in blobs),
    )


@dataclass(frozen=True)
class Inode:
    """What ``debugfs stat`` says of one inode."""

    number: int
    kind: str  # regular, directory, symlink, character special, block special, FIFO
    mode: int  # permission bits with setuid/setgid/sticky
    uid: int
    gid: int
    links: int
    size: int
    mtime: int
    device: tuple[int, int] | None
    target: str | None  # a symlink's


class DiskReader:
    """Reads an ext4 image file with debugfs, read-only (``-c``: catastrophic mode, no bitmaps needed)."""

    def __init__(self, disk: Path) -> None:
        tool = debugfs_path()
        assert tool, "debugfs (e2fsprogs) is needed to read image disks"
        self.tool = tool
        self.disk = disk

    def run(self, command: str) -> str:
        result = subprocess.run(
            [self.tool, "-R", command, str(self.disk)], capture_output=True, check=False, stdin=subprocess.DEVNULL
        )
        errors = [
            line
            for line in result.stderr.decode(errors="surrogateescape").splitlines()
            if line.strip() and not line.startswith("debugfs ")
        ]
        if errors:
            raise FileNotFoundError(f"debugfs {command!r}: {' '.join(errors)}")
        return result.stdout.decode(errors="surrogateescape")

    @staticmethod
    def quote(path: str) -> str:
        return '"' + path.replace('"', '""') + '"'

    def stat(self, path: str) -> Inode:
        text = self.run(f"stat {self.quote(path)}")
        header = re.search(r"Inode: (\d+)\s+Type: (.+?)\s+Mode:\s+(\d+)", text)
        owner = re.search(r"User:\s+(\d+)\s+Group:\s+(\d+).*?Size: (\d+)", text)
        links = re.search(r"Links: (\d+)", text)
        mtime = re.search(r"mtime: (0x[0-9a-f]+)", text)
        assert header and owner and links and mtime, text
        device = re.search(r"Device major/minor number: ([0-9a-f]+):([0-9a-f]+)", text)
        target = re.search(r'Fast link dest: "(.*)"', text)
        kind = header.group(2)
        if kind == "symlink" and target is None:  # a long target lives in a block
            target_text: str | None = self.run(f"cat {self.quote(path)}")
        else:
            target_text = target.group(1) if target else None
        return Inode(
            number=int(header.group(1)),
            kind=kind,
            mode=int(header.group(3), 8),
            uid=int(owner.group(1)),
            gid=int(owner.group(2)),
            links=int(links.group(1)),
            size=int(owner.group(3)),
            mtime=int(mtime.group(1), 16),
            # "Device major/minor number: 01:03 (hex 01:03)": decimal first
            device=(int(device.group(1)), int(device.group(2))) if device else None,
            target=target_text,
        )

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
        except FileNotFoundError:
            return False
        return True

    def names(self, directory: str) -> set[str]:
        """The names in ``directory`` (``.`` and ``..`` left out); ``ls -p`` prints them /-separated."""
        names = set()
        for line in self.run(f"ls -p {self.quote(directory)}").splitlines():
            fields = line.split("/")
            if len(fields) >= 7 and fields[5] not in (".", ".."):
                names.add(fields[5])
        return names

    def read(self, path: str) -> bytes:
        result = subprocess.run(
            [self.tool, "-R", f"cat {self.quote(path)}", str(self.disk)], capture_output=True, check=True
        )
        return result.stdout

    def xattrs(self, path: str) -> dict[str, bytes]:
        """The extended attributes of ``path``, each value read back through ``ea_get -f`` as bytes."""
        text = self.run(f"ea_list {self.quote(path)}")
        values = {}
        for name in re.findall(r"^\s+(\S+) \(\d+\)", text, re.MULTILINE):
            values[name] = self.xattr(path, name)
        return values

    def xattr(self, path: str, name: str) -> bytes:
        with tempfile.TemporaryDirectory(prefix="forkd-ea-") as folder:
            value = Path(folder) / "value"
            self.run(f"ea_get -f {self.quote(str(value))} {self.quote(path)} {self.quote(name)}")
            return value.read_bytes()


def pulled_from_layout(written: WrittenImage, *, config: ImageConfig | None = None) -> PulledImage:
    """The ``PulledImage`` of an image :func:`oci_images.write_layout` wrote (its linux/amd64 manifest)."""
    digest = written.manifests["linux/amd64"]
    manifest = json.loads(_blob(written.layout, digest).read_bytes())
    layers = tuple(
        Layer(
            digest=entry["digest"],
            media_type=entry["mediaType"],
            size=entry["size"],
            path=_blob(written.layout, entry["digest"]),
        )
        for entry in manifest["layers"]
    )
    return PulledImage(
        reference=written.reference,
        digest=digest,
        config=config or ImageConfig(),
        layers=layers,
        size=sum(layer.size for layer in layers),
    )


def _blob(layout: Path, digest: str) -> Path:
    algorithm, _, value = digest.partition(":")
    return layout / "blobs" / algorithm / value
