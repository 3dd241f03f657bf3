"""Suite-wide guard for pytest-forkd's own tests: a run must not leak VMs.

Every test closes what it starts (fixtures own their factories). After the
last test, no QEMU process may still reference one of this process's run
directories; if one does, the run fails and names it, since a leak that only
shows up as a slow machine later is much harder to trace back.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pytest_forkd.paths import shm_root

# The plugin's own tests drive inner pytest runs (tests/plugin); the container image tests share
# a real registry server and the images pushed to it (tests/registry.py: fixtures used by name).
pytest_plugins = ["pytester", "registry"]


def _leaked_vms() -> list[str]:
    from support import processes_mentioning  # tests/ is on the path (pythonpath in pyproject.toml)

    own_runs = shm_root().glob(f"run-{os.getpid()}-*")
    return [line for run in own_runs for line in processes_mentioning(run) if "qemu-system" in line]


#: Podman's lock files present when the run started (tests/support.py's ``podman_locks``).
PODMAN_LOCKS_BEFORE = pytest.StashKey[set[Path]]()


def pytest_configure(config: pytest.Config) -> None:
    from support import podman_locks

    config.stash[PODMAN_LOCKS_BEFORE] = {lock for lock in podman_locks() if lock.exists()}


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from support import remove_podman_locks_made_since

    if not hasattr(session.config, "workerinput"):  # the builds of every worker have ended
        remove_podman_locks_made_since(session.config.stash.get(PODMAN_LOCKS_BEFORE, set()))
    leaked = _leaked_vms()
    if leaked:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line("VMs still running after the last test (a leak):", red=True)
            for line in leaked:
                reporter.write_line(f"  {line}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
