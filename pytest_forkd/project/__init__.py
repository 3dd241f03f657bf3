"""A test suite's project: forkd.yaml, the run's settings, its images and named snapshots, their lifecycle.

Layer 5 of docs/ARCHITECTURE.md. May import: everything below it (the
foundation (errors, paths, private, processes, sizes, tables, version,
waiting), guest, image, engine, storage, latency, core). Never aio, plugin or
cli (checked by tests/unit/test_layers.py).
"""
