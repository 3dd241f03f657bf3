"""Portable snapshot archives: one file that carries a snapshot (its image, memory, device state and
record) to another host, exported and imported with every part checked.

Layer 4 of docs/ARCHITECTURE.md, beside the life cycle (``core``): the
factory exports and imports through it. May import: the foundation, guest,
image, engine, storage, latency and the rooms of its own floor. Never
project, aio, plugin or cli (checked by tests/unit/test_layers.py).
"""
