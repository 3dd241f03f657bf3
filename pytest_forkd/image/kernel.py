"""The guest kernel and the few modules the guest needs, taken from a Debian kernel package.

Debian's cloud kernel builds virtio as modules, and on QEMU's microvm the
agent's virtio-serial port only appears once virtio_ring, virtio,
virtio_mmio and virtio_console are loaded (DESIGN.md section 3); a VM
started with a network also needs virtio_net (with failover and
net_failover, which it depends on). Only those modules go into the
initramfs: the whole module tree would multiply its size
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
import hashlib
import json
import lzma
import re
import shutil
import struct
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import zstdio
from ..errors import ImageError, ImageToolMissing
from .deb import data_tar

GUEST_MODULES = ("virtio_ring", "virtio", "virtio_mmio", "virtio_console")
#: Taken when the kernel has them: the network card of VMs started with a network (virtio_net needs the others).
NETWORK_MODULES = ("failover", "net_failover", "virtio_net")
#: Taken when the kernel has them: the read-only disk and overlay of a container image's root,
#: loaded by /init only when the VM boots an image (the kernel command line says ``forkd.image``).
IMAGE_MODULES = ("virtio_blk", "overlay")
# Debian 12 ships modules under lib/modules as .ko; Debian 13 (merged /usr)
# under usr/lib/modules as .ko.xz; other kernels use .ko.zst or .ko.gz.
MODULE_PATH = re.compile(
    r"^(usr/)?lib/modules/(?P<release>[^/]+)/kernel/.+/(?P<module>[^/]+?)\.ko(?P<compression>\.xz|\.zst|\.gz)?$"
)
BUILTIN_LIST = re.compile(r"^(usr/)?lib/modules/(?P<release>[^/]+)/modules\.builtin$")


@dataclass(frozen=True)
class KernelParts:
    """What the image takes from the kernel package."""

    release: str
    vmlinuz: Path  # the package's compressed bzImage
    boot_image: Path  # what QEMU boots: the uncompressed PVH kernel when there is one, else vmlinuz
    modules: tuple[Path, ...]  # plain .ko files in load order
    builtin: tuple[str, ...] = ()  # wanted modules the kernel has built in: nothing to load


def module_name(text: str) -> str:
    """The kernel's name for a module: ``virtio-mmio`` and ``virtio_mmio`` are one module."""
    return text.replace("-", "_")


def builtin_modules(listing: str) -> set[str]:
    """Module names in a ``modules.builtin`` file (one ``kernel/drivers/.../name.ko`` per line)."""
    names = set()
    for line in listing.splitlines():
        line = line.strip()
        if line.endswith(".ko"):
            names.add(module_name(line.rsplit("/", 1)[-1][: -len(".ko")]))
    return names


def decompress_module(data: bytes, compression: str, where: str) -> bytes:
    """A plain ELF module from a ``.ko``, ``.ko.xz``, ``.ko.gz`` or ``.ko.zst`` file's content."""
    if compression == ".xz":
        return lzma.decompress(data)
    if compression == ".gz":
        return gzip.decompress(data)
    if compression == ".zst":
        return zstd_decompress(data, where)
    return data


def zstd_decompress(data: bytes, where: str) -> bytes:
    """Undo zstd with forkd's one zstd (:mod:`pytest_forkd.zstdio`: the ``zstd`` tool, else the module)."""
    return zstdio.decompress(data, where, error=ImageError, missing=ImageToolMissing)


def extract_kernel(
    deb: Path, destination: Path, wanted: tuple[str, ...] = GUEST_MODULES, optional: tuple[str, ...] = ()
) -> KernelParts:
    """Write boot/vmlinuz-* and the ``wanted`` modules (decompressed) under ``destination``.

    A wanted module that the kernel has built in (listed in modules.builtin)
    counts as present and is not loaded. ``optional`` modules are taken when
    the package has them (and what they depend on), and left out otherwise.
    """
    destination.mkdir(parents=True, exist_ok=True)
    vmlinuz: Path | None = None
    release = ""
    modules: dict[str, Path] = {}
    builtin: set[str] = set()
    with data_tar(deb) as archive:
        for member in archive:
            name = member.name.removeprefix("./")
            if not member.isfile():
                continue
            if name.startswith("boot/vmlinuz-"):
                vmlinuz = destination / "vmlinuz"
                release = name[len("boot/vmlinuz-") :]
                _write_member(archive, member, vmlinuz)
                continue
            if BUILTIN_LIST.match(name):
                source = archive.extractfile(member)
                assert source is not None
                builtin |= builtin_modules(source.read().decode(errors="replace"))
                continue
            match = MODULE_PATH.match(name)
            module = module_name(match["module"]) if match else ""
            if match and (module in wanted or module in optional) and module not in modules:
                target = destination / f"{module}.ko"
                source = archive.extractfile(member)
                assert source is not None
                target.write_bytes(decompress_module(source.read(), match["compression"] or "", name))
                modules[module] = target
    if vmlinuz is None:
        raise ImageError(
            f"{deb.name} contains no boot/vmlinuz-*; the recipe's kernel must be a Debian "
            "linux-image package (for example linux-image-cloud-amd64)"
        )
    present_builtin = tuple(module for module in wanted if module in builtin and module not in modules)
    missing = [module for module in wanted if module not in modules and module not in builtin]
    if missing:
        raise ImageError(
            f"{deb.name} has no module(s) {', '.join(missing)} (neither under lib/modules/{release}/kernel "
            "nor built in); the guest needs them to reach its agent port. Use a kernel package that builds "
            "virtio as modules or in (Debian's linux-image-cloud-amd64 does)"
        )
    _drop_incomplete(modules, builtin, optional)
    return KernelParts(
        release=release,
        vmlinuz=vmlinuz,
        boot_image=pvh_kernel(vmlinuz, destination / "vmlinux") or vmlinuz,
        modules=load_order(modules, builtin),
        builtin=present_builtin,
    )


