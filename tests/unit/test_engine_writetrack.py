"""Asynchronous write-tracking from outside a process, against a real helper process (no VM).

The helper maps a tmpfs file copy-on-write, as a forked VM maps its snapshot,
and has written a few pages of it (its own pages). Told to, it writes or reads
one more page. The tracker must list its own pages when it protects them, then
the pages written (or first mapped) since, and never make the helper wait.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from pytest_forkd.engine import memory, remote
from pytest_forkd.engine.memory import PAGE_SIZE
from pytest_forkd.engine.writetrack import WriteTracker, WriteTrackingUnavailable

NOT_HERE = remote.unsupported_reason() or memory.pagemap_scan_problem()
pytestmark = pytest.mark.skipif(NOT_HERE is not None, reason=str(NOT_HERE))

PAGES = 64
OWN = (2, 3, 4)  # pages the helper wrote before the tracking starts
HELPER = r"""
import ctypes, mmap, os, sys
path, pages = sys.argv[1], int(sys.argv[2])
fd = os.open(path, os.O_RDONLY)
buf = mmap.mmap(fd, pages * 4096, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
for page in map(int, sys.argv[3:]):
    buf[page * 4096] = 0xAA
buf[40 * 4096]  # a page of the file it only reads
print(ctypes.addressof(ctypes.c_char.from_buffer(buf)), flush=True)
for line in sys.stdin:
    verb, page = line.split()
    offset = int(page) * 4096
    if verb == "write":
        buf[offset] = (buf[offset] + 1) % 256
    value = buf[offset]
    print(value, flush=True)
"""


class Helper:
    def __init__(self, ram: Path, pages: int = PAGES) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", HELPER, str(ram), str(pages), *map(str, OWN)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        self.address = int(self.process.stdout.readline())

    def ask(self, verb: str, page: int) -> int:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(f"{verb} {page}\n")
        self.process.stdin.flush()
        return int(self.process.stdout.readline())

    def close(self) -> None:
        with self.process:  # reaped, and its pipes closed
            self.process.kill()


def tmpfs_dir() -> str:
    if memory.filesystem_type("/dev/shm") != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    return "/dev/shm"


@pytest.fixture
def helper() -> Iterator[Helper]:
    with tempfile.TemporaryDirectory(prefix="forkd-writetrack-", dir=tmpfs_dir()) as directory:
        ram = Path(directory) / "memory.ram"
        with open(ram, "wb") as handle:
            handle.truncate(PAGES * PAGE_SIZE)  # all holes, like the zero pages of a snapshot
        process = Helper(ram)
        try:
            yield process
        finally:
            process.close()


def pages_of(ranges: list[tuple[int, int]]) -> set[int]:
    return {page for offset, size in ranges for page in range(offset // PAGE_SIZE, (offset + size) // PAGE_SIZE)}


def test_protect_lists_the_pages_the_process_owns_and_then_what_it_writes(helper: Helper) -> None:
    with WriteTracker(helper.process.pid, helper.address, PAGES * PAGE_SIZE) as tracker:
        assert pages_of(tracker.protect()) == set(OWN)
        assert tracker.written() == []

        assert helper.ask("write", 10) == 1  # a hole: a new page of its own
        assert helper.ask("write", 3) == 0xAB  # one of its pages
        assert helper.ask("read", 40) == 0  # a mapped page it only reads stays protected
        assert pages_of(tracker.written()) == {3, 10}

        assert helper.ask("read", 20) == 0  # a page mapped for the first time counts, to be safe
        assert pages_of(tracker.written()) == {3, 10, 20}
        assert pages_of(memory.private_pages(helper.process.pid, helper.address, PAGES * PAGE_SIZE)) >= {2, 3, 4, 10}


def test_after_close_the_process_writes_freely_and_its_own_pages_are_listed_as_before(helper: Helper) -> None:
    tracker = WriteTracker(helper.process.pid, helper.address, PAGES * PAGE_SIZE)
    tracker.protect()
    tracker.close()
    tracker.close()  # twice is harmless

    assert helper.ask("write", 30) == 1
    # No write-protection marker was left in an empty entry: a scan would report it like a
    # swapped-out anonymous page, and the holes as pages of the process's own.
    owned = pages_of(memory.private_pages(helper.process.pid, helper.address, PAGES * PAGE_SIZE))
    assert owned == {*OWN, 30}


def test_a_range_that_cannot_be_registered_is_refused_and_leaves_the_process_as_it_was(helper: Helper) -> None:
    before = sorted(os.listdir(f"/proc/{helper.process.pid}/fd"))
    with pytest.raises(WriteTrackingUnavailable, match="cannot be registered with a userfaultfd"):
        WriteTracker(helper.process.pid, PAGE_SIZE, PAGES * PAGE_SIZE)  # nothing is mapped that low

    assert sorted(os.listdir(f"/proc/{helper.process.pid}/fd")) == before  # its userfaultfd was closed there
    assert helper.ask("write", 5) == 1
