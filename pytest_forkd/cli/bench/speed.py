"""How much slower Python runs in the guest than on the host (the emulation's toll on CPU-bound tests)."""

from __future__ import annotations

import os
from typing import Any, Callable

from pytest_forkd.core.factory import VMFactory

from .common import figure

#: The CPU-bound loop timed in the guest and on the host (same interpreter version where possible).
SPEED_LOOP = (
    "import time\nstarted = time.perf_counter()\ntotal = 0\nfor i in range(%d):\n    total += i * i\n"
    "print(time.perf_counter() - started)"
)


def measure_guest_speed(
    factory: VMFactory, base: Any, repeats: int, progress: Callable[[str], None], iterations: int = 1_000_000
) -> dict[str, Any]:
    """``guest_python_slowdown``: a CPU-bound Python loop in the guest over the same loop on the host (best of n)."""
    import subprocess
    import sys

    progress(f"guest speed: a {iterations}-iteration Python loop in the guest and on the host, x {repeats}")
    script = SPEED_LOOP % iterations
    vm = factory.fork_snapshot(base, 1)[0]
    try:
        guest = [float(vm.exec(["python3", "-c", script], check=True, timeout=600).stdout) for _ in range(repeats)]
        guest_version = vm.exec(["python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"]).stdout.strip()
    finally:
        vm.close()
    host = [
        float(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout)
        for _ in range(repeats)
    ]
    return {
        "guest_python_s": figure(guest),
        "host_python_s": figure(host),
        "guest_python_slowdown": round(min(guest) / min(host), 2),
        "guest_speed_conditions": {
            "guest_python": guest_version,
            "host_python": "%d.%d" % sys.version_info[:2],
            "iterations": iterations,
            "host_load_1min": round(os.getloadavg()[0], 2),
        },
    }
