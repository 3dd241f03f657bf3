"""Argument checks that run before any QEMU process starts.

A bad argument is cheapest to report before anything is built, probed or
booted: ``memory_mib=0`` otherwise comes back in QEMU's own words, an
initramfs that does not fit its guest memory hangs a boot for 90 s, and
``memory_mib=100000`` on a 24 GiB host boots a guest that takes the host
down. Each check raises :class:`~pytest_forkd.errors.InvalidArgument` (a
ConfigError and a ValueError) saying what was wrong and what to pass instead.

Limits that depend on the host can be raised on purpose: ``FORKD_MAX_MEMORY_MIB``
and ``FORKD_MAX_VCPUS``.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

from pytest_forkd.errors import InvalidArgument
from pytest_forkd.paths import validate_tag

__all__ = [
    "InvalidArgument",
    "command",
    "count",
    "environment",
    "guest_path",
    "initramfs_floor_mib",
    "max_memory_mib",
    "memory_mib",
    "timeout",
    "validate_tag",
    "vcpus",
]

#: Share of host RAM one guest may have unless FORKD_MAX_MEMORY_MIB says otherwise.
HOST_MEMORY_SHARE = 0.5
MAX_MEMORY_ENV = "FORKD_MAX_MEMORY_MIB"
MAX_VCPUS_ENV = "FORKD_MAX_VCPUS"
#: What the guest kernel and the agent need besides the initramfs (measured: see initramfs_floor_mib).
KERNEL_AND_AGENT_MIB = 68
#: The kernel holds the initramfs archive and its unpacked copy in RAM at once while booting.
INITRAMFS_COPIES = 2
MIN_MEMORY_MIB = 64
MAX_GUEST_PATH = 4096


def _whole(value: Any, what: str, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{what} must be a whole number, got {value!r} ({type(value).__name__}); {hint}")
    return value


def host_memory_mib() -> int | None:
    """Total RAM of this host in MiB (MemTotal), or None when /proc/meminfo is unreadable."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def max_memory_mib() -> int | None:
    """The largest guest memory allowed here: ``$FORKD_MAX_MEMORY_MIB``, else half the host's RAM."""
    explicit = os.environ.get(MAX_MEMORY_ENV, "").strip()
    if explicit:
        try:
            value = int(explicit)
        except ValueError:
            raise InvalidArgument(
                f"{MAX_MEMORY_ENV}={explicit!r} is not a whole number of MiB; "
                "set it to the largest guest memory you allow, e.g. 65536"
            ) from None
        if value < MIN_MEMORY_MIB:
            raise InvalidArgument(f"{MAX_MEMORY_ENV}={value} is below the {MIN_MEMORY_MIB} MiB any guest needs")
        return value
    total = host_memory_mib()
    return None if total is None else int(total * HOST_MEMORY_SHARE)


def initramfs_floor_mib(initrd: Path | str) -> int:
    """The least guest memory that boots an image with this initramfs.

    The kernel keeps the archive and the tmpfs it unpacks it into in memory
    at the same time, then needs room for itself, Python and the agent.
    Measured with the default image (Debian 12 cloud kernel, 36.3 MiB
    initramfs, TCG): 140 MiB boots and runs Python; 136 MiB hangs before the
    agent answers; 132 MiB and less panic ("System is deadlocked on memory").
    The floor here is 142 MiB for it.
    """
    size_mib = math.ceil(os.stat(initrd).st_size / (1 << 20))
    return INITRAMFS_COPIES * size_mib + KERNEL_AND_AGENT_MIB


def memory_mib(value: object, *, initrd: Path | str | None = None, image: str | None = None) -> int:
    """Check a guest memory size in MiB: a whole number, enough for the image, within the host's share."""
    hint = "pass memory_mib in MiB, e.g. 256"
    value = _whole(value, "memory_mib", hint)
    if value < MIN_MEMORY_MIB:
        raise InvalidArgument(f"memory_mib={value} is too small: a guest needs at least {MIN_MEMORY_MIB} MiB; {hint}")
    limit = max_memory_mib()
    if limit is not None and value > limit:
        total = host_memory_mib()
        raise InvalidArgument(
            f"memory_mib={value} is more than this host allows one guest ({limit} MiB"
            + (f", half of its {total} MiB of RAM" if total and not os.environ.get(MAX_MEMORY_ENV) else "")
            + f"); use less memory, or raise the limit on purpose with {MAX_MEMORY_ENV}=<MiB>"
        )
    if initrd is not None:
        floor = initramfs_floor_mib(initrd)
        if value < floor:
            size = os.stat(initrd).st_size / (1 << 20)
            raise InvalidArgument(
                f"memory_mib={value} is too small for image {image or initrd!r}: its initramfs is {size:.0f} MiB, "
                f"which the guest holds twice while booting, so it needs at least {floor} MiB; "
                f"use memory_mib >= {floor}, or make the image smaller"
            )
    return value


