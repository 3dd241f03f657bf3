"""Helpers of the engine contract tests: guest files relative to the agent's working directory, and
the tests whose QEMU side is checked by an integration test instead."""

from __future__ import annotations

import pytest

from pytest_forkd.core.vm import VM


def home(vm: VM) -> str:
    """The agent's working directory in ``vm``: where relative guest paths land."""
    return vm.exec("pwd").stdout.strip().rstrip("/")


def read(vm: VM, name: str) -> str:
    """Contents of ``name`` (relative to :func:`home`), or ``<missing>``."""
    result = vm.exec(["sh", "-c", f"cat {name} 2>/dev/null || echo '<missing>'"])
    return result.stdout


def qemu_checked_by(*tests: str) -> pytest.MarkDecorator:
    """This contract test runs on the fake engine only: on QEMU, ``tests`` (under tests/integration) check all of it.

    Each named test makes every assertion of the contract test on a real VM and
    more, so running the contract's QEMU variant as well would boot or fork the
    same VMs for the same answer. Name the tests so a reader can check the claim.
    """
    assert tests and all(test.startswith("tests/integration/") and "::test_" in test for test in tests)
    return pytest.mark.parametrize("engine_name", ["fake"], indirect=True)
