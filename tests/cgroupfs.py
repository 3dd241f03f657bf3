"""A fake /proc for the cgroup tests: self/cgroup and self/mounts pointing at hierarchies built under tmp_path."""

from __future__ import annotations

from pathlib import Path


def fake_proc(tmp_path: Path, cgroup_lines: list[str], mounts: list[str]) -> Path:
    """A /proc whose ``self/cgroup`` has ``cgroup_lines`` and whose ``self/mounts`` has ``mounts``."""
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self/cgroup").write_text("\n".join(cgroup_lines) + "\n")
    (proc / "self/mounts").write_text("\n".join(mounts) + "\n")
    return proc