def vcpus(value: object) -> int:
    """Check a vCPU count: at least 1, at most the host's CPUs (``$FORKD_MAX_VCPUS`` raises that)."""
    value = _whole(value, "vcpus", "pass a vCPU count, e.g. 1")
    if value < 1:
        raise InvalidArgument(f"vcpus={value}: a VM needs at least 1 vCPU")
    explicit = os.environ.get(MAX_VCPUS_ENV, "").strip()
    try:
        limit = int(explicit) if explicit else (os.cpu_count() or 1)
    except ValueError:
        raise InvalidArgument(f"{MAX_VCPUS_ENV}={explicit!r} is not a whole number") from None
    if value > limit:
        raise InvalidArgument(
            f"vcpus={value} is more than {'allowed by ' + MAX_VCPUS_ENV if explicit else 'this host has CPUs'} "
            f"({limit}); use at most {limit}, or set {MAX_VCPUS_ENV} to allow more on purpose"
        )
    return value


def timeout(value: Any, what: str = "timeout", *, optional: bool = True) -> float | None:
    """Check a timeout in seconds: a positive finite number (or None when ``optional``)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(
            f"{what} must be a number of seconds{' or None' if optional else ''}, got {value!r}; "
            + ("pass None to wait without a limit" if optional else "pass e.g. 30")
        )
    if not math.isfinite(value) or value <= 0:
        raise InvalidArgument(
            f"{what}={value!r} is not a positive number of seconds; "
            + ("pass None to wait without a limit" if optional else "pass e.g. 30")
        )
    return float(value)


def count(value: object, what: str = "n") -> int:
    """Check a number of VMs to start: a whole number >= 1."""
    value = _whole(value, what, "pass how many VMs to start, e.g. 1")
    if value < 1:
        raise InvalidArgument(f"{what}={value}: need at least 1")
    return value


_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,63}(:[A-Za-z0-9_][A-Za-z0-9._-]{0,63})?")


def image_name(value: Any) -> str:
    """Check what names an image; return the image name, or the container reference's canonical text.

    A container reference is read as ``--forkd-image`` and Docker read it: a
    transport (``docker://``, ``oci:``, ``oci-archive:``, ``docker-archive:``,
    ``dockerfile:``), or a bare reference (anything with ``/ : . @``, such as
    ``127.0.0.1:5000/app:1``), which means ``docker://``. A malformed one, or an
    unknown transport (``dokcer://``), fails here, before anything starts.
    Anything else must be a valid image name (``default``).
    """
    from pytest_forkd.image.oci.reference import names_container_image, parse_reference

    if isinstance(value, str) and names_container_image(value):
        return str(parse_reference(value))
    return validate_tag(value, "image name")


def user(value: Any) -> str | None:
    """Check a guest user: ``name``, ``uid``, ``name:group`` or ``uid:gid`` (None: the image's user)."""
    if value is None:
        return None
    if not isinstance(value, str) or not _USER.fullmatch(value):
        raise InvalidArgument(
            f"user must be 'NAME', 'UID', 'NAME:GROUP' or 'UID:GID' (letters, digits, '.', '_', '-'), got {value!r}"
        )
    return value


def guest_path(value: Any, what: str = "path") -> str:
    """Check a path inside the guest: an absolute str without NUL bytes."""
    if not isinstance(value, str):
        raise InvalidArgument(f"{what} must be a str (a path inside the guest), got {value!r} ({type(value).__name__})")
    if "\0" in value:
        raise InvalidArgument(f"{what} {value!r} contains a NUL byte, which no path can hold")
    if not value.startswith("/"):
        raise InvalidArgument(f"{what} {value!r} is relative; guest paths must be absolute, e.g. '/root/{value}'")
    if len(value.encode()) > MAX_GUEST_PATH:
        raise InvalidArgument(f"{what} is {len(value.encode())} bytes long; Linux paths stop at {MAX_GUEST_PATH}")
    return value


def command(value: Any) -> Any:
    """Check a guest command: a non-empty str (run by /bin/sh) or a non-empty list of str, no NUL bytes."""
    if isinstance(value, str):
        if not value.strip():
            raise InvalidArgument("the command is empty; pass a shell command line or an argv list")
        if "\0" in value:
            raise InvalidArgument(f"the command {value!r} contains a NUL byte, which no command line can hold")
        return value
    if isinstance(value, (bytes, bytearray)) or not hasattr(value, "__iter__"):
        raise InvalidArgument(f"the command must be a str or a list of str, got {type(value).__name__}")
    argv = list(value)
    if not argv:
        raise InvalidArgument("the command is an empty list; pass at least the program to run")
    for index, word in enumerate(argv):
        if not isinstance(word, str):
            raise InvalidArgument(f"command[{index}] must be a str, got {word!r} ({type(word).__name__})")
        if "\0" in word:
            raise InvalidArgument(f"command[{index}] {word!r} contains a NUL byte, which no argument can hold")
    return value


def max_output(value: Any, what: str = "max_output") -> int:
    """Check a per-stream output cap: a whole number of bytes >= 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(f"{what} must be a number of bytes >= 0, got {value!r}; pass e.g. 4 << 20 (4 MiB)")
    return value


def environment(value: Any) -> Any:
    """Check a guest environment: str names without '=' or NUL, str values without NUL."""
    if value is None:
        return None
    if not hasattr(value, "items"):
        raise InvalidArgument(f"env must be a mapping of str to str, got {type(value).__name__}")
    for name, item in value.items():
        if not isinstance(name, str) or not name or "=" in name or "\0" in name:
            raise InvalidArgument(f"env: {name!r} is not a valid variable name (a non-empty str without '=' or NUL)")
        if not isinstance(item, str) or "\0" in item:
            raise InvalidArgument(f"env[{name!r}] must be a str without NUL bytes, got {item!r}")
    return value
