"""What pytest-forkd costs a process that never boots a VM: importing it, and pytest starting with it.

pytest imports the plugin in every project that has pytest-forkd installed,
so these are paid by runs that never use it. ``import_ms`` is what
``python -X importtime -c "import pytest_forkd"`` reports for the package
(cumulative); ``pytest_startup_overhead_ms`` is the difference between
``pytest --co -q`` on a one-test directory with the plugin and with
``-p no:forkd``, measured in pairs (which one runs first alternates) so
load drifts cancel out.
On a loaded machine wall-clock time mostly measures the wait for a CPU, so
the same difference is also given in CPU time (user + system) of the pytest
process, ``pytest_startup_overhead_cpu_ms``: the steadier figure of the two.
Fresh interpreters each time, so nothing is cached in the process.
"""

from __future__ import annotations

import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pytest_forkd.errors import ForkdError

_PACKAGE_LINE_END = "| pytest_forkd"


def import_ms(repeats: int) -> list[float]:
    """Milliseconds ``import pytest_forkd`` takes in a fresh interpreter, per ``-X importtime``."""
    samples = []
    for _ in range(repeats):
        done = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", "import pytest_forkd"],
            capture_output=True,
            text=True,
            check=False,
        )
        lines = [line for line in done.stderr.splitlines() if line.rstrip().endswith(_PACKAGE_LINE_END)]
        if done.returncode != 0 or not lines:
            raise ForkdError(
                f"`{sys.executable} -X importtime -c 'import pytest_forkd'` failed: "
                f"{done.stderr.strip()[-500:] or 'no output'}; check the installation"
            )
        samples.append(int(lines[-1].split("|")[1]) / 1000)
    return samples


def pytest_startup_ms(repeats: int) -> dict[str, list[float]]:
    """``pytest --co -q`` on a one-test directory with and without the plugin, and their pairwise difference."""
    with_plugin, without, overhead, cpu_overhead = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="forkd-startup-") as scratch:
        (Path(scratch) / "test_nothing.py").write_text("def test_nothing():\n    pass\n")

        def run(*extra: str) -> tuple[float, float]:
            """Wall-clock and CPU milliseconds of one pytest start-up."""
            cpu_before = _children_cpu_s()
            started = time.perf_counter()
            done = subprocess.run(
                [sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", *extra],
                cwd=scratch,
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode != 0:
                raise ForkdError(
                    f"pytest --co in {scratch} failed ({done.returncode}): {(done.stdout + done.stderr).strip()[-500:]}"
                )
            return (time.perf_counter() - started) * 1000, (_children_cpu_s() - cpu_before) * 1000

        for index in range(repeats):
            if index % 2:  # which of the two runs first alternates: the first of a pair tends to be slower
                (off, off_cpu), (on, on_cpu) = run("-p", "no:forkd"), run()
            else:
                (on, on_cpu), (off, off_cpu) = run(), run("-p", "no:forkd")
            with_plugin.append(on)
            without.append(off)
            overhead.append(on - off)
            cpu_overhead.append(on_cpu - off_cpu)
    return {
        "pytest_startup_ms": with_plugin,
        "pytest_startup_without_forkd_ms": without,
        "pytest_startup_overhead_ms": overhead,
        "pytest_startup_overhead_cpu_ms": cpu_overhead,
    }


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def startup_samples(repeats: int) -> dict[str, list[float]]:
    """Every figure of this module, as samples: ``import_ms`` and the pytest start-up ones."""
    return {"import_ms": import_ms(max(repeats, 5)), **pytest_startup_ms(max(repeats, 5))}
