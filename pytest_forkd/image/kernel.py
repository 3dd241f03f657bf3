"""The guest kernel and the few modules the guest needs, taken from a Debian kernel package.

Debian's cloud kernel builds virtio as modules, and on QEMU's microvm the
agent's virtio-serial port only appears once virtio_ring, virtio,
virtio_mmio and virtio_console are loaded (DESIGN.md section 3). Only those
modules go into the initramfs: the whole module tree would multiply its size
and every child's memory for nothing. Compressed modules are decompressed
here because busybox insmod loads plain ELF files only.
"""

from __future__ import annotations

import lzma
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import ImageError
from .debian import data_tar

GUEST_MODULES = ("virtio_ring", "virtio", "virtio_mmio", "virtio_console")
MODULE_PATH = re.compile(r"^lib/modules/(?P<release>[^/]+)/kernel/drivers/.+/(?P<module>[^/]+?)(?P<suffix>\.ko(\.xz)?)$")


@dataclass(frozen=True)
class KernelParts:
    """What the image takes from the kernel package."""

    release: str
    vmlinuz: Path
    modules: tuple[Path, ...]  # plain .ko files in load order


def extract_kernel(deb: Path, destination: Path, wanted: tuple[str, ...] = GUEST_MODULES) -> KernelParts:
    """Write boot/vmlinuz-* and the ``wanted`` modules (decompressed) under ``destination``."""
    destination.mkdir(parents=True, exist_ok=True)
    vmlinuz: Path | None = None
    release = ""
    modules: dict[str, Path] = {}
    with data_tar(deb) as archive:
        for member in archive:
            name = member.name.removeprefix("./")
            if not member.isfile():
                continue
            if name.startswith("boot/vmlinuz-"):
                vmlinuz = destination / "vmlinuz"
                release = name[len("boot/vmlinuz-"):]
                _write_member(archive, member, vmlinuz)
                continue
            match = MODULE_PATH.match(name)
            if match and match["module"] in wanted and match["module"] not in modules:
                target = destination / f"{match['module']}.ko"
                _write_member(archive, member, target)
                if match["suffix"].endswith(".xz"):
                    target.write_bytes(lzma.decompress(target.read_bytes()))
                modules[match["module"]] = target
    if vmlinuz is None:
        raise ImageError(
            f"{deb.name} contains no boot/vmlinuz-*; the recipe's kernel must be a Debian "
            "linux-image package (for example linux-image-cloud-amd64)"
        )
    missing = [module for module in wanted if module not in modules]
    if missing:
        raise ImageError(
            f"{deb.name} has no module(s) {', '.join(missing)} under lib/modules/{release}/kernel/drivers; "
            "the guest needs them to reach its agent port. Use a kernel package that builds virtio as "
            "modules or in (Debian's linux-image-cloud-amd64 does)"
        )
    return KernelParts(release=release, vmlinuz=vmlinuz, modules=load_order(modules))


def module_dependencies(module: Path) -> list[str]:
    """The ``depends=`` entry of a module's .modinfo section (module names, '-' as '_')."""
    data = module.read_bytes()
    marker = data.find(b"\0depends=")
    if marker < 0:
        return []
    end = data.index(b"\0", marker + 1)
    listed = data[marker + len(b"\0depends="):end].decode()
    return [name.replace("-", "_") for name in listed.split(",") if name]


def load_order(modules: dict[str, Path]) -> tuple[Path, ...]:
    """Order modules so each comes after the modules it depends on (insmod does not resolve them)."""
    ordered: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in ordered:
            return
        if name in visiting:
            raise ImageError(f"kernel modules depend on each other in a cycle through {name}")
        visiting.add(name)
        for dependency in module_dependencies(modules[name]):
            if dependency not in modules:
                raise ImageError(
                    f"kernel module {name} needs {dependency}, which the image does not include; "
                    "this kernel is built differently from Debian's cloud kernel"
                )
            visit(dependency)
        visiting.discard(name)
        ordered.append(name)

    for name in sorted(modules):
        visit(name)
    return tuple(modules[name] for name in ordered)


def _write_member(archive: tarfile.TarFile, member: tarfile.TarInfo, target: Path) -> None:
    source = archive.extractfile(member)
    assert source is not None  # members passed here are regular files
    with target.open("wb") as handle:
        while chunk := source.read(1 << 20):
            handle.write(chunk)
