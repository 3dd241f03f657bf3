"""The VM life cycle: handles, the factory that owns them, forks, branches, checkpoints, pools, and the
runtime a factory runs them with (its storage backends and timing recorder).

Also what a VM did and how it changed: transcripts, filesystem changes,
trajectories and their bisection, replays; portable snapshot archives.

Layer 4 of docs/ARCHITECTURE.md. May import: the foundation (errors, paths,
private, processes, sizes, tables, version, waiting), guest, image, engine,
storage and latency. Never project, aio, plugin or cli (checked by
tests/unit/test_layers.py).
"""
