"""Probes shared by the test suites: is a VM (or any process) gone, who still uses a path, which agent answers.

Also the real user cache that inner pytest runs reuse; the helpers live here rather than in a
conftest, whose module name pytest gives to whichever conftest it imported last.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tenacity

from pytest_forkd import paths, processes
from pytest_forkd.errors import WaitTimeout
from pytest_forkd.guest.client import AgentTimeout
from pytest_forkd.waiting import poll_until

if TYPE_CHECKING:
    from pytest_forkd.core.vm import VM

#: The real user cache, read before pytester points HOME at a temporary directory: the inner
#: runs reuse the default guest image and the accelerator verdict instead of rebuilding them.
USER_CACHE = paths.cache_dir()


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


def wait_for_agent(
    vm: VM, accept: Callable[[dict[str, Any]], bool], what: str, *, timeout: float = 90, interval: float = 0.1
) -> dict[str, Any]:
    """The first ping reply of ``vm``'s guest agent that ``accept`` takes.

    Pings with the client's own short timeout, which does not close the VM: a
    ping lost while one agent leaves the port and the next opens it is an
    AgentTimeout, and is retried.
    """

    def accepted_reply() -> dict[str, Any] | None:
        reply = vm.agent.ping(timeout=3)
        return reply if accept(reply) else None

    reply: dict[str, Any] = poll_until(
        accepted_reply, timeout=timeout, interval=interval, retry_on=(AgentTimeout,), what=what
    )
    return reply


def assert_nothing_left(shm_dir: Path) -> None:
    """No QEMU (or anything else) still uses the run's shm directory, and no run directory is left in it."""
    for attempt in tenacity.Retrying(stop=tenacity.stop_after_delay(10), wait=tenacity.wait_fixed(0.2), reraise=True):
        with attempt:
            assert processes_mentioning(str(shm_dir)) == []
    left = sorted(str(path.relative_to(shm_dir)) for path in shm_dir.rglob("*"))
    assert left == [], f"left in {shm_dir}: {left[:20]}"
