"""The guest kernel and the few modules the guest needs, taken from a Debian kernel package.

Debian's cloud kernel builds virtio as modules, and on QEMU's microvm the
agent's virtio-serial port only appears once virtio_ring, virtio,
virtio_mmio and virtio_console are loaded (DESIGN.md section 3). Only those
modules go into the initramfs: the whole module tree would multiply its size
and every child's memory for nothing. Compressed modules are decompressed
here because busybox insmod loads plain ELF files only.

The kernel is decompressed here too, once, when it supports the PVH entry
point (Xen's PHYS32_ENTRY ELF note, which QEMU's microvm boots directly):
booting the compressed bzImage makes every cold boot run the kernel's own
decompressor and relocator under emulation first, 0.2-0.5 s of a 2-3 s
boot under TCG. A kernel without that entry point, or in a compression this
module cannot undo, is booted as the bzImage it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gzip
import lzma
import re
import struct
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import ImageError
from .debian import data_tar

GUEST_MODULES = ("virtio_ring", "virtio", "virtio_mmio", "virtio_console")
MODULE_PATH = re.compile(
    r"^lib/modules/(?P<release>[^/]+)/kernel/drivers/.+/(?P<module>[^/]+?)(?P<suffix>\.ko(\.xz)?)$"
)


@dataclass(frozen=True)
class KernelParts:
    """What the image takes from the kernel package."""

    release: str
    vmlinuz: Path  # the package's compressed bzImage
    boot_image: Path  # what QEMU boots: the uncompressed PVH kernel when there is one, else vmlinuz
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
    return KernelParts(
        release=release,
        vmlinuz=vmlinuz,
        boot_image=pvh_kernel(vmlinuz, destination / "vmlinux") or vmlinuz,
        modules=load_order(modules),
    )


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


# -- booting without the kernel's decompressor ------------------------------------

LZ4_LEGACY_MAGIC = b"\x02\x21\x4c\x18"
LZ4_LEGACY_BLOCK = 8 << 20  # the uncompressed size of every block but the last
PT_NOTE = 4
XEN_ELFNOTE_PHYS32_ENTRY = 18


def _lz4_legacy(payload: bytes, size: int) -> bytes:
    """Undo ``lz4 -l``, the kernel's LZ4 format, with liblz4 (apt itself depends on it)."""
    library = ctypes.util.find_library("lz4")
    if library is None:
        raise OSError("liblz4 not found")
    decompress = ctypes.CDLL(library).LZ4_decompress_safe
    decompress.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int)
    block = ctypes.create_string_buffer(LZ4_LEGACY_BLOCK)
    output = bytearray()
    position = len(LZ4_LEGACY_MAGIC)
    while len(output) < size:
        (length,) = struct.unpack_from("<I", payload, position)
        chunk = payload[position + 4:position + 4 + length]
        produced = decompress(chunk, block, len(chunk), LZ4_LEGACY_BLOCK)
        if produced <= 0:
            raise ValueError(f"corrupt LZ4 block at offset {position}")
        output += block.raw[:produced]
        position += 4 + length
    return bytes(output)


GZIP_MAGIC = b"\x1f\x8b"
# By the payload's first bytes; each gets the stream and the uncompressed size.
DECOMPRESSORS: dict[bytes, Callable[[bytes, int], bytes]] = {
    LZ4_LEGACY_MAGIC: _lz4_legacy,
    GZIP_MAGIC: lambda stream, size: gzip.decompress(stream),
    b"\xfd7zXZ\x00": lambda stream, size: lzma.decompress(stream, lzma.FORMAT_XZ),
}


def decompress_bzimage(vmlinuz: bytes) -> bytes | None:
    """The ELF kernel inside a bzImage, or None when this is no bzImage or not in a known compression.

    The boot protocol header (version 2.08 and later) locates the payload:
    ``payload_offset`` counts from the end of the real-mode setup sectors.
    The payload ends with the uncompressed size: the kernel build appends it
    to the compressed stream, except to gzip's, whose own trailer ends so.
    """
    if len(vmlinuz) < 0x250 or vmlinuz[0x202:0x206] != b"HdrS" or struct.unpack_from("<H", vmlinuz, 0x206)[0] < 0x208:
        return None
    setup_sectors = vmlinuz[0x1F1] or 4
    payload_offset, payload_length = struct.unpack_from("<II", vmlinuz, 0x248)
    start = (setup_sectors + 1) * 512 + payload_offset
    payload = vmlinuz[start:start + payload_length]
    if payload_length < 4 or len(payload) != payload_length:
        return None
    (size,) = struct.unpack_from("<I", payload, payload_length - 4)
    for magic, decompress in DECOMPRESSORS.items():
        if payload.startswith(magic):
            stream = payload if magic == GZIP_MAGIC else payload[:-4]
            try:
                kernel = decompress(stream, size)
            except (OSError, ValueError, EOFError, struct.error, lzma.LZMAError):
                return None
            return kernel if len(kernel) == size else None
    return None


def has_pvh_entry(elf: bytes) -> bool:
    """Whether a 64-bit ELF kernel has the PVH entry note (Xen's PHYS32_ENTRY) that QEMU boots it by."""
    if not elf.startswith(b"\x7fELF\x02\x01"):
        return False
    try:
        return _has_pvh_note(elf)
    except struct.error:  # headers pointing past the end: not a kernel QEMU could load either
        return False


def _has_pvh_note(elf: bytes) -> bool:
    (program_headers,) = struct.unpack_from("<Q", elf, 0x20)
    entry_size, count = struct.unpack_from("<HH", elf, 0x36)
    for index in range(count):
        header = program_headers + index * entry_size
        (kind,) = struct.unpack_from("<I", elf, header)
        if kind != PT_NOTE:
            continue
        (offset,) = struct.unpack_from("<Q", elf, header + 8)
        (length,) = struct.unpack_from("<Q", elf, header + 32)
        position, end = offset, offset + length
        while position + 12 <= end:
            name_size, description_size, note_type = struct.unpack_from("<III", elf, position)
            name = elf[position + 12:position + 12 + name_size]
            if name == b"Xen\0" and note_type == XEN_ELFNOTE_PHYS32_ENTRY:
                return True
            position += 12 + -(-name_size // 4) * 4 + -(-description_size // 4) * 4
    return False


def pvh_kernel(vmlinuz: Path, destination: Path) -> Path | None:
    """Write the uncompressed kernel to ``destination`` if QEMU can boot it by its PVH entry; else None."""
    kernel = decompress_bzimage(vmlinuz.read_bytes())
    if kernel is None or not has_pvh_entry(kernel):
        return None
    destination.write_bytes(kernel)
    return destination
