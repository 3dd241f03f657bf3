"""Helpers of the engine contract tests: guest files relative to the agent's working directory."""

from __future__ import annotations

from pytest_forkd.core.vm import VM


def home(vm: VM) -> str:
    """The agent's working directory in ``vm``: where relative guest paths land."""
    return vm.exec("pwd").stdout.strip().rstrip("/")


def read(vm: VM, name: str) -> str:
    """Contents of ``name`` (relative to :func:`home`), or ``<missing>``."""
    result = vm.exec(["sh", "-c", f"cat {name} 2>/dev/null || echo '<missing>'"])
    return result.stdout
