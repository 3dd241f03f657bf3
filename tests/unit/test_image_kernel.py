"""Booting the kernel by its PVH entry: unpacking a bzImage and recognising a PVH-capable ELF."""

from __future__ import annotations

import ctypes
import ctypes.util
import gzip
import lzma
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from pytest_forkd.errors import ImageToolMissing
from pytest_forkd.image.kernel import LZ4_LEGACY_MAGIC, decompress_bzimage, has_pvh_entry, pvh_kernel

XEN_NOTE_NAME = b"Xen\0"


def elf_with_notes(*notes: tuple[bytes, int]) -> bytes:
    """A minimal 64-bit little-endian ELF: the header, one PT_NOTE program header and its notes."""
    body = b"".join(
        struct.pack("<III", len(name), 4, note_type) + name.ljust(-(-len(name) // 4) * 4, b"\0") + b"\0" * 4
        for name, note_type in notes
    )
    header = b"\x7fELF\x02\x01\x01".ljust(16, b"\0") + struct.pack(
        "<HHIQQQIHHHHHH", 2, 0x3E, 1, 0x1000000, 64, 0, 0, 64, 56, 1, 0, 0, 0
    )
    program_header = struct.pack("<IIQQQQQQ", 4, 4, 64 + 56, 0, 0, len(body), len(body), 4)
    return header + program_header + body


def bzimage(payload: bytes, setup_sectors: int = 1) -> bytes:
    """A bzImage (boot protocol 2.15) whose protected-mode part starts with ``payload``."""
    setup = bytearray((setup_sectors + 1) * 512)
    setup[0x1F1] = setup_sectors
    setup[0x202:0x206] = b"HdrS"
    struct.pack_into("<H", setup, 0x206, 0x020F)
    struct.pack_into("<II", setup, 0x248, 0, len(payload))
    return bytes(setup) + payload + b"\0" * 512


def with_size(compressed: bytes, kernel: bytes) -> bytes:
    """What the kernel build does after compressing: append the uncompressed size."""
    return compressed + struct.pack("<I", len(kernel))


def lz4_legacy(data: bytes) -> bytes:
    library = ctypes.util.find_library("lz4")
    if library is None:
        pytest.skip("liblz4 is not installed")
    lz4 = ctypes.CDLL(library)
    lz4.LZ4_compressBound.argtypes = (ctypes.c_int,)
    lz4.LZ4_compress_default.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int)
    bound = lz4.LZ4_compressBound(len(data))
    block = ctypes.create_string_buffer(bound)
    length = lz4.LZ4_compress_default(data, block, len(data), bound)
    return LZ4_LEGACY_MAGIC + struct.pack("<I", length) + block.raw[:length]


PVH_KERNEL = elf_with_notes((b"GNU\0", 3), (XEN_NOTE_NAME, 18)) + bytes(range(256)) * 64


@pytest.mark.parametrize(
    "compress",
    [
        pytest.param(lambda kernel: gzip.compress(kernel), id="gzip"),
        pytest.param(lambda kernel: with_size(lzma.compress(kernel, lzma.FORMAT_XZ), kernel), id="xz"),
        pytest.param(lambda kernel: with_size(lz4_legacy(kernel), kernel), id="lz4"),
    ],
)
def test_bzimage_payload_is_decompressed(compress) -> None:
    assert decompress_bzimage(bzimage(compress(PVH_KERNEL))) == PVH_KERNEL


def test_setup_sector_count_locates_the_payload() -> None:
    assert decompress_bzimage(bzimage(gzip.compress(PVH_KERNEL), setup_sectors=7)) == PVH_KERNEL


def test_unknown_compression_or_no_bzimage_gives_none() -> None:
    assert decompress_bzimage(bzimage(with_size(b"(\xb5/\xfd" + b"zstd data", PVH_KERNEL))) is None
    assert decompress_bzimage(PVH_KERNEL) is None
    assert decompress_bzimage(b"") is None


def test_corrupt_or_short_payload_gives_none() -> None:
    broken = bytearray(with_size(lz4_legacy(PVH_KERNEL), PVH_KERNEL))
    broken[12:40] = b"\xff" * 28
    assert decompress_bzimage(bzimage(bytes(broken))) is None
    assert decompress_bzimage(bzimage(gzip.compress(PVH_KERNEL)[:-20])) is None


def test_pvh_entry_is_the_xen_phys32_entry_note() -> None:
    assert has_pvh_entry(PVH_KERNEL)
    assert not has_pvh_entry(elf_with_notes((b"GNU\0", 3), (XEN_NOTE_NAME, 5)))
    assert not has_pvh_entry(elf_with_notes((b"Linux\0", 18)))
    assert not has_pvh_entry(b"\x7fELF\x01\x01" + bytes(64))  # 32-bit
    assert not has_pvh_entry(b"MZ" + bytes(64))
    assert not has_pvh_entry(PVH_KERNEL[:100])  # program headers cut off


def test_pvh_kernel_is_written_only_when_qemu_can_boot_it(tmp_path: Path) -> None:
    vmlinuz = tmp_path / "vmlinuz"
    vmlinuz.write_bytes(bzimage(gzip.compress(PVH_KERNEL)))
    assert pvh_kernel(vmlinuz, tmp_path / "vmlinux") == tmp_path / "vmlinux"
    assert (tmp_path / "vmlinux").read_bytes() == PVH_KERNEL

    no_entry = elf_with_notes((b"GNU\0", 3))
    vmlinuz.write_bytes(bzimage(gzip.compress(no_entry)))
    assert pvh_kernel(vmlinuz, tmp_path / "other") is None
    assert not (tmp_path / "other").exists()


@pytest.mark.skipif(shutil.which("zstd") is None, reason="needs the zstd program to make test data")
def test_zstd_is_undone_by_the_one_zstd_of_forkd(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel and its modules go through pytest_forkd.zstdio: the zstd tool, else the zstandard module."""
    from pytest_forkd import zstdio
    from pytest_forkd.image import kernel

    data = b"a kernel payload " * 4096
    piped = subprocess.run(["sh", "-c", "cat | zstd -q"], input=data, capture_output=True, check=True).stdout
    assert kernel.zstd_decompress(piped, "the kernel") == data  # a frame from a pipe records no size
    assert kernel.decompress_module(piped, ".zst", "virtio.ko.zst") == data
    assert decompress_bzimage(bzimage(with_size(piped, data))) == data
    try:
        import zstandard  # noqa: F401
    except ImportError:
        pass
    else:
        monkeypatch.setenv(zstdio.ENV_IMPLEMENTATION, "module")
        assert kernel.zstd_decompress(piped, "the kernel") == data
        monkeypatch.delenv(zstdio.ENV_IMPLEMENTATION)
    monkeypatch.setattr(zstdio.shutil, "which", lambda name: None)
    monkeypatch.setattr(zstdio, "_zstandard", lambda: None)
    with pytest.raises(ImageToolMissing, match=r"the kernel is zstd-compressed and zstd is not available; install"):
        kernel.zstd_decompress(piped, "the kernel")
    # The kernel itself then boots compressed: no PVH kernel is made of it.
    assert decompress_bzimage(bzimage(with_size(piped, data))) is None
