"""Remote system calls and remote write-protection, against a real helper process (no VM).

The helper maps an anonymous buffer, fills it with a pattern and prints its
address; when told, it overwrites the buffer. A live copy started before that
must still hold the pattern, and the helper must see its own writes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Iterator

import pytest

from pytest_forkd.engine import remote
from pytest_forkd.engine.memory import PAGE_SIZE
from pytest_forkd.errors import BackendError

pytestmark = pytest.mark.skipif(remote.unsupported_reason() is not None, reason=str(remote.unsupported_reason()))

HELPER = r"""
import ctypes, mmap, sys, threading, time
size = int(sys.argv[1])
buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for page in range(0, size, 4096):
    buf[page:page + 4096] = bytes([page // 4096 % 251]) * 4096
address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()  # a second thread to borrow
print(address, flush=True)
for line in sys.stdin:
    if line.strip() == "overwrite":
        buf[:] = b"\xee" * size
        print("done", flush=True)
    elif line.strip() == "sum":
        print(sum(buf[::4096]), flush=True)
"""
SIZE = 64 * PAGE_SIZE


@pytest.fixture
def helper() -> Iterator[tuple[subprocess.Popen, int]]:
    process = subprocess.Popen(
        [sys.executable, "-c", HELPER, str(SIZE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        address = int(process.stdout.readline())
        yield process, address
    finally:
        with process:  # reaped, and its pipes closed
            process.kill()


def ask(process: subprocess.Popen, line: str) -> str:
    process.stdin.write(line + "\n")
    process.stdin.flush()
    return process.stdout.readline().strip()


def test_remote_syscall_runs_in_the_target_and_leaves_it_working(helper: tuple[subprocess.Popen, int]) -> None:
    process, _ = helper
    assert remote.remote_syscall(process.pid, 39) == process.pid  # getpid, as the target sees it
    assert remote.remote_syscall(process.pid, remote.SYS_CLOSE, 9999) == -9  # -EBADF comes back as is
    expected = sum(page % 251 for page in range(SIZE // PAGE_SIZE))
    assert ask(process, "sum") == str(expected)  # the borrowed thread and the process go on


def test_a_descriptor_of_the_target_is_taken_over(helper: tuple[subprocess.Popen, int], tmp_path) -> None:
    process, _ = helper
    theirs = remote.remote_call_ok(process.pid, 32, 1, what="dup of stdout")  # dup(1)
    ours = remote.take_fd(process.pid, theirs)
    try:
        assert os.readlink(f"/proc/self/fd/{ours}") == os.readlink(f"/proc/{process.pid}/fd/{theirs}")
    finally:
        os.close(ours)
    with pytest.raises(BackendError, match="failed: Bad file descriptor"):
        remote.remote_call_ok(process.pid, remote.SYS_CLOSE, 9999, what="closing nothing")
