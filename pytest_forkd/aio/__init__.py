"""The asyncio API of pytest-forkd: the VM API, awaited (see docs/async.md).

``AsyncVM`` wraps a :class:`~pytest_forkd.core.vm.VM`, ``AsyncSnapshot`` a
snapshot record, ``AsyncCheckpoint`` a checkpoint; ``aboot()`` boots a root
VM without blocking the event loop.

Layer 6 of docs/ARCHITECTURE.md. May import: everything below it (the
foundation (errors, paths, private, processes, sizes, tables, version,
waiting), guest, image, engine, storage, latency, core, project). Never plugin
or cli (checked by tests/unit/test_layers.py).
"""

from __future__ import annotations

from .process import AsyncGuestProcess, AsyncProcessOutput
from .vm import AsyncCheckpoint, AsyncSnapshot, AsyncVM, Starting, aboot

__all__ = [
    "AsyncCheckpoint",
    "AsyncGuestProcess",
    "AsyncProcessOutput",
    "AsyncSnapshot",
    "AsyncVM",
    "Starting",
    "aboot",
]
