"""What an agent did in a VM: its transcript, the filesystem changes since a snapshot (manifests
compared on the host), trajectories and their bisection, and replays of a transcript.

Layer 4 of docs/ARCHITECTURE.md, beside the life cycle (``core``) it reads
through ``core.handles``. May import: the foundation, guest, image, engine,
storage, latency and the rooms of its own floor (core, archives). Never
project, aio, plugin or cli (checked by tests/unit/test_layers.py).
"""
