"""An E2B-compatible server: agents written against E2B's SDKs run unchanged, on forked microVMs.

What this room owns: the asyncio server (``server``: uvicorn on a thread of
its own; ``app``: one URL for the sandbox API and every sandbox, routed by
the SDKs' ``E2b-Sandbox-Id``/``E2b-Sandbox-Port`` headers), the sandboxes and
their life (``registry``, ``sandbox``, ``templates``), E2B's sandbox API
(``rest_api``), envd's Connect services (``envd_process``, ``envd_filesystem``,
on ``processes`` and the filesystem helper's host side, ``guest_helper``,
whose guest side is ``pytest_forkd/guest/e2b_files.py``), envd's file routes
(``files_http``), the code interpreter's routes (``interpreter_routes``), and
what they share (``config``, ``auth``, ``api_errors``, ``scope``). ``forkd
e2b serve`` (``pytest_forkd.cli.e2b_cmd``) and the ``forkd_e2b`` fixture
(``pytest_forkd.plugin.e2b``) run it.

Layer 7 of docs/ARCHITECTURE.md, beside the integrations. May import: the
foundation (errors, paths, processes...), core's VM API (``pytest_forkd.core``:
VMFactory, VM, branching, GuestProcess), ``pytest_forkd.aio`` (AsyncVM),
``pytest_forkd.project`` (ForkdSession, forkd.yaml snapshots) and
``pytest_forkd.integrations.sessions`` (image sessions); never ``engine``,
``storage``, ``guest`` or ``image`` directly, but for reading the paths of
the guest programs it runs (tests/e2b/test_e2b_units.py checks it), and
nothing imports it but the command line and the plugin. It needs the
``e2b`` extra: the SDK's message types and service descriptors, the
``connectrpc`` runtime, starlette, uvicorn and python-multipart.

Names are imported on first use, so ``import pytest_forkd.e2b`` costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pytest_forkd.e2b.config import Limits, ServerConfig
    from pytest_forkd.e2b.server import E2BServer

__all__ = ["E2BServer", "Limits", "ServerConfig"]

_WHERE = {"E2BServer": "server", "Limits": "config", "ServerConfig": "config"}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'pytest_forkd.e2b' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"pytest_forkd.e2b.{module}"), name)
