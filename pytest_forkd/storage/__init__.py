"""Snapshots at rest: the snapshot record, the store, integrity checks, the storage-backend registry, and
the plan of a snapshot's children (what they are restored from, checked).

A storage backend decides how the memory of a running VM is captured and
restored; the built-in ones live in the top-level ``backends`` package and
register through the same pluggy hook as third-party ones.

Also the store's layout of project namespaces (portable snapshot archives
need the engine's facts and live in :mod:`pytest_forkd.archives.archive`).

Layer 3 of docs/ARCHITECTURE.md, beside latency and the built-in backends. May
import: the foundation (errors, paths, private, processes, sizes, tables,
version, waiting), guest, image and engine. Never latency, core, project, aio,
plugin or cli (checked by tests/unit/test_layers.py).
"""

from pytest_forkd.moved import alias

# zstd streams are the foundation's now (one implementation for archives, image layers and the kernel).
alias({"pytest_forkd.storage.zstdio": "pytest_forkd.zstdio"})
