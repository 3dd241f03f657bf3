"""Process probes shared by the test suites: is a VM (or any process) gone, who still uses a path."""

from __future__ import annotations

import os
from pathlib import Path

from pytest_forkd import processes
from pytest_forkd.errors import WaitTimeout
from pytest_forkd.waiting import poll_until


def is_running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie waiting to be reaped."""
    return processes.is_alive(pid)


def wait_until_dead(pid: int, seconds: float = 5.0) -> bool:
    """Poll until ``pid`` is gone; False if it still runs after ``seconds``."""
    try:
        poll_until(lambda: not is_running(pid), timeout=seconds, interval=0.02, what=f"process {pid} to exit")
    except WaitTimeout:
        return False
    return True


def processes_mentioning(path: Path | str) -> list[str]:
    """Command lines of the processes (other than this one) whose arguments mention ``path``."""
    needle = str(path).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # exited meanwhile
            continue
        if needle in cmdline:
            words = cmdline.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{entry.name}: {words[:300]}")
    return found
