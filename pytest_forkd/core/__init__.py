"""The VM life cycle: handles, the factory that owns them, forks, branches, checkpoints, pools, guest
processes and copies, and the runtime a factory runs them with (its storage backends and timing recorder).

What a VM did lives in :mod:`pytest_forkd.analysis` and portable archives in
:mod:`pytest_forkd.archives`, rooms beside this one; their old paths under
``pytest_forkd.core`` still import, with a DeprecationWarning.

Layer 4 of docs/ARCHITECTURE.md. May import: the foundation (errors, paths,
private, processes, sizes, tables, version, waiting), guest, image, engine,
storage and latency, and the rooms of its own floor (analysis, archives).
Never project, aio, plugin or cli (checked by tests/unit/test_layers.py).
"""

from pytest_forkd.moved import alias

alias(
    {
        f"pytest_forkd.core.{name}": f"pytest_forkd.{room}.{name}"
        for room, names in {
            "analysis": ("changes", "manifest", "transcript", "trajectory", "replay"),
            "archives": ("archive",),
        }.items()
        for name in names
    }
)
