"""The run directory: everything one process's VMs create, in one place.

RAM files, sockets and console logs of every VM started by a process live in
``/dev/shm/pytest-forkd/run-<pid>-<token>/``. Removing that directory removes
every byte a run left behind, and a directory whose owner process is gone is
recognisably stale: the next run kills whatever QEMU still references it and
removes it.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import shutil
import signal
import time
from pathlib import Path

from ..paths import shm_root

OWNER_FILE = "owner.json"


def _process_start_time(pid: int) -> str | None:
    """Kernel start time of ``pid`` (field 22 of /proc/PID/stat), to detect PID reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _owner_alive(directory: Path) -> bool:
    try:
        owner = json.loads((directory / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return _process_start_time(int(owner.get("pid", -1))) == owner.get("start_time")


def _age_seconds(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def _kill_processes_referencing(directory: Path) -> int:
    """SIGKILL every process whose command line mentions ``directory``."""
    needle = str(directory).encode()
    killed = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if needle in cmdline:
            try:
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
            except OSError:
                pass
    return killed


def clean_stale(root: Path | None = None) -> list[Path]:
    """Remove run directories (and kill their QEMUs) whose owner process is gone."""
    root = root or shm_root()
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for directory in [*root.glob("run-*"), *root.glob(".run-*")]:
        if directory.name.startswith(".") and _age_seconds(directory) < 60:
            continue  # being created right now
        if directory.is_dir() and not _owner_alive(directory):
            _kill_processes_referencing(directory)
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
    return removed


class RunDir:
    """A fresh run directory owned by this process; ``close()`` removes it."""

    def __init__(self, root: Path | None = None) -> None:
        root = root or shm_root()
        name = f"run-{os.getpid()}-{secrets.token_hex(3)}"
        # Appear with the owner file already inside: another process's
        # clean_stale() must never see this directory without its owner.
        pending = root / f".{name}"
        for _ in range(10):
            root.mkdir(parents=True, exist_ok=True)
            try:
                pending.mkdir()
                break
            except FileNotFoundError:  # the last run of another process removed the empty root
                continue
        else:
            raise OSError(f"cannot create a run directory under {root}")
        clean_stale(root)
        owner = {"pid": os.getpid(), "start_time": _process_start_time(os.getpid())}
        (pending / OWNER_FILE).write_text(json.dumps(owner))
        self.path = root / name
        os.rename(pending, self.path)
        self._counter = itertools.count(1)

    def new_name(self, prefix: str = "vm") -> str:
        """A name for a new VM's files, unique in this run (safe from several threads)."""
        return f"{prefix}{next(self._counter)}"

    def close(self) -> None:
        """Kill what still uses the directory and remove it (and the root, once no run is left)."""
        _kill_processes_referencing(self.path)
        shutil.rmtree(self.path, ignore_errors=True)
        try:
            self.path.parent.rmdir()
        except OSError:  # other runs (or their stale directories) are still there
            pass
