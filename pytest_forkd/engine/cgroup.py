"""The memory limit and CPU quota of the cgroup this process runs in: what a container or a CI job really has.

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

A CPU quota (Docker ``--cpus``, a Kubernetes CPU limit) caps the CPU time
per period however many CPUs the process may run on: ``cpu.max`` in v2,
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` in v1. The cores a run counts
on (pool restores, its CPU bound) are then the quota's, not the CPUs'.
"""

from __future__ import annotations

from collections.abc import Iterator
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


def _cgroup_directories(proc: Path, controller: str) -> Iterator[tuple[int, str, Path]]:
    """(version, mount, directory) of this process's cgroup and its ancestors, innermost first.

    cgroup v2: the unified hierarchy's, whatever the controller; v1: those of
    the hierarchy ``controller`` is mounted in.
    """
    try:
        lines = (proc / "self/cgroup").read_text().splitlines()
    except OSError:
        return
    mounts = _mounts(proc)
    for line in lines:
        number, _, rest = line.partition(":")
        controllers, _, relative = rest.partition(":")
        if number == "0" and controllers == "":
            wanted = [(2, mount) for mount, kind, _ in mounts if kind == "cgroup2"]
        elif controller in controllers.split(","):
            wanted = [
                (1, mount) for mount, kind, options in mounts if kind == "cgroup" and controller in options.split(",")
            ]
        else:
            continue
        for version, mount in wanted:
            for directory in _directories(mount, relative):
                yield version, mount, directory


def _limits(proc: Path) -> list[MemoryLimit]:
    found = []
    for version, _, directory in _cgroup_directories(proc, "memory"):
        if version == 2:
            limit = _read_int(directory / "memory.max")
            current, inactive = directory / "memory.current", "inactive_file"
        else:
            limit = _read_int(directory / "memory.limit_in_bytes")
            current, inactive = directory / "memory.usage_in_bytes", "total_inactive_file"
        if limit is not None:
            used = (_read_int(current) or 0) - _stat(directory / "memory.stat", inactive)
            found.append(MemoryLimit(directory, version, limit, max(0, used)))
    return found


def memory_limit(proc: Path = Path("/proc")) -> MemoryLimit | None:
    """The binding memory limit of this process's cgroups (the one with the least room), or None without one."""
    limits = _limits(proc)
    return min(limits, key=lambda limit: limit.free_mib) if limits else None


@dataclass(frozen=True)
class CpuQuota:
    """The tightest CPU quota over this process's cgroup and its ancestors (``cpu.max``, v1 CFS quota)."""

    cgroup: Path
    """The directory of the cgroup whose quota binds."""
    version: int
    cores: float
    """Quota over period: how many cores' worth of CPU time the cgroup may use per period."""
    usage: Path | None
    """The file with that cgroup's CPU usage so far (v2 ``cpu.stat``, v1 ``cpuacct.usage``), if found."""

    def usage_s(self) -> float | None:
        """CPU seconds the cgroup has used so far (None where its usage cannot be read)."""
        if self.usage is None:
            return None
        if self.version == 2:
            micros = _stat(self.usage, "usage_usec")
            return micros / 1e6 if micros else None
        nanos = _read_int(self.usage)
        return None if nanos is None else nanos / 1e9


def _v2_quota(directory: Path) -> float | None:
    try:
        quota, _, period = (directory / "cpu.max").read_text().strip().partition(" ")
        return None if quota == "max" else int(quota) / int(period or "100000")
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _v1_quota(directory: Path) -> float | None:
    quota, period = _read_int(directory / "cpu.cfs_quota_us"), _read_int(directory / "cpu.cfs_period_us")
    if quota is None or quota <= 0 or not period:
        return None  # -1: no quota
    return quota / period


def _v1_usage(directory: Path, mount: str, mounts: list[tuple[str, str, str]]) -> Path | None:
    """``cpuacct.usage`` of the v1 cgroup at ``directory`` (under ``mount``): beside it, or under cpuacct's mount."""
    beside = directory / "cpuacct.usage"
    if beside.exists():
        return beside
    relative = directory.relative_to(mount)
    for other, kind, options in mounts:
        if kind == "cgroup" and "cpuacct" in options.split(","):
            candidate = Path(other) / relative / "cpuacct.usage"
            if candidate.exists():
                return candidate
    return None


def _quotas(proc: Path) -> list[CpuQuota]:
    found = []
    mounts = _mounts(proc)
    for version, mount, directory in _cgroup_directories(proc, "cpu"):
        if version == 2:
            cores = _v2_quota(directory)
            usage: Path | None = directory / "cpu.stat"
        else:
            cores = _v1_quota(directory)
            usage = _v1_usage(directory, mount, mounts) if cores is not None else None
        if cores is not None:
            found.append(CpuQuota(directory, version, cores, usage))
    return found


def cpu_quota(proc: Path = Path("/proc")) -> CpuQuota | None:
    """The binding CPU quota of this process's cgroups (the one with the fewest cores), or None without one."""
    quotas = _quotas(proc)
    return min(quotas, key=lambda quota: quota.cores) if quotas else None
