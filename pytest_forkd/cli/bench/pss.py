"""Memory of idle children and of a working parent, read from /proc (PSS, by kind of mapping)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

from pytest_forkd.core.factory import VMFactory
from pytest_forkd.storage.store import SnapshotStore


def pss_mib(pid: int) -> float:
    """Proportional set size of a process (MiB): its private pages plus its share of shared ones."""
    with open(f"/proc/{pid}/smaps_rollup") as handle:
        for line in handle:
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no Pss line in /proc/{pid}/smaps_rollup")


def pss_parts_mib(pid: int, ram_path: Path) -> dict[str, float]:
    """A QEMU process's PSS by kind of mapping: guest RAM, translated code, QEMU's heap, binaries."""
    parts: dict[str, float] = {}
    kind = "other"
    with open(f"/proc/{pid}/smaps") as handle:
        for line in handle:
            head = line.split(None, 5)
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                name = head[5].strip() if len(head) > 5 else ""
                perms = head[1]
                if name.startswith(str(ram_path)):
                    kind = "guest_ram"
                elif not name:
                    kind = "tcg_code" if "x" in perms else "qemu_heap"
                elif name == "[heap]":
                    kind = "qemu_heap"
                elif name.startswith("["):
                    kind = "other"
                else:
                    kind = "binaries"
            elif line.startswith("Pss:"):
                parts[kind] = parts.get(kind, 0.0) + int(line.split()[1]) / 1024
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmPTE:"):
                parts["page_tables"] = int(line.split()[1]) / 1024
    return {key: round(value, 2) for key, value in sorted(parts.items())}


def measure_memory(factory: VMFactory, base: Any, children: int, progress: Callable[[str], None]) -> dict[str, Any]:
    """``child_pss_mib`` of idle pool-like children of ``base`` and ``parent_pss_mib`` of a working parent.

    The children are restored and have answered one command (as pooled
    children have), then sit idle; shared pages of the snapshot's memory are
    split between the processes mapping them, as the kernel's PSS does. The
    parent is a child of the same snapshot that ran a Python program and took
    a diff and a live (uffd, when available) branch, as a session's parent does.
    """
    progress(f"memory: PSS of {children} idle children and of a working parent ({base.memory_mib} MiB guests)")
    kids = factory.fork_snapshot(base, children)
    parent = factory.fork_snapshot(base, 1)[0]
    taken = []
    try:
        for kid in kids:
            kid.exec(["true"])
        parent.exec(["python3", "-c", "import json, hashlib; print(len(json.dumps(list(range(100000)))))"], check=True)
        backends = ["diff"] + ([] if factory.runtime.backends.get("uffd").unavailable_reason() else ["uffd"])
        for backend in backends:
            snapshot = parent.branch(backend=backend)
            taken.append(snapshot.wait_ready(timeout=600) if not snapshot.is_ready else snapshot)
        time.sleep(1.0)  # idle: background copies and translations settle
        per_child = [pss_mib(kid.machine.pid) for kid in kids]
        return {
            "child_pss_mib": round(sum(per_child) / len(per_child), 2),
            "child_pss_parts_mib": pss_parts_mib(kids[0].machine.pid, kids[0].machine.ram_path),
            "parent_pss_mib": round(pss_mib(parent.machine.pid), 2),
            "memory_conditions": {
                "guest_mib": base.memory_mib,
                "idle_children": children,
                "parent_branches": backends,
                "host_load_1min": round(os.getloadavg()[0], 2),
            },
        }
    finally:
        for vm in kids + [parent]:
            vm.close()
        for snapshot in taken:
            SnapshotStore(snapshot.path.parent).remove(snapshot.tag, cascade=True)
