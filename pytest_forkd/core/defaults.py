"""Which runtime the process-wide factories behind :func:`pytest_forkd.boot` run their VMs with.

A factory made by :func:`~pytest_forkd.core.factory.default_factory` has no
owner to hand it a :class:`~pytest_forkd.core.runtime.Runtime`. Inside a
pytest run its VMs belong to the run all the same: what a test starts with
``pytest_forkd.boot()`` must record its timings where the run's summary and
budgets read them. So the plugin names a provider here when it configures
the run (cheaply: this module imports nothing) and removes it when the run
ends; outside a run there is none, and each such factory makes a fresh runtime.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from pytest_forkd.core.runtime import Runtime

_lock = threading.Lock()
_provider: Callable[[], Runtime] | None = None


def use_runtime(provider: Callable[[], Runtime] | None) -> Callable[[], Runtime] | None:
    """Process-wide factories made from now on take their runtime from ``provider`` (None: a fresh one each).

    Returns the provider it replaces, to be put back when the run ends (a
    pytest run inside a pytest run, as pytester makes, must not take the
    outer run's away).
    """
    global _provider
    with _lock:
        previous, _provider = _provider, provider
    return previous


def runtime() -> Runtime | None:
    """The runtime for a process-wide factory being made now, or None for a fresh one."""
    with _lock:
        provider = _provider
    return provider() if provider is not None else None
