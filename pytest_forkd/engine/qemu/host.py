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

from pytest_forkd.engine.memory import filesystem_type as filesystem_type  # host facts, re-exported
from pytest_forkd.engine.memory import pagemap_scan_problem as pagemap_scan_problem
from pytest_forkd.errors import HostNotReady

QEMU_PACKAGE = "qemu-system-x86"
QEMU_BINARY = "qemu-system-x86_64"
#: Oldest QEMU whose QMP and migration behaviour the engine relies on (Debian 12's).
MIN_QEMU_VERSION = (7, 2)
KVM_DEVICE = "/dev/kvm"
USERFAULTFD_DEVICE = "/dev/userfaultfd"
USERFAULTFD_SYSCTL = "vm.unprivileged_userfaultfd"


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


def _version_of(binary: str) -> str:
    """The version ``binary`` reports, asked once per file: a binary replaced in place is asked again."""
    try:
        status = os.stat(binary)
    except OSError:
        return _asked_version(binary, None)
    return _asked_version(binary, (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns))


@functools.lru_cache(maxsize=8)
def _asked_version(binary: str, identity: tuple[int, int, int, int] | None) -> str:
    """``binary --version``, cached by path and file identity (device, inode, size, modification time)."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HostNotReady(f"could not run `{binary} --version`: {exc}; reinstall {QEMU_PACKAGE}") from exc
    match = re.search(r"version (\S+)", out)
    if not match:
        raise HostNotReady(f"`{binary} --version` printed no version ({out.strip()[:200]!r})")
    return match.group(1)


def version_tuple(version: str) -> tuple[int, ...]:
    """``"8.2.2"`` -> ``(8, 2, 2)``; stops at the first part that is not a number."""
    parts = []
    for part in version.split("."):
        match = re.match(r"\d+", part)
        if not match:
            break
        parts.append(int(match.group()))
    return tuple(parts)


def check_qemu_version(binary: str, version: str) -> None:
    """HostNotReady (one line, with the fix) when ``version`` is older than :data:`MIN_QEMU_VERSION`."""
    if version_tuple(version) < MIN_QEMU_VERSION:
        wanted = ".".join(map(str, MIN_QEMU_VERSION))
        raise HostNotReady(
            f"{binary} is QEMU {version}, older than {wanted}, which pytest-forkd needs; install "
            f"{QEMU_PACKAGE} {wanted} or newer (Debian 12+, Ubuntu 24.04+) or point FORKD_QEMU at one"
        )


#: The QEMU machine type forkd runs.
MACHINE_TYPE = "microvm"


def machine_type_problem(qemu: Qemu) -> str | None:
    """Why ``qemu`` cannot run forkd's machine type (:data:`MACHINE_TYPE`), or None."""
    machines = subprocess.run([qemu.binary, "-M", "help"], capture_output=True, text=True).stdout
    if MACHINE_TYPE not in machines:
        return f"{qemu.binary} {qemu.version} has no {MACHINE_TYPE} machine"
    return None


def find_qemu() -> Qemu:
    """The QEMU to use, checked: present, executable, and at least :data:`MIN_QEMU_VERSION`."""
    binary = qemu_binary()
    version = _version_of(binary)
    check_qemu_version(binary, version)
    return Qemu(binary=binary, version=version)


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


def _user_name() -> str:
    import pwd

    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return f"uid {os.getuid()}"


def _device_owner(path: str) -> str:
    """``crw-rw---- root:kvm`` for a device node, for messages that explain access."""
    import grp
    import pwd
    import stat

    info = os.stat(path)
    try:
        user = pwd.getpwuid(info.st_uid).pw_name
    except KeyError:
        user = str(info.st_uid)
    try:
        group = grp.getgrgid(info.st_gid).gr_name
    except KeyError:
        group = str(info.st_gid)
    return f"{stat.filemode(info.st_mode)} {user}:{group}"