def _drop_incomplete(modules: dict[str, Path], builtin: set[str], optional: tuple[str, ...]) -> None:
    """Leave out optional modules whose dependencies the package lacks (insmod would refuse them)."""
    dropped = True
    while dropped:
        dropped = False
        for name in [name for name in modules if name in optional]:
            if any(dep not in modules and dep not in builtin for dep in module_dependencies(modules[name])):
                del modules[name]
                dropped = True


def module_dependencies(module: Path) -> list[str]:
    """The ``depends=`` entry of a module's .modinfo section (module names, '-' as '_')."""
    data = module.read_bytes()
    marker = data.find(b"\0depends=")
    if marker < 0:
        return []
    end = data.index(b"\0", marker + 1)
    listed = data[marker + len(b"\0depends=") : end].decode()
    return [name.replace("-", "_") for name in listed.split(",") if name]


def load_order(modules: dict[str, Path], builtin: set[str] | frozenset[str] = frozenset()) -> tuple[Path, ...]:
    """Order modules so each comes after the modules it depends on (insmod does not resolve them).

    Dependencies the kernel has built in need no loading.
    """
    ordered: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in ordered:
            return
        if name in visiting:
            raise ImageError(f"kernel modules depend on each other in a cycle through {name}")
        visiting.add(name)
        for dependency in module_dependencies(modules[name]):
            if dependency in builtin:
                continue
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
        chunk = payload[position + 4 : position + 4 + length]
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
    zstdio.MAGIC: lambda stream, size: zstd_decompress(stream, "the kernel"),
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
    payload = vmlinuz[start : start + payload_length]
    if payload_length < 4 or len(payload) != payload_length:
        return None
    (size,) = struct.unpack_from("<I", payload, payload_length - 4)
    for magic, decompress in DECOMPRESSORS.items():
        if payload.startswith(magic):
            stream = payload if magic == GZIP_MAGIC else payload[:-4]
            try:
                kernel = decompress(stream, size)
            except (OSError, ValueError, EOFError, struct.error, lzma.LZMAError, ImageError):
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
            name = elf[position + 12 : position + 12 + name_size]
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


# -- reusing an extracted kernel -------------------------------------------------

KERNEL_CACHE_FORMAT = 1
PARTS_FILE = "parts.json"


def cached_kernel(
    deb: Path,
    cache: Path,
    wanted: tuple[str, ...] = GUEST_MODULES,
    optional: tuple[str, ...] = NETWORK_MODULES + IMAGE_MODULES,
) -> KernelParts:
    """:func:`extract_kernel`, done once per kernel package and kept under ``cache``.

    Reading the kernel out of its package means decompressing all of it
    (a few hundred MB of modules) and then decompressing the kernel itself,
    several seconds that every image built on that kernel would repeat. The
    parts are keyed by the package's sha256 (its cached file name) and
    published by renaming a complete directory; they are only read afterwards.
    """
    identity = json.dumps(
        [
            KERNEL_CACHE_FORMAT,
            deb.stem if len(deb.stem) == 64 else deb.name,
            list(wanted),
            *([list(optional)] if optional else []),
        ]
    )
    directory = cache / hashlib.sha256(identity.encode()).hexdigest()[:24]
    parts = _load_parts(directory)
    if parts is not None:
        return parts
    cache.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=cache, prefix=".extract-"))
    try:
        extracted = extract_kernel(deb, scratch, wanted, optional)
        record = {
            "release": extracted.release,
            "vmlinuz": extracted.vmlinuz.name,
            "boot_image": extracted.boot_image.name,
            "modules": [module.name for module in extracted.modules],
            "builtin": list(extracted.builtin),
        }
        (scratch / PARTS_FILE).write_text(json.dumps(record))
        try:
            scratch.rename(directory)
        except OSError:  # published meanwhile by a concurrent build: use that one
            pass
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    parts = _load_parts(directory)
    if parts is None:
        raise ImageError(f"the kernel extracted from {deb.name} into {directory} is unreadable; delete it and rebuild")
    return parts


def _load_parts(directory: Path) -> KernelParts | None:
    try:
        record = json.loads((directory / PARTS_FILE).read_text())
        parts = KernelParts(
            release=record["release"],
            vmlinuz=directory / record["vmlinuz"],
            boot_image=directory / record["boot_image"],
            modules=tuple(directory / name for name in record["modules"]),
            builtin=tuple(record["builtin"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    files = (parts.vmlinuz, parts.boot_image, *parts.modules)
    return parts if all(path.is_file() for path in files) else None
