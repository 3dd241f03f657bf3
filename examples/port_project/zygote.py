"""A pytest process that imports pytest once in the parent VM, then runs one test module in each child.

Importing pytest costs seconds of emulated CPU in a guest (30 s on a busy
2-core TCG host). Started in the parent VM before the snapshot its children
fork from, this process is already past that import in every child: it waits
on a FIFO, so each child only writes the module to run into ``request`` and
reads the exit status from ``status`` (the output is in ``output``); the
three FIFOs (``ready``, ``request``, ``status``) are made before it starts. Each
child's copy of the process serves that child once; the parent's is never
woken. Runs in the guest; stdlib and pytest only.
"""

from __future__ import annotations

import os
import sys

directory = sys.argv[1]
sys.path.insert(0, os.getcwd())  # what `python3 -m pytest` does: the project's source root is importable

import pytest  # noqa: E402 - the expensive part, done once before the fork

with open(os.path.join(directory, "ready"), "w") as ready:  # the conftest waits on this before the snapshot
    ready.write("ready\n")
with open(os.path.join(directory, "request")) as request:  # blocks until a child writes to it
    args = [arg for arg in request.read().split("\0") if arg]
output = os.open(os.path.join(directory, "output"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.dup2(output, 1)
os.dup2(output, 2)
try:
    status = int(pytest.main(args))
except BaseException as exc:  # noqa: BLE001 - whatever happens, the child must get a status
    print(f"the pytest process failed: {exc!r}", flush=True)
    status = 3
sys.stdout.flush()
with open(os.path.join(directory, "status"), "w") as reply:
    reply.write(f"{status}\n")
