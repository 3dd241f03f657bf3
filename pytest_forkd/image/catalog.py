"""Built images on disk and the names that point at them.

Layout under :func:`paths.images_dir`::

    <key>/vmlinuz  initrd.cpio  vmlinuz.stub  initrd.stub  manifest.json

``vmlinuz`` is the kernel QEMU boots: the uncompressed ELF kernel when it has
a PVH entry point (see kernel.py), else the package's bzImage; the stub is
always the head of the bzImage. ``bzImage`` (the package's compressed kernel)
sits next to a PVH ``vmlinuz``: QEMU releases whose PVH boot hangs that kernel
boot it instead (engine/qemu.py, :func:`boot_kernel`).
    names/<name>          a one-line file holding the key the name points to

An image directory is named by its content key and never changes once
published, so a name is just a pointer that a rebuild moves atomically; two
names built from the same recipe share one directory.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from .. import paths, private
from ..errors import ImageError, UnknownImage

KERNEL_FILE = "vmlinuz"
INITRD_FILE = "initrd.cpio"
STUB_KERNEL_FILE = "vmlinuz.stub"
BZIMAGE_FILE = "bzImage"
STUB_INITRD_FILE = "initrd.stub"
MANIFEST_FILE = "manifest.json"
NAMES_DIR = "names"


@dataclass(frozen=True)
class Image:
    """A built guest image: what the engine boots, and the fingerprint snapshots are checked against."""

    name: str
    key: str
    path: Path
    kernel: Path
    initrd: Path
    stub_kernel: Path
    stub_initrd: Path
    kernel_args: tuple[str, ...]
    env: Mapping[str, str] = field(hash=False)
    fingerprint: str
    bzimage: Path | None = None
    """The compressed kernel when ``kernel`` is its PVH (uncompressed) form, else None."""
    disk: Path | None = None
    """A container image's root filesystem: a read-only disk the engine attaches (None: the initramfs is all)."""
    digest: str | None = None
    """A container image's manifest digest (``sha256:...``), which snapshots of it record; None otherwise."""

    @property
    def manifest(self) -> dict[str, Any]:
        """Everything recorded at build time: recipe, package versions, sizes, build time."""
        return read_manifest(self.path)


def image_at(name: str, directory: Path) -> Image:
    """The image published in ``directory``, under the name it was looked up by."""
    manifest = read_manifest(directory)
    return Image(
        name=name,
        key=manifest["key"],
        path=directory,
        kernel=directory / KERNEL_FILE,
        initrd=directory / INITRD_FILE,
        stub_kernel=directory / STUB_KERNEL_FILE,
        stub_initrd=directory / STUB_INITRD_FILE,
        kernel_args=tuple(manifest["kernel_args"]),
        env=MappingProxyType(dict(manifest["env"])),
        fingerprint=manifest["key"],
        bzimage=directory / BZIMAGE_FILE if (directory / BZIMAGE_FILE).is_file() else None,
        disk=Path(manifest["container"]["disk"]) if manifest.get("container") else None,
        digest=manifest["container"]["digest"] if manifest.get("container") else None,
    )


def read_manifest(directory: Path) -> dict[str, Any]:
    try:
        manifest: dict[str, Any] = json.loads((directory / MANIFEST_FILE).read_text())
        return manifest
    except (OSError, ValueError) as exc:
        raise ImageError(
            f"image directory {directory} has no readable {MANIFEST_FILE} ({exc}); "
            f"remove the directory and rebuild with `forkd image build --force`"
        ) from None


def image_directory(key: str) -> Path:
    return paths.images_dir() / key


def is_published(key: str) -> bool:
    return (image_directory(key) / MANIFEST_FILE).is_file()


def _name_file(name: str) -> Path:
    return paths.images_dir() / NAMES_DIR / paths.validate_tag(name, "image name")


def point_name(name: str, key: str) -> None:
    """Make ``name`` refer to the image ``key``, atomically (readers see the old or the new key)."""
    target = _name_file(name)
    private.make_dir(target.parent)
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{name}-")  # created 0600, stays so
    with os.fdopen(handle, "w") as stream:
        stream.write(key + "\n")
    os.replace(temporary, target)


def key_of(name: str) -> str | None:
    """The key ``name`` points to, or None when no image has that name."""
    try:
        return _name_file(name).read_text().strip() or None
    except FileNotFoundError:
        return None


def image_names() -> list[str]:
    directory = paths.images_dir() / NAMES_DIR
    if not directory.is_dir():
        return []
    return sorted(entry.name for entry in directory.iterdir() if not entry.name.startswith("."))


def load_image(name: str = "default") -> Image:
    """The image built under ``name``; UnknownImage says how to build it."""
    key = key_of(name)
    if key is None or not is_published(key):
        built = ", ".join(image_names()) or "none yet"
        raise UnknownImage(
            f"no image named {name!r}; build it with `forkd image build --name {name} [--recipe FILE]`; "
            f"built images: {built}"
        )
    return image_at(name, image_directory(key))


def list_images() -> list[Image]:
    """Every named image whose directory exists, sorted by name."""
    images = []
    for name in image_names():
        key = key_of(name)
        if key is not None and is_published(key):
            images.append(image_at(name, image_directory(key)))
    return images


def unused_image_directories(keep: set[str]) -> list[Path]:
    """Published image directories that no name points to and whose key is not in ``keep``.

    Every change to a recipe or to the agent builds a new image (~90 MB); the
    old ones stay until pruned. ``keep`` holds the keys snapshots still use.
    """
    root = paths.images_dir()
    if not root.is_dir():
        return []
    named = {key_of(name) for name in image_names()}
    return sorted(
        entry
        for entry in root.iterdir()
        if entry.is_dir()
        and entry.name != NAMES_DIR
        and not entry.name.startswith(".")
        and entry.name not in named
        and entry.name not in keep
        and (entry / MANIFEST_FILE).is_file()
    )