def kvm_access_problem() -> str | None:
    """Why this process cannot open /dev/kvm, with the fix, or None when it can.

    Most distributions give /dev/kvm to group ``kvm`` (mode 0660); a user
    outside it, or a host whose udev rule leaves the node 0600 (GitHub's
    runners before a rule is added), cannot use KVM and runs under TCG.
    """
    import grp

    if not os.path.exists(KVM_DEVICE):
        return f"{KVM_DEVICE} does not exist (no KVM on this host, or the kvm module is not loaded)"
    if os.access(KVM_DEVICE, os.R_OK | os.W_OK):
        return None
    user = _user_name()
    owner = _device_owner(KVM_DEVICE)
    group_id = os.stat(KVM_DEVICE).st_gid
    try:
        group = grp.getgrgid(group_id).gr_name
    except KeyError:
        group = str(group_id)
    if group_id != 0 and (os.stat(KVM_DEVICE).st_mode & 0o060) == 0o060:
        if group_id in os.getgroups():
            return f"{KVM_DEVICE} is {owner} and this process lacks group {group} (log in again after joining it)"
        return (
            f"{KVM_DEVICE} is {owner} and {user} is not in group {group}; "
            f"fix: sudo usermod -aG {group} {user}, then log in again"
        )
    return (
        f"{KVM_DEVICE} is {owner}, not readable and writable by {user}; fix: a udev rule giving it to "
        f'group kvm, e.g. KERNEL=="kvm", GROUP="kvm", MODE="0660" (then add {user} to kvm)'
    )


def _sysctl(name: str) -> str | None:
    try:
        return Path("/proc/sys", *name.split(".")).read_text().strip()
    except OSError:
        return None


def _has_capability(bit: int) -> bool:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> bit & 1)
    except (OSError, ValueError):
        pass
    return False


CAP_SYS_PTRACE = 19


def _userfaultfd_syscall_errno() -> int:
    """0 when userfaultfd(2) with QEMU's flags works in this process, else its errno."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(323, os.O_CLOEXEC | os.O_NONBLOCK)  # __NR_userfaultfd on x86_64, no USER_MODE_ONLY
    if fd >= 0:
        os.close(fd)
        return 0
    return ctypes.get_errno()


_uffd_verdicts: dict[int, str | None] = {}


def userfaultfd_problem() -> str | None:
    """Why userfaultfd cannot be used by QEMU processes this process starts, or None when it can.

    Probed in this process (QEMU inherits its user and capabilities) and
    remembered per process id: a forked worker or a process of another user
    probes again. The answer says which of the three ways in is closed:
    ``vm.unprivileged_userfaultfd``, CAP_SYS_PTRACE and the /dev/userfaultfd
    node (QEMU 7.2 uses only the system call, so the node does not help it).
    """
    pid = os.getpid()
    if pid not in _uffd_verdicts:
        _uffd_verdicts[pid] = _userfaultfd_problem_now()
    return _uffd_verdicts[pid]


def _userfaultfd_problem_now() -> str | None:
    err = _userfaultfd_syscall_errno()
    if err == 0:
        return None
    if err == 1:  # EPERM
        sysctl = _sysctl(USERFAULTFD_SYSCTL)
        node = ""
        if os.path.exists(USERFAULTFD_DEVICE):
            node = f"; {USERFAULTFD_DEVICE} is {_device_owner(USERFAULTFD_DEVICE)}"
        return (
            f"userfaultfd is not permitted for {_user_name()}: {USERFAULTFD_SYSCTL}={sysctl or '?'} and the "
            f"process lacks CAP_SYS_PTRACE{node}; fix: sudo sysctl -w {USERFAULTFD_SYSCTL}=1 "
            "(or run as root), or use the full or diff backend"
        )
    if err == 38:  # ENOSYS
        return "userfaultfd(2) is not available: the kernel was built without CONFIG_USERFAULTFD; use full or diff"
    return f"userfaultfd(2) failed: {os.strerror(err)}; use the full or diff backend"


def shm_free_bytes(path: str = "/dev/shm") -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize
