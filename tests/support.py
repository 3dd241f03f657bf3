"""Process probes shared by the test suites: is a VM (or any process) gone, who still uses a path."""

from __future__ import annotations

import os
from pathlib import Path

from tenacity import Retrying, retry_if_result, stop_after_delay, wait_fixed


def is_running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def wait_until_dead(pid: int, seconds: float = 5.0) -> bool:
    """Poll until ``pid`` is gone; False if it still runs after ``seconds``."""
    poll = Retrying(stop=stop_after_delay(seconds), wait=wait_fixed(0.02), retry=retry_if_result(bool),
                    retry_error_callback=lambda state: state.outcome.result())
    return not poll(is_running, pid)


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
