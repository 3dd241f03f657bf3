"""``manifest_ms`` and ``changes_ms``: recording a checkpoint's manifest and diffing a 20,000-file tree."""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from pytest_forkd.core.factory import VMFactory

from .common import BenchPlan, _ms, figure

#: The generated tree of the manifest and changes() figures: DIRS x DIRS directories of FILES files.
TREE_ROOT = "/tmp/forkd-bench-tree"
TREE_DIRS, TREE_FILES = 20, 50
_TREE_SCRIPT = f"""
import os
for a in range({TREE_DIRS}):
    for b in range({TREE_DIRS}):
        d = "{TREE_ROOT}/d%d/e%d" % (a, b)
        os.makedirs(d)
        for c in range({TREE_FILES}):
            with open("%s/f%d.txt" % (d, c), "w") as f:
                if c % 10 == 0:
                    f.write("file %d %d %d\\n" % (a, b, c))
"""
# What the agent does between checkpoint and changes() in round %(i)d: 100 files added, 100
# modified (half keep their size, so only a content hash tells), 100 deleted, 50 chmod-ed;
# each round in directories of its own, so rounds run one after the other in one VM.
_MUTATE_SCRIPT = """
import os
root, i = "%(root)s", %(i)d
for n in range(100):
    open("%%s/d0/e%%d/new%%d.txt" %% (root, i, n), "w").write("new\\n")
for n in range(100):
    path = "%%s/d%%d/e%%d/f%%d.txt" %% (root, 1 + i, n %% 20, 10 * (n // 20))
    data = open(path).read()
    open(path, "w").write(data.upper() if n %% 2 else data + "more\\n")
for n in range(100):
    os.unlink("%%s/d%%d/e%%d/f%%d.txt" %% (root, 7 + i, n %% 20, n // 20))
for n in range(50):
    os.chmod("%%s/d%%d/e%%d/f%%d.txt" %% (root, 13 + i, n %% 20, n // 20), 0o600)
"""
_CHANGE_ROUNDS = 6


def measure_changes(factory: VMFactory, base: Any, plan: BenchPlan, progress: Callable[[str], None]) -> dict[str, Any]:
    """``manifest_ms`` and ``changes_ms`` on a 20,000-file tree in a running VM; ``manifest_cold_ms`` after a restore.

    Each round records a checkpoint's manifest (what ``vm.checkpoint()`` adds
    to the branch), lets the guest change 350 paths, then calls ``changes()``:
    a second walk, the comparison, and content hashes of the 50 same-size
    modifications in the VM and in a child of the checkpoint.
    """
    from pytest_forkd.analysis.changes import record_manifest
    from pytest_forkd.core.checkpoint import Checkpoint

    files = TREE_DIRS * TREE_DIRS * TREE_FILES
    rounds = max(1, min(plan.repeats, _CHANGE_ROUNDS))
    progress(f"manifest and changes(): {files} files in {TREE_ROOT}, x {rounds}")
    vm = factory.fork_snapshot(base, 1)[0]
    manifests, changes_ms, cold = [], [], []
    try:
        vm.exec(["python3", "-c", _TREE_SCRIPT], check=True)
        paths = (
            int(
                vm.exec(
                    "find / -path /proc -prune -o -path /sys -prune -o -path /dev -prune -o -path /run "
                    "-prune -o -print | wc -l"
                ).stdout
            )
            - 1
        )
        for index in range(rounds):
            tag = f"bench-changes-{index}"
            started = time.perf_counter()
            record_manifest(vm, tag)  # what vm.checkpoint() does before branching
            manifests.append(_ms(started))
            checkpoint = Checkpoint(vm, vm.branch(tag))
            vm.exec(["python3", "-c", _MUTATE_SCRIPT % {"root": TREE_ROOT, "i": index}], check=True)
            started = time.perf_counter()
            with checkpoint.changes(include=(TREE_ROOT,)) as changes:
                changes_ms.append(_ms(started))
                counts = (len(changes.added), len(changes.modified), len(changes.deleted))
            if counts != (100, 150, 100):
                raise RuntimeError(
                    f"changes() on the bench tree found {counts} (added, modified, deleted), expected (100, 150, 100)"
                )
        vm.restore(checkpoint.snapshot)
        started = time.perf_counter()
        record_manifest(vm, "bench-changes-cold")
        cold.append(_ms(started))
    finally:
        vm.close()
    return {
        "manifest_ms": figure(manifests),
        "changes_ms": figure(changes_ms),
        "manifest_cold_ms": figure(cold),
        "changes_tree": {
            "paths": paths,
            "files": files,
            "added": 100,
            "modified": 150,
            "deleted": 100,
            "host_load_1min": round(os.getloadavg()[0], 2),
        },
    }
