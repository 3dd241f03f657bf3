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

from pytest_forkd.engine.qemu.host import Qemu, kernel_release, kvm_access_problem
from pytest_forkd.errors import ConfigError, ForkdError, HostNotReady
from pytest_forkd.paths import cache_dir

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
    """Why KVM cannot even be tried (missing device, no access for this user), or None."""
    return kvm_access_problem()


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first}"[:200] if not isinstance(exc, ForkdError) else first[:200]


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
    verdict is not cached yet. Whatever way the probe fails (an error of ours,
    any other exception, QEMU exiting early or resetting its monitor
    connection, a timeout), the verdict is "KVM unusable: <reason>" and TCG:
    a first run must never fail because KVM does not work. An explicit
    ``kvm`` on a host whose /dev/kvm this user cannot open is a HostNotReady.
    """
    validate_accel(requested)
    now = time.time()
    if requested == "kvm":
        blocker = _kvm_usable()
        if blocker is not None:
            raise HostNotReady(f"accel kvm was requested but KVM is unusable: {blocker}; or use accel auto/tcg")
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
            verdict = AccelVerdict("tcg", f"KVM unusable: {blocker}; using TCG", kernel_release(), qemu.version, now)
        else:
            try:
                probe()
            except Exception as exc:  # noqa: BLE001 - every failure of the probe means "no KVM"
                verdict = AccelVerdict(
                    "tcg",
                    f"KVM unusable: the probe failed ({_one_line(exc)}); using TCG",
                    kernel_release(),
                    qemu.version,
                    now,
                )
            else:
                verdict = AccelVerdict("kvm", "KVM probe booted a guest", kernel_release(), qemu.version, now)
        try:
            data = json.loads(cache.read_text())
        except (OSError, ValueError):
            data = {}
        data[f"{verdict.kernel_release}|{verdict.qemu_version}"] = {
            k: v for k, v in asdict(verdict).items() if k != "cached"
        }
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        try:
            tmp.write_text(json.dumps(data, indent=2))
            os.replace(tmp, cache)
        except OSError:  # an unwritable cache costs a probe next time, never the run
            tmp.unlink(missing_ok=True)
        return verdict
