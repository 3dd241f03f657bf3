"""The host CPU a KVM guest depends on.

Under KVM the guest runs with ``-cpu host``: it sees this CPU's model and
feature flags, and a snapshot of it restored on a CPU with other flags can
crash or misbehave. Under TCG the CPU model is fixed by the command line, so
none of this matters there.
"""

from __future__ import annotations

import functools
import hashlib
import platform


@functools.lru_cache(maxsize=1)
def host_cpu() -> dict[str, str]:
    """Model name and a hash of the feature flags of this host's CPU (from /proc/cpuinfo)."""
    found: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "flags") and key not in found:
                    found[key] = value.strip() if key == "model name" else " ".join(sorted(value.split()))
                if len(found) == 2:
                    break
    except OSError:
        pass
    flags = found.get("flags", "")
    return {
        "model": found.get("model name") or platform.processor() or platform.machine(),
        "flags_sha256": hashlib.sha256(flags.encode()).hexdigest()[:16],
    }


def host_cpu_id() -> str:
    """``host_cpu()`` as one string, for snapshot fingerprints."""
    cpu = host_cpu()
    return f"{cpu['model']} (flags {cpu['flags_sha256']})"
