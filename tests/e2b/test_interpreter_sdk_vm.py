"""``run_code`` of the official ``e2b-code-interpreter`` SDK, unchanged, against forkd_e2b: real VMs.

The SDK speaks to the server's code interpreter routes, which run the cells in
the sandbox's guest through :class:`~pytest_forkd.e2b.interpreter.CodeInterpreter`:
state between calls, errors by name, contexts, a client that gives up on a
long cell, and the state carried by ``fork`` and by ``pause`` and ``connect``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

pytest.importorskip("e2b_code_interpreter")
from e2b import TimeoutException  # noqa: E402
from e2b_code_interpreter import Sandbox  # noqa: E402

if TYPE_CHECKING:
    from pytest_forkd.plugin.e2b import ForkdE2B

pytestmark = pytest.mark.vm


def test_run_code_keeps_state_reports_errors_and_survives_fork_and_pause(forkd_e2b: ForkdE2B) -> None:
    sandbox = Sandbox.create()
    sandbox.run_code("x = 1")
    execution = sandbox.run_code("x += 1; print('hi'); x")
    assert (execution.text, execution.logs.stdout, execution.error) == ("2", ["hi\n"], None)
    failed = sandbox.run_code("1/0")
    assert failed.error is not None and (failed.error.name, failed.error.value) == (
        "ZeroDivisionError",
        "division by zero",
    )

    context = sandbox.create_code_context()
    assert context.id in [item.id for item in sandbox.list_code_contexts()]
    missing = sandbox.run_code("x", context=context)
    assert missing.error is not None and missing.error.value == "name 'x' is not defined"

    (copy,) = sandbox.fork(count=1)
    assert copy.run_code("x").text == "2"
    copy.run_code("x = 100")
    assert (copy.run_code("x").text, sandbox.run_code("x").text) == ("100", "2")
    copy.kill()

    sandbox.pause()
    resumed = Sandbox.connect(sandbox.sandbox_id)
    assert resumed.run_code("x").text == "2"
    resumed.kill()


def test_a_client_timeout_interrupts_the_cell(forkd_e2b: ForkdE2B) -> None:
    sandbox = Sandbox.create()
    sandbox.run_code("kept = 'yes'")
    with pytest.raises(TimeoutException):
        sandbox.run_code("import time; time.sleep(300)", timeout=5)
    after = sandbox.run_code("kept", timeout=120)  # the abandoned cell was interrupted, not waited for
    assert after.text == "yes" and after.execution_count == 3
    sandbox.kill()
