"""The built-in storage backends full, diff and uffd (installed as ``forkd_backends``).

Each implements the same pluggy hook as a third-party backend and is
registered in code, under its name, by every runtime
(:mod:`pytest_forkd.core.runtime`; see :mod:`pytest_forkd.storage.backend`
and docs/ARCHITECTURE.md, "Adding a storage backend").

Beside the storage layer (layer 3 of docs/ARCHITECTURE.md). May import: the
foundation modules, guest, image, engine and storage. Never latency, core
or anything above (checked by tests/unit/test_layers.py).
"""
