"""The memory limit of the cgroup this process runs in: what a container or a CI job really has.

/proc/meminfo describes the host. A process in a memory cgroup (a Docker
``--memory`` limit, a Kubernetes pod, a systemd slice, a CI runner) may use
only its cgroup's limit, and what it puts on tmpfs (guest RAM files) counts
against that limit too, without swap to go to. Past the limit the kernel
first evicts page cache (QEMU's code, snapshot files: the run slows to a
crawl) and then OOM-kills. Pools and parallel forks therefore size
themselves from the smaller of the host's available memory and the room
left in the cgroup (and in every ancestor, whose limits apply as well).

cgroup v2: ``memory.max`` and ``memory.current`` in the unified hierarchy
(``/sys/fs/cgroup``, or wherever cgroup2 is mounted). cgroup v1:
``memory.limit_in_bytes`` and ``memory.usage_in_bytes`` under the memory
controller's mount. Reclaimable page cache (``inactive_file``) is not
counted as used, as the kernel gives it back before it fails an allocation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MIB = 1 << 20
#: v1 writes "no limit" as the largest page-aligned 63-bit number; anything this big is no limit.
UNLIMITED_ABOVE = 1 << 60


@dataclass(frozen=True)
class MemoryLimit:
    """The tightest memory limit over this process's cgroup and its ancestors."""

    cgroup: Path
    """The directory of the cgroup whose limit binds (this process's own, or an ancestor)."""
    version: int
    limit: int
    """Bytes."""
    used: int
    """Bytes in use in that cgroup, less reclaimable page cache."""

    @property
    def free_mib(self) -> int:
        return max(0, self.limit - self.used) // MIB

    def describe(self) -> str:
        return (
            f"cgroup v{self.version} {self.cgroup}: limit {self.limit // MIB} MiB, "
            f"{self.used // MIB} MiB in use, {self.free_mib} MiB free"
        )


def _mounts(proc: Path) -> list[tuple[str, str, str]]:
    try:
        lines = (proc / "self/mounts").read_text().splitlines()
    except OSError:
        return []
    return [(f[1], f[2], f[3]) for f in (line.split() for line in lines) if len(f) >= 4]


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= UNLIMITED_ABOVE else value


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _directories(mount: str, relative: str) -> list[Path]:
    """The cgroup's directory and its ancestors up to the mount, innermost first (those that exist)."""
    path = Path(mount) / relative.lstrip("/")
    chain = []
    while True:
        if path.is_dir():
            chain.append(path)
        if str(path) == mount or path == path.parent:
            break
        path = path.parent
    return chain


def _limits(proc: Path) -> list[MemoryLimit]:
    try:
        lines = (proc / "self/cgroup").read_text().splitlines()
    except OSError:
        return []
    mounts = _mounts(proc)
    found = []
    for line in lines:
        number, _, rest = line.partition(":")
        controllers, _, relative = rest.partition(":")
        if number == "0" and controllers == "":
            for mount, kind, _ in mounts:
                if kind == "cgroup2":
                    for directory in _directories(mount, relative):
                        limit = _read_int(directory / "memory.max")
                        if limit is not None:
                            used = (_read_int(directory / "memory.current") or 0) - _stat(
                                directory / "memory.stat", "inactive_file"
                            )
                            found.append(MemoryLimit(directory, 2, limit, max(0, used)))
        elif "memory" in controllers.split(","):
            for mount, kind, options in mounts:
                if kind == "cgroup" and "memory" in options.split(","):
                    for directory in _directories(mount, relative):
                        limit = _read_int(directory / "memory.limit_in_bytes")
                        if limit is not None:
                            used = (_read_int(directory / "memory.usage_in_bytes") or 0) - _stat(
                                directory / "memory.stat", "total_inactive_file"
                            )
                            found.append(MemoryLimit(directory, 1, limit, max(0, used)))
    return found


def memory_limit(proc: Path = Path("/proc")) -> MemoryLimit | None:
    """The binding memory limit of this process's cgroups (the one with the least room), or None without one."""
    limits = _limits(proc)
    return min(limits, key=lambda limit: limit.free_mib) if limits else None
