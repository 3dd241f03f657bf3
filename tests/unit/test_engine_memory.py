"""Guest memory from the VMM side, on this process's own mappings instead of a QEMU's.

A copy-on-write child maps its snapshot's RAM file MAP_PRIVATE; here a test
file mapped the same way plays the guest RAM, so the dirty-page scan and the
/proc/PID/mem copies are checked against pages we wrote ourselves.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path
from typing import Iterator

import pytest

from pytest_forkd.engine import memory
from pytest_forkd.engine.memory import PAGE_SIZE
from pytest_forkd.engine.qemu.host import pagemap_scan_problem

PAGES = 64


@pytest.fixture
def private_mapping(tmp_path: Path) -> Iterator[tuple[mmap.mmap, int]]:
    """A MAP_PRIVATE mapping of a file full of b"F", and its address in this process."""
    ram = tmp_path / "memory.ram"
    ram.write_bytes(b"F" * PAGES * PAGE_SIZE)
    with open(ram, "r+b") as handle:
        mapping = mmap.mmap(
            handle.fileno(), PAGES * PAGE_SIZE, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))  # the temporary export ends here
    try:
        yield mapping, address
    finally:
        mapping.close()


def write_page(mapping: mmap.mmap, page: int, fill: bytes) -> None:
    mapping[page * PAGE_SIZE : (page + 1) * PAGE_SIZE] = fill * PAGE_SIZE


@pytest.mark.skipif(pagemap_scan_problem() is not None, reason=str(pagemap_scan_problem()))
def test_private_pages_are_exactly_the_written_ones(private_mapping: tuple[mmap.mmap, int]) -> None:
    mapping, address = private_mapping
    assert sum(mapping[page * PAGE_SIZE] for page in range(PAGES))  # read every page: present, but file pages
    for page in (2, 5, 6, 63):
        write_page(mapping, page, b"d")

    ranges = memory.private_pages(os.getpid(), address, PAGES * PAGE_SIZE)

    assert ranges == [(2 * PAGE_SIZE, PAGE_SIZE), (5 * PAGE_SIZE, 2 * PAGE_SIZE), (63 * PAGE_SIZE, PAGE_SIZE)]


def test_copy_out_and_in_through_proc_mem(private_mapping: tuple[mmap.mmap, int], tmp_path: Path) -> None:
    mapping, address = private_mapping
    write_page(mapping, 3, b"a")
    write_page(mapping, 4, b"b")
    ranges = [(3 * PAGE_SIZE, 2 * PAGE_SIZE)]
    diff = os.open(tmp_path / "memory.diff", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(diff, PAGES * PAGE_SIZE)
        assert memory.copy_out(os.getpid(), address, ranges, diff) == 2 * PAGE_SIZE
        assert os.pread(diff, 2 * PAGE_SIZE, 3 * PAGE_SIZE) == b"a" * PAGE_SIZE + b"b" * PAGE_SIZE
        assert memory.data_extents(diff) == ranges  # only the copied pages are allocated

        write_page(mapping, 3, b"x")
        write_page(mapping, 4, b"x")
        assert memory.copy_in(os.getpid(), address, diff, ranges) == 2 * PAGE_SIZE
    finally:
        os.close(diff)
    assert mapping[3 * PAGE_SIZE : 5 * PAGE_SIZE] == b"a" * PAGE_SIZE + b"b" * PAGE_SIZE
    assert mapping[2 * PAGE_SIZE : 3 * PAGE_SIZE] == b"F" * PAGE_SIZE


def sparse_file(path: Path, extents: list[tuple[int, bytes]], size: int) -> None:
    with open(path, "wb") as handle:
        handle.truncate(size)
        for offset, data in extents:
            handle.seek(offset)
            handle.write(data)


def test_copy_sparse_keeps_holes_and_data(tmp_path: Path) -> None:
    source, copy = tmp_path / "base.ram", tmp_path / "copy.ram"
    size = 64 * PAGE_SIZE
    sparse_file(source, [(PAGE_SIZE, b"1" * PAGE_SIZE), (40 * PAGE_SIZE, b"2" * 3 * PAGE_SIZE)], size)

    copied = memory.copy_sparse(source, copy)

    assert copy.read_bytes() == source.read_bytes()
    assert copy.stat().st_size == size
    fd = os.open(copy, os.O_RDONLY)
    try:
        assert memory.data_extents(fd) == [(PAGE_SIZE, PAGE_SIZE), (40 * PAGE_SIZE, 3 * PAGE_SIZE)]
    finally:
        os.close(fd)
    assert copied == 4 * PAGE_SIZE
    with pytest.raises(FileExistsError):  # snapshot files are write-once
        memory.copy_sparse(source, copy)


def test_data_extents_of_an_empty_sparse_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.ram"
    sparse_file(path, [], 16 * PAGE_SIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert memory.data_extents(fd) == []
    finally:
        os.close(fd)


@pytest.fixture
def tmpfs_dir() -> Iterator[Path]:
    """A directory on /dev/shm: tmpfs allocates a page on every read fault, which is what punching undoes."""
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="forkd-unit-") as name:
        yield Path(name)


def test_zero_pages_are_punched_and_everything_else_kept(tmpfs_dir: Path) -> None:
    ram = tmpfs_dir / "memory.ram"
    block = 16 * PAGE_SIZE  # 64 KiB: the scan's block
    data = bytearray(8 * block)
    data[PAGE_SIZE + 7] = 1  # one non-zero byte in the first block's second page
    data[2 * block : 3 * block] = b"D" * block  # a whole block of data
    data[5 * block - 1] = 2  # the last byte of the fifth block
    ram.write_bytes(bytes(data))  # every page allocated, zero or not
    assert ram.stat().st_blocks * 512 >= len(data)
    os.utime(ram, ns=(1_000_000_000, 2_000_000_000))  # as recorded when the snapshot was written

    freed = memory.punch_zero_pages(ram)

    assert ram.read_bytes() == bytes(data)
    assert ram.stat().st_mtime_ns == 2_000_000_000, "the unchanged content must keep its recorded time"
    kept_pages = 1 + 16 + 1
    assert freed == len(data) - kept_pages * PAGE_SIZE
    assert ram.stat().st_blocks * 512 == kept_pages * PAGE_SIZE
    with open(ram, "rb") as handle:
        assert memory.data_extents(handle.fileno()) == [
            (PAGE_SIZE, PAGE_SIZE),
            (2 * block, block),
            (5 * block - PAGE_SIZE, PAGE_SIZE),
        ]
    assert memory.punch_zero_pages(ram) == 0  # nothing left to give back


def test_zero_page_runs_skip_holes_and_merge_neighbours(tmpfs_dir: Path) -> None:
    ram = tmpfs_dir / "memory.ram"
    with open(ram, "wb") as handle:
        handle.truncate(64 * PAGE_SIZE)  # one hole
        handle.seek(10 * PAGE_SIZE)
        handle.write(bytes(3 * PAGE_SIZE) + b"x" + bytes(PAGE_SIZE - 1) + bytes(2 * PAGE_SIZE))
    with open(ram, "rb") as handle:
        assert memory.zero_page_runs(handle.fileno()) == [
            (10 * PAGE_SIZE, 3 * PAGE_SIZE),
            (14 * PAGE_SIZE, 2 * PAGE_SIZE),
        ]


def _balloon(sysfs: Path, device: str, features: str) -> None:
    directory = sysfs / "bus/virtio/drivers/virtio_balloon" / device
    directory.mkdir(parents=True)
    (directory / "features").write_text(features + "\n")


def test_free_page_reporting_is_read_from_the_balloon_feature_bits(tmp_path: Path) -> None:
    assert memory.free_page_reporting(tmp_path) is False  # no balloon at all
    _balloon(tmp_path, "virtio0", "0110000000000000")  # stats and deflate-on-oom, no reporting
    assert memory.free_page_reporting(tmp_path) is False
    _balloon(tmp_path, "virtio3", "0110010100000000")  # bit 5: free page reporting
    assert memory.free_page_reporting(tmp_path) is True
