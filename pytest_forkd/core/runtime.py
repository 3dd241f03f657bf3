"""The runtime: the storage backends and the timing recorder of one user of forkd.

Why it exists: a backend registry and a timing recorder are state, and state
kept in module globals is shared by everything in the process: two pytest
sessions run in one process (pytester, a script that opens two sessions),
two factories of one script, a test that swaps a recorder and forgets to
swap it back. A :class:`Runtime` is owned by whoever runs VMs (the pytest
session, a ``forkd`` command, a script) and handed to its
:class:`~pytest_forkd.core.factory.VMFactory` (which makes a fresh one when
given none). Every fork, branch and exec of that factory's VMs looks its
backend up in ``runtime.backends`` and records its timing on
``runtime.recorder``, so nothing one runtime holds is seen by another, and
nothing outlives the runtime that holds it.

The backends are pluggy plugins registered as tox registers its internal
plugins: the built-in ones (``forkd_backends.full``, ``diff``, ``uffd``) in
code, under their names and through the same hook a third party implements;
then the installed ``pytest_forkd.backends`` entry points (one whose name is
taken is skipped); then the plugins given to :func:`~pytest_forkd.storage.backend.register_plugin`
before the runtime was made, and those given to the runtime itself. The
registry is filled when the runtime is made: whoever makes one is about to
run VMs (the pytest plugin makes its run's runtime on first use).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Iterable

from pytest_forkd.latency.timings import Recorder
from pytest_forkd.storage.backend import BackendRegistry, default_plugins, fill_registry, plugin_manager


def builtin_backends() -> dict[str, object]:
    """The built-in backend plugins (modules of ``forkd_backends``), by the name each is registered under."""
    return {
        "full": importlib.import_module("forkd_backends.full"),
        "diff": importlib.import_module("forkd_backends.diff"),
        "uffd": importlib.import_module("forkd_backends.uffd"),
    }


class Runtime:
    """The storage backends and the timing recorder one session, command or script runs its VMs with.

    ``plugins`` are backend plugin objects (modules or instances with the
    ``forkd_register_backends`` hook) for this runtime only; ``recorder``
    is where its VMs' timing samples go (a fresh :class:`Recorder` by default).
    """

    def __init__(self, *, plugins: Iterable[object] = (), recorder: Recorder | None = None) -> None:
        self.recorder: Recorder = recorder if recorder is not None else Recorder()
        """Timing samples of every operation of this runtime's VMs (see :mod:`pytest_forkd.latency.timings`)."""
        self._plugins = plugin_manager(builtin_backends(), [*default_plugins(), *plugins])
        self.backends: BackendRegistry = fill_registry(self._plugins)
        """The storage backends by id: the built-in ones, the installed ones, then this runtime's plugins."""
        self._lock = threading.Lock()

    def register(self, plugin: object) -> None:
        """Add the backend plugin ``plugin`` to this runtime; its backends join :attr:`backends` at once."""
        with self._lock:
            if not self._plugins.is_registered(plugin):
                self._plugins.register(plugin)  # the hook is historic: the plugin fills the registry now

    def __repr__(self) -> str:
        return f"<Runtime backends {', '.join(self.backends.ids())}, {len(self.recorder.samples())} samples>"
