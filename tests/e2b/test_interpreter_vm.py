"""The code interpreter in a real VM: the guest's own python3, state across cells, and across a fork.

A root VM of the default image is booted once and frozen; the test runs in a
copy-on-write child of it, as a sandbox does. The guest program is copied in
on first use (the image does not have it), runs under Debian's python3, and
its contexts live on in a VM forked from the sandbox: the fork's new
:class:`CodeInterpreter` finds them in the guest's registry and attaches to
their processes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from pytest_forkd.aio import AsyncVM
from pytest_forkd.core.factory import VMFactory
from pytest_forkd.core.vm import VM
from pytest_forkd.e2b.interpreter import GUEST_DIR, CodeInterpreter
from pytest_forkd.storage.snapshot import Snapshot

pytestmark = pytest.mark.vm

#: Lists the guest's code interpreter processes (their command lines name the program).
LIST_INTERPRETERS = (
    "import os\n"
    "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
    "    try:\n"
    "        line = open(f'/proc/{pid}/cmdline', 'rb').read().replace(b'\\0', b' ').decode()\n"
    "    except OSError:\n"
    "        continue\n"
    "    if '/interpreter-' in line and 'LIST_INTERPRETERS' not in line:\n"
    "        print(pid, line)\n"
    "# LIST_INTERPRETERS"
)


@pytest.fixture(scope="module")
def factory() -> Iterator[VMFactory]:
    made = VMFactory(accel=os.environ.get("PYTEST_FORKD_ACCEL", "auto"))
    yield made
    made.close()


@pytest.fixture(scope="module")
def base_snapshot(factory: VMFactory) -> Snapshot:
    """The default image booted once and frozen, as the ``base`` snapshot is made."""
    return factory.boot().freeze("e2b-interpreter-base", keep_running=False)


@pytest.fixture
def vm(base_snapshot: Snapshot) -> Iterator[VM]:
    child = base_snapshot.fork(1)[0]
    yield child
    child.close()


async def run(interpreter: CodeInterpreter, code: str, **options: Any) -> list[dict[str, Any]]:
    return [line async for line in interpreter.execute(code, **options)]


def text(lines: list[dict[str, Any]]) -> str | None:
    main = [line for line in lines if line["type"] == "result" and line["is_main_result"]]
    return main[0].get("text") if main else None


async def interpreter_processes(vm: AsyncVM) -> str:
    return (await vm.exec(["python3", "-c", LIST_INTERPRETERS], check=True)).stdout


@pytest.mark.asyncio
async def test_state_errors_and_forks_in_a_real_guest(vm: VM) -> None:
    sandbox = AsyncVM(vm)
    assert (await sandbox.exec(["ls", GUEST_DIR])).exit_code != 0  # not in the image: copied in on first use
    interpreter = CodeInterpreter(sandbox)
    assert (await run(interpreter, "x = 1"))[-1] == {"type": "end_of_execution"}
    lines = await run(interpreter, "import sys\nprint(sys.version_info[:2])\nx")
    assert text(lines) == "1"
    assert [line["text"] for line in lines if line["type"] == "stdout"] == ["(3, 11)\n"]  # Debian bookworm's python3
    (error,) = [line for line in await run(interpreter, "1/0") if line["type"] == "error"]
    assert (error["name"], error["value"]) == ("ZeroDivisionError", "division by zero")
    assert "1/0" in error["traceback"]

    (copy,) = await sandbox.fork(1)  # a branch of the running sandbox, and a child of it
    try:
        in_copy = CodeInterpreter(copy)
        seen = await run(in_copy, "x")
        assert text(seen) == "1" and seen[0]["execution_count"] == 4  # the same process, carried over
        await run(in_copy, "x = 2")
        assert text(await run(in_copy, "x")) == "2"
        assert text(await run(interpreter, "x")) == "1"  # the copy's change never reaches the sandbox
        await in_copy.close()
        assert await interpreter_processes(copy) == ""
    finally:
        await copy.close()

    assert text(await run(interpreter, "x + 1")) == "2"
    await interpreter.close()
    assert await interpreter_processes(sandbox) == ""
    assert vm.processes() == []


@pytest.mark.asyncio
async def test_contexts_survive_a_pause_and_resume_even_mid_cell(vm: VM) -> None:
    sandbox = AsyncVM(vm)
    interpreter = CodeInterpreter(sandbox)
    made = await interpreter.create_context()
    await run(interpreter, "kept = 'in the named context'", context_id=made["id"])
    await run(interpreter, "z = 3")
    before = [context["id"] for context in await interpreter.list_contexts()]
    stream = interpreter.execute("import time\nprint('napping', flush=True)\ntime.sleep(600)", context_id=made["id"])
    assert (await stream.__anext__())["type"] == "number_of_executions"
    assert (await stream.__anext__())["text"] == "napping\n"
    snapshot = await sandbox.branch()  # the pause: the whole guest, the napping cell included, into the store
    await stream.aclose()
    await sandbox.close()  # and no VM left
    await interpreter.close()  # nothing left to end, and no error for that

    (resumed,) = await snapshot.fork(1)
    try:
        again = CodeInterpreter(resumed)
        assert [context["id"] for context in await again.list_contexts()] == before
        lines = await run(again, "kept", context_id=made["id"])  # the nap is interrupted first
        assert text(lines) == "in the named context" and lines[0]["execution_count"] == 3
        assert text(await run(again, "z")) == "3"
        await again.close()
        assert await interpreter_processes(resumed) == ""
    finally:
        await resumed.close()


@pytest.mark.asyncio
async def test_an_image_without_python_runs_its_contexts_on_forkds_runtime(
    factory: VMFactory, busybox_image: str
) -> None:
    vm = factory.boot(busybox_image)  # busybox only: no libc, no python
    try:
        sandbox = AsyncVM(vm)
        probe = await sandbox.exec("command -v python3 || echo none")
        assert probe.stdout.split() == ["none"]
        interpreter = CodeInterpreter(sandbox)
        lines = await run(interpreter, "import sys\nx = 6\nprint(sys.executable)\nx * 7")
        assert text(lines) == "42"
        (printed,) = [line["text"] for line in lines if line["type"] == "stdout"]
        assert printed.startswith("/.forkd/")  # forkd's own interpreter, mounted beside the image
        assert text(await run(interpreter, "x")) == "6"
        await interpreter.close()
        assert vm.processes() == []
    finally:
        vm.close()
