"""Choosing the accelerator: KVM where it really works, TCG otherwise.

``/dev/kvm`` existing is not enough: on nested, paravirtual hosts
``KVM_CREATE_VM`` succeeds but a normal guest dies with "KVM internal error"
or hangs. So ``auto`` boots the image once under KVM with a short readiness
deadline and falls back to TCG. The verdict is cached per host (kernel
release + QEMU version), so the probe is paid once.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from filelock import FileLock

from ..errors import ConfigError, ForkdError
from ..paths import cache_dir
from .host import Qemu, kernel_release

ACCELS = ("auto", "kvm", "tcg")
PROBE_TIMEOUT_S = 8.0


@dataclass(frozen=True)
class AccelVerdict:
    accel: str  # "kvm" or "tcg"
    reason: str
    kernel_release: str
    qemu_version: str
    probed_at: float
    cached: bool = False


def validate_accel(value: str) -> str:
    if value not in ACCELS:
        raise ConfigError(f"accel {value!r} is not one of {', '.join(ACCELS)}")
    return value


def _cache_path() -> Path:
    return cache_dir() / "accel.json"


def _kvm_usable() -> str | None:
    """Why KVM cannot even be tried, or None."""
    if not os.path.exists("/dev/kvm"):
        return "/dev/kvm does not exist"
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "/dev/kvm is not readable and writable by this user (add it to group kvm)"
    return None


def cached_verdict(qemu: Qemu) -> AccelVerdict | None:
    try:
        data = json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return None
    entry = data.get(f"{kernel_release()}|{qemu.version}")
    if not entry:
        return None
    return AccelVerdict(**{**entry, "cached": True})


def resolve_accel(requested: str, qemu: Qemu, probe: Callable[[], None]) -> AccelVerdict:
    """Turn ``auto|kvm|tcg`` into ``kvm`` or ``tcg``.

    ``probe`` boots a VM under KVM and raises if it does not answer within
    :data:`PROBE_TIMEOUT_S`; it is only called for ``auto`` on a host whose
    verdict is not cached yet.
    """
    validate_accel(requested)
    now = time.time()
    if requested != "auto":
        return AccelVerdict(requested, f"requested {requested}", kernel_release(), qemu.version, now)
    cached = cached_verdict(qemu)
    if cached is not None:
        return cached
    cache = _cache_path()
    cache.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache) + ".lock"):
        cached = cached_verdict(qemu)
        if cached is not None:
            return cached
        blocker = _kvm_usable()
        if blocker is not None:
            verdict = AccelVerdict("tcg", f"KVM unavailable: {blocker}", kernel_release(), qemu.version, now)
        else:
            try:
                probe()
            except ForkdError as exc:
                first_line = str(exc).splitlines()[0][:200]
                verdict = AccelVerdict("tcg", f"KVM probe failed ({first_line}); using TCG",
                                       kernel_release(), qemu.version, now)
            else:
                verdict = AccelVerdict("kvm", "KVM probe booted a guest", kernel_release(), qemu.version, now)
        try:
            data = json.loads(cache.read_text())
        except (OSError, ValueError):
            data = {}
        data[f"{verdict.kernel_release}|{verdict.qemu_version}"] = {
            k: v for k, v in asdict(verdict).items() if k != "cached"
        }
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        os.replace(tmp, cache)
        return verdict
