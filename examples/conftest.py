"""Fixtures of the example suite: a project prepared once in the parent VM, and the agent."""

from __future__ import annotations

import pytest
from agent import Agent

#: A tiny project with a bug (add subtracts); the fan-out test lets the agent fix it.
CALC_PY = "def add(a, b):\n    return a - b\n"
CHECK_PY = (
    "from calc import add\n"
    "cases = [((1, 2), 3), ((2, 2), 4), ((0, 5), 5), ((-1, 1), 0)]\n"
    "print(sum(add(*args) == want for args, want in cases))\n"
)


@pytest.fixture(scope="session", autouse=True)
def project_in_parent(forkd_parent):
    """Put the project into the parent VM once; every test's VM is a child of this state."""
    forkd_parent.exec(["mkdir", "-p", "/srv/project"], check=True)
    forkd_parent.write_file("/srv/project/calc.py", CALC_PY)
    forkd_parent.write_file("/srv/project/check.py", CHECK_PY)
    forkd_parent.write_file("/srv/project/README", "a calculator\n")


@pytest.fixture
def agent(forkd_vm):
    return Agent(forkd_vm)
