"""The QEMU engine: ``microvm`` processes, QMP, the accelerator choice, user-mode networking.

The only package that knows QEMU's command line and QMP. Everything above
the engine layer reaches it through :mod:`pytest_forkd.engine.base`;
:class:`~pytest_forkd.engine.qemu.engine.QemuEngine` is its implementation of
that interface.
"""

from __future__ import annotations

from typing import Any

__all__ = ["QemuEngine"]


def __getattr__(name: str) -> Any:
    """``QemuEngine``, imported when first asked for (importing a submodule stays cheap)."""
    if name == "QemuEngine":
        from pytest_forkd.engine.qemu.engine import QemuEngine

        return QemuEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
