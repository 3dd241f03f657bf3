"""Fixtures of the example suite: a project prepared once in the parent VM, and the agent."""

from __future__ import annotations

import inspect

import pytest
from agent import Agent
from repo_agent import FILES, REPO

#: A tiny project with a bug (add subtracts); the fan-out test lets the agent fix it.
CALC_PY = "def add(a, b):\n    return a - b\n"
CHECK_PY = (
    "from calc import add\n"
    "cases = [((1, 2), 3), ((2, 2), 4), ((0, 5), 5), ((-1, 1), 0)]\n"
    "print(sum(add(*args) == want for args, want in cases))\n"
)


#: pytest-asyncio's ini key that pytest.ini sets (see pytest_addoption).
ASYNCIO_LOOP_SCOPE_KEY = "asyncio_default_fixture_loop_scope"


def pytest_addoption(parser, pluginmanager):
    """Declare pytest-asyncio's key where it is not installed, so that pytest.ini setting it is no unknown option."""
    if not pluginmanager.hasplugin("asyncio"):
        parser.addini(ASYNCIO_LOOP_SCOPE_KEY, "pytest-asyncio's; unused here, pytest-asyncio is not installed")


@pytest.fixture(scope="session", autouse=True)
def project_in_parent(forkd_parent):
    """Put the project into the parent VM once; every test's VM is a child of this state."""
    forkd_parent.exec(["mkdir", "-p", "/srv/project"], check=True)
    forkd_parent.write_file("/srv/project/calc.py", CALC_PY)
    forkd_parent.write_file("/srv/project/check.py", CHECK_PY)
    forkd_parent.write_file("/srv/project/README", "a calculator\n")
    # The repository the scripted coding agent of test_repo_agent.py edits.
    forkd_parent.exec(["mkdir", "-p", REPO], check=True)
    for name, text in FILES.items():
        forkd_parent.write_file(f"{REPO}/{name}", text, mode=0o644)


@pytest.fixture
def agent(forkd_vm):
    return Agent(forkd_vm)


# -- the asyncio suite (test_async_agent.py) runs under pytest-asyncio and under anyio ----------------


@pytest.fixture
def anyio_backend(request):
    """None: the test runs under pytest-asyncio; "asyncio": under anyio's plugin (see below)."""
    return getattr(request, "param", None)


def pytest_generate_tests(metafunc):
    """Run each ``async def`` test that uses ``anyio_backend`` once per async plugin that is loaded."""
    if not inspect.iscoroutinefunction(metafunc.function) or "anyio_backend" not in metafunc.fixturenames:
        return
    runners = []
    if metafunc.config.pluginmanager.hasplugin("asyncio"):
        runners.append(pytest.param(None, marks=pytest.mark.asyncio, id="pytest-asyncio"))
    if metafunc.config.pluginmanager.hasplugin("anyio"):
        runners.append(pytest.param("asyncio", marks=pytest.mark.anyio, id="anyio"))
    if not runners:
        runners.append(
            pytest.param(None, marks=pytest.mark.skip(reason="needs pytest-asyncio or anyio"), id="no-async-plugin")
        )
    metafunc.parametrize("anyio_backend", runners, indirect=True)
