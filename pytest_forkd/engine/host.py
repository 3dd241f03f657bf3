"""Facts about the host that the engine needs: the QEMU binary, its version, the TSC.

Kept apart from the command-line builder so ``forkd doctor`` can report each
fact on its own, with the fix when it is missing.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..errors import HostNotReady

QEMU_PACKAGE = "qemu-system-x86"
QEMU_BINARY = "qemu-system-x86_64"


@dataclass(frozen=True)
class Qemu:
    """The QEMU binary every VM of a run uses (parents and children must share it)."""

    binary: str
    version: str


def qemu_binary() -> str:
    """Path of qemu-system-x86_64 (``$FORKD_QEMU`` overrides) or HostNotReady naming the package."""
    explicit = os.environ.get("FORKD_QEMU")
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            raise HostNotReady(
                f"FORKD_QEMU={explicit} is not an executable file; unset it or point it at "
                f"{QEMU_BINARY} (Debian/Ubuntu package {QEMU_PACKAGE})"
            )
        return explicit
    found = shutil.which(QEMU_BINARY)
    if not found:
        raise HostNotReady(
            f"{QEMU_BINARY} not found on PATH; install it with "
            f"`sudo apt-get install {QEMU_PACKAGE}` (Debian/Ubuntu) or set FORKD_QEMU"
        )
    return found


@functools.lru_cache(maxsize=8)
def _version_of(binary: str) -> str:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HostNotReady(f"could not run `{binary} --version`: {exc}; reinstall {QEMU_PACKAGE}") from exc
    match = re.search(r"version (\S+)", out)
    if not match:
        raise HostNotReady(f"`{binary} --version` printed no version ({out.strip()[:200]!r})")
    return match.group(1)


def find_qemu() -> Qemu:
    binary = qemu_binary()
    return Qemu(binary=binary, version=_version_of(binary))


@functools.lru_cache(maxsize=1)
def tsc_khz() -> int:
    """The host TSC frequency in kHz, passed to the guest as ``tsc_early_khz``.

    Without it about 40% of TCG boots hang calibrating against the PIT.
    """
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    match = re.search(r"^cpu MHz\s*:\s*([0-9.]+)", text, re.M)
    if match:
        return int(float(match.group(1)) * 1000)
    return 2_000_000


def kernel_release() -> str:
    return os.uname().release


def userfaultfd_problem() -> str | None:
    """Why userfaultfd cannot be used by this process, or None when it can."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    o_cloexec_nonblock = os.O_CLOEXEC | os.O_NONBLOCK
    fd = libc.syscall(323, o_cloexec_nonblock)  # __NR_userfaultfd on x86_64
    if fd >= 0:
        os.close(fd)
        return None
    err = ctypes.get_errno()
    if err == 1:  # EPERM
        return ("userfaultfd is restricted to privileged users here "
                "(run as root or set sysctl vm.unprivileged_userfaultfd=1)")
    return f"userfaultfd() failed: {os.strerror(err)} (kernel built without CONFIG_USERFAULTFD?)"


def pagemap_scan_problem() -> str | None:
    """Why the PAGEMAP_SCAN ioctl (Linux 6.7+) is unavailable, or None when it works."""
    import ctypes
    import fcntl

    PAGEMAP_SCAN = 0xC0606610
    args = (ctypes.c_uint64 * 12)()
    buf = (ctypes.c_uint64 * 3)()
    page = ctypes.create_string_buffer(4096)
    start = ctypes.addressof(page) & ~4095
    args[0] = ctypes.sizeof(args)
    args[2], args[3] = start, start + 4096
    args[5], args[6] = ctypes.addressof(buf), 1
    args[9] = args[11] = 1 << 3  # PAGE_IS_PRESENT
    try:
        with open("/proc/self/pagemap", "rb") as pagemap:
            fcntl.ioctl(pagemap.fileno(), PAGEMAP_SCAN, args, True)
    except OSError as exc:
        return f"PAGEMAP_SCAN ioctl unavailable ({exc.strerror}); it needs Linux 6.7 or newer"
    return None


def shm_free_bytes(path: str = "/dev/shm") -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def filesystem_type(path: str | os.PathLike[str]) -> str:
    """Type of the filesystem holding ``path`` (``tmpfs``, ``ext4``...), from /proc/self/mounts."""
    target = os.path.realpath(path)
    best, best_type = "", "unknown"
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount_point = fields[1].replace("\\040", " ")
                inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best):
                    best, best_type = mount_point, fields[2]
    except OSError:
        pass
    return best_type
