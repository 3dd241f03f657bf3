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


#: The programs that use podman's shared-memory locks while they run.
PODMAN_PROGRAMS = frozenset({"podman", "buildah", "conmon", "catatonit"})


def podman_locks(shm: Path = Path("/dev/shm")) -> list[Path]:
    """The shared-memory lock files podman makes on its first start: root's, or this user's."""
    return [shm / ("libpod_lock" if os.getuid() == 0 else f"libpod_rootless_lock_{os.getuid()}")]


def podman_running() -> bool:
    """Whether a podman, buildah or their container monitor runs now (any user's: they share no lock, but cheap)."""
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "comm").read_text().strip() in PODMAN_PROGRAMS:
                return True
        except OSError:  # exited meanwhile
            continue
    return False


def remove_podman_locks_made_since(
    before: set[Path], shm: Path = Path("/dev/shm"), running: Callable[[], bool] = podman_running
) -> list[Path]:
    """Remove podman's lock files that the run's builds made (absent at its start), once no podman runs.

    Podman makes them again on its next start, as after a reboot, so the
    machine is left as the run found it.
    """
    made = [lock for lock in podman_locks(shm) if lock.exists() and lock not in before]
    if not made or running():
        return []
    for lock in made:
        lock.unlink(missing_ok=True)
    return made
