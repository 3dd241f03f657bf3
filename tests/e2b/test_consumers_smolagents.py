"""smolagents' ``E2BExecutor``, unchanged, running a CodeAgent's code through to its final answer.

smolagents runs from a virtualenv of its own (``smolagents[e2b]``, with the
suite's e2b and e2b-code-interpreter versions; installed from PyPI on first
use and cached: consumers_env). A scripted model stands in for the LLM; the
code it writes runs through the executor's real path: the code interpreter
SDK's ``run_code`` in a sandbox of template ``code-interpreter-v1``, its
tools' source first, an error that comes back as an observation, and the
final answer that arrives as a ``FinalAnswerException`` (a BaseException) the
cell raises.

The executor's first cell imports numpy and PIL (smolagents lifts them out of
its ``final_answer`` tool), as E2B's own code-interpreter template has them:
the server here has no mapping and no forkd.yaml, so ``code-interpreter-v1``
is forkd's own code-interpreter image (numpy and Pillow from Debian), built
on first use and cached as the default image is.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

for module in ("e2b_code_interpreter", "starlette", "uvicorn", "python_multipart"):
    pytest.importorskip(module, reason="needs the e2b extra: pip install 'pytest-forkd[e2b]'")

from consumers_env import installed_version, python_env  # noqa: E402
from consumers_server import consumer_environment, e2b_server, run_consumer  # noqa: E402
from support import wait_until_dead  # noqa: E402

from pytest_forkd.e2b.server import E2BServer  # noqa: E402

pytestmark = pytest.mark.vm

SMOLAGENTS = "smolagents[e2b]==1.26.0"
SCRIPT = Path(__file__).with_name("consumers_smolagents_run.py")
CODE_INTERPRETER = "code-interpreter-v1"


def requirements() -> list[str]:
    """smolagents with the E2B SDK versions this suite tests (the newest, when the suite has none)."""
    pins = [f"{name}=={installed_version(name)}" for name in ("e2b", "e2b-code-interpreter") if installed_version(name)]
    return [SMOLAGENTS, *pins]


@pytest.fixture(scope="module")
def server() -> Iterator[E2BServer]:
    """The file's server, with no template mapping: ``code-interpreter-v1`` is made ready before any create."""
    with e2b_server() as server:
        server.warm(CODE_INTERPRETER)  # a first build on a machine may outlast the SDK's 60 s request timeout
        yield server


def test_a_code_agent_reaches_its_final_answer_through_e2b_executor(server: E2BServer, tmp_path: Path) -> None:
    python = python_env("smolagents-e2b", requirements())
    pids: list[int] = []

    def look_inside(result: dict[str, Any]) -> None:
        vm = server.vm(result["sandbox_id"])
        pids.append(vm.machine.pid)
        assert vm.read_file("/tmp/smolagents-primes.txt") == b"2 3 5 7 11 13 17 19 23 29"  # the first cell's file

    out = run_consumer(
        [str(python), str(SCRIPT)], consumer_environment(server.environment), tmp_path, inspect=look_inside
    )

    assert out["versions"]["smolagents"] == "1.26.0"
    assert out["answer"] == {"primes": [2, 3, 5, 7, 11, 13, 17, 19, 23, 29], "total": 129}
    assert "found 10 primes on Linux" in out["observations"][1]  # the first cell's stdout, as the agent saw it
    [error] = out["errors"]  # the second cell's IndexError, by name, value and traceback
    assert "IndexError\nlist index out of range\n" in error and "print(primes[100])" in error
    assert server.sandbox_ids() == []  # the agent's cleanup killed the sandbox
    assert pids and wait_until_dead(pids[0])
