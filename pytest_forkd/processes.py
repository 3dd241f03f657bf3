"""Whether a process still runs: the one liveness probe, for snapshot writers, run directories and tests.

``/proc/PID/stat`` answers both questions that matter: does the pid exist
and is it more than a zombie waiting to be reaped, and is it still the
same process (its kernel start time, so a recycled pid does not count).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["is_alive", "start_time"]


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name, or None when there is no such process."""
    if pid <= 0:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()


def start_time(pid: int) -> str | None:
    """The kernel start time of ``pid`` (field 22 of /proc/PID/stat), None when it is gone."""
    fields = _stat_fields(pid)
    return fields[19] if fields is not None else None


def is_alive(pid: int, started: str | None = None) -> bool:
    """True while ``pid`` runs (not a zombie) and, given ``started``, is the process that started then."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return False
    return started is None or fields[19] == started
