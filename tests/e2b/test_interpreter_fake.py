"""CodeInterpreter through the whole VM API on the fake engine: the real agent spawns the real guest program.

No QEMU: the fake engine's guest is the real agent as a host process, so
spawning, attaching, stdin, signals and the agent's output buffering are all
real, and the program runs under the host's Python. Each test gets a private
guest directory for the program and the registry. What needs a real guest
(forks carrying the processes) is tests/e2b/test_interpreter_vm.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from pytest_forkd.aio import AsyncVM
from pytest_forkd.core.factory import VMFactory
from pytest_forkd.core.vm import VM
from pytest_forkd.e2b import interpreter as interpreter_module
from pytest_forkd.e2b.interpreter import CodeInterpreter, InterpreterError, UnknownContext, UnsupportedLanguage
from pytest_forkd.e2b.interpreter_channel import is_interpreter_command
from pytest_forkd.errors import InvalidArgument


@pytest.fixture
def vm() -> Iterator[VM]:
    factory = VMFactory(engine="fake")
    try:
        yield factory.boot()
    finally:
        factory.close()


@pytest_asyncio.fixture
async def interpreter(vm: VM, tmp_path: Path) -> AsyncIterator[CodeInterpreter]:
    made = CodeInterpreter(AsyncVM(vm), directory=str(tmp_path / "e2b"))
    yield made
    await made.close()


async def run(interpreter: CodeInterpreter, code: str, **options: Any) -> list[dict[str, Any]]:
    return [line async for line in interpreter.execute(code, **options)]


def text(lines: list[dict[str, Any]]) -> str | None:
    main = [line for line in lines if line["type"] == "result" and line["is_main_result"]]
    return main[0].get("text") if main else None


def error(lines: list[dict[str, Any]]) -> dict[str, Any]:
    (found,) = [line for line in lines if line["type"] == "error"]
    return found


def interpreter_pids(vm: VM) -> list[int]:
    return [process.pid for process in vm.processes() if is_interpreter_command(process.command)]


@pytest.mark.asyncio
async def test_cells_keep_state_and_end_with_the_end_line(interpreter: CodeInterpreter) -> None:
    first = await run(interpreter, "x = 41")
    assert [line["type"] for line in first] == ["number_of_executions", "end_of_execution"]
    second = await run(interpreter, "x += 1; print('x is', x); x")
    assert [line["type"] for line in second] == ["number_of_executions", "stdout", "result", "end_of_execution"]
    assert second[0] == {"type": "number_of_executions", "execution_count": 2}
    assert second[1]["text"] == "x is 42\n" and text(second) == "42"
    assert all("cell" not in line for line in first + second)  # the protocol's own fields stay inside
    assert error(await run(interpreter, "1/0"))["name"] == "ZeroDivisionError"


@pytest.mark.asyncio
async def test_the_stream_parses_into_the_official_clients_execution(interpreter: CodeInterpreter) -> None:
    models = pytest.importorskip("e2b_code_interpreter.models")
    execution = models.Execution()
    for line in await run(interpreter, "import sys\nprint('hello')\nprint('oops', file=sys.stderr)\n'done'"):
        models.parse_output(execution, json.dumps(line))  # as the server writes each line
    assert execution.text == "done" and execution.logs.stdout == ["hello\n"] and execution.logs.stderr == ["oops\n"]
    assert execution.error is None and execution.execution_count == 1


@pytest.mark.asyncio
async def test_contexts_are_created_listed_restarted_and_removed(interpreter: CodeInterpreter, tmp_path: Path) -> None:
    made = await interpreter.create_context(cwd=str(tmp_path))
    assert made["language"] == "python" and made["cwd"] == str(tmp_path)
    listed = await interpreter.list_contexts()
    assert [context["id"] for context in listed][-1] == made["id"]  # the default one first, as E2B lists it
    assert len(listed) == 2 and listed[0]["language"] == "python"
    await run(interpreter, "x = 1", context_id=made["id"])
    assert error(await run(interpreter, "x"))["name"] == "NameError"  # the default context is another one
    assert text(await run(interpreter, "import os; os.getcwd()", context_id=made["id"])) == str(tmp_path)
    await interpreter.restart_context(made["id"])
    assert error(await run(interpreter, "x", context_id=made["id"]))["value"] == "name 'x' is not defined"
    await interpreter.remove_context(made["id"])
    assert made["id"] not in [context["id"] for context in await interpreter.list_contexts()]
    with pytest.raises(UnknownContext, match=made["id"]):
        await run(interpreter, "1", context_id=made["id"])
    for call in (interpreter.restart_context, interpreter.remove_context):
        with pytest.raises(UnknownContext, match="not-a-context"):
            await call("not-a-context")


@pytest.mark.asyncio
async def test_bad_requests_are_refused_before_any_line(interpreter: CodeInterpreter, tmp_path: Path) -> None:
    with pytest.raises(UnsupportedLanguage, match="'javascript' is not supported"):
        await run(interpreter, "console.log(1)", language="js")
    with pytest.raises(UnsupportedLanguage, match="'r'"):
        await interpreter.create_context(language="R")
    with pytest.raises(InvalidArgument, match="Only one of context_id or language"):
        await run(interpreter, "1", context_id="a", language="python")
    with pytest.raises(InvalidArgument, match="env_vars"):
        await run(interpreter, "1", env_vars={"A=B": "c"})
    with pytest.raises(InvalidArgument, match="timeout_s"):
        await run(interpreter, "1", timeout_s=0)
    with pytest.raises(InvalidArgument, match="missing"):
        await interpreter.create_context(cwd=str(tmp_path / "missing"))
    assert text(await run(interpreter, "'still fine'", language="Python")) == "still fine"


@pytest.mark.asyncio
async def test_env_vars_hold_for_one_execution(interpreter: CodeInterpreter) -> None:
    assert text(await run(interpreter, "import os; os.getenv('FOO')", env_vars={"FOO": "bar"})) == "bar"
    assert text(await run(interpreter, "os.getenv('FOO', 'default')")) == "default"


@pytest.mark.asyncio
async def test_a_timeout_interrupts_the_cell_and_keeps_the_state(interpreter: CodeInterpreter) -> None:
    await run(interpreter, "kept = 'yes'")
    lines = await run(interpreter, "import time\nprint('started', flush=True)\ntime.sleep(60)", timeout_s=0.5)
    assert [line["type"] for line in lines] == ["number_of_executions", "stdout", "error", "end_of_execution"]
    timed_out = error(lines)
    assert timed_out["name"] == "TimeoutError" and "timed out after 0.5 s: it was interrupted" in timed_out["value"]
    assert "time.sleep(60)" in timed_out["traceback"]
    assert text(await run(interpreter, "kept")) == "yes"


@pytest.mark.asyncio
async def test_a_cell_that_ignores_the_interrupt_costs_its_context(
    interpreter: CodeInterpreter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(interpreter_module, "INTERRUPT_GRACE_S", 0.3)
    monkeypatch.setattr(interpreter_module, "INTERRUPT_REPEAT_S", 0.1)
    # SIGINT is ignored from this cell on, so the next one ignores the interrupt however early it comes.
    await run(interpreter, "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nlost = True")
    lines = await run(interpreter, "import time\ntime.sleep(60)", timeout_s=0.1)
    assert "its context was restarted without its state" in error(lines)["value"]
    assert lines[-1] == {"type": "end_of_execution"}
    assert error(await run(interpreter, "lost"))["name"] == "NameError"
    assert text(await run(interpreter, "'usable'")) == "usable"


@pytest.mark.asyncio
async def test_a_client_that_goes_away_interrupts_its_cell(interpreter: CodeInterpreter) -> None:
    await run(interpreter, "kept = 1")
    stream = interpreter.execute("import time\nprint('started', flush=True)\ntime.sleep(60)\nkept = 2")
    assert (await stream.__anext__())["type"] == "number_of_executions"
    assert (await stream.__anext__())["text"] == "started\n"
    await stream.aclose()  # the HTTP client disconnected
    lines = await asyncio.wait_for(run(interpreter, "kept"), 60)  # waits for the interrupt to settle
    assert text(lines) == "1" and lines[0]["execution_count"] == 3


@pytest.mark.asyncio
async def test_a_client_that_stops_at_the_last_line_costs_nothing(interpreter: CodeInterpreter) -> None:
    stream = interpreter.execute("kept = 5; kept")
    async for line in stream:
        if line["type"] == "end_of_execution":
            break  # the server wrote the last line and never asked for more
    await stream.aclose()
    lines = await run(interpreter, "kept")
    assert text(lines) == "5" and lines[0]["execution_count"] == 2  # not interrupted, not restarted


@pytest.mark.asyncio
async def test_keepalive_lines_fill_long_silences(
    interpreter: CodeInterpreter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(interpreter_module, "KEEPALIVE_S", 0.05)
    lines = await run(interpreter, "import time; time.sleep(0.15); 'awake'")
    assert {"type": "keepalive"} in lines and text(lines) == "awake"


@pytest.mark.asyncio
async def test_a_restart_ends_a_running_cell_with_an_error(interpreter: CodeInterpreter) -> None:
    made = await interpreter.create_context()
    stream = interpreter.execute("import time\nprint('go', flush=True)\ntime.sleep(60)", context_id=made["id"])
    lines = [await stream.__anext__(), await stream.__anext__()]
    restart = asyncio.ensure_future(interpreter.restart_context(made["id"]))
    lines += [line async for line in stream]
    await asyncio.wait_for(restart, 60)
    assert error(lines) == {
        "type": "error",
        "name": "ContextRestarting",
        "value": "Context was restarted",
        "traceback": "",
    }
    assert text(await run(interpreter, "'after'", context_id=made["id"])) == "after"


@pytest.mark.asyncio
async def test_a_context_whose_process_died_starts_anew(interpreter: CodeInterpreter) -> None:
    await run(interpreter, "lost = 1")
    ended = error(await run(interpreter, "import os; os._exit(7)"))
    assert ended["name"] == "UnexpectedEndOfExecution" and "status 7" in ended["value"]
    assert error(await run(interpreter, "lost"))["name"] == "NameError"


@pytest.mark.asyncio
async def test_output_larger_than_every_window_arrives_whole(interpreter: CodeInterpreter) -> None:
    lines = await run(interpreter, "import sys\nfor i in range(160):\n    sys.stdout.write(str(i % 10) * 65536)")
    written = "".join(line["text"] for line in lines if line["type"] == "stdout")
    assert len(written) == 160 * 65536 and written == "".join(str(i % 10) * 65536 for i in range(160))


@pytest.mark.asyncio
async def test_a_new_interpreter_on_the_vm_finds_its_contexts(vm: VM, tmp_path: Path) -> None:
    directory = str(tmp_path / "e2b")
    first = CodeInterpreter(AsyncVM(vm), directory=directory)
    await run(first, "shared = 'from the first'")
    made = await first.create_context()
    registry = json.loads((tmp_path / "e2b" / "contexts.json").read_text())
    assert {context["id"] for context in registry["contexts"]} == {made["id"], registry["defaults"]["python"]}
    again = CodeInterpreter(AsyncVM(vm), directory=directory)  # the first one is dropped, not closed
    assert [context["id"] for context in await again.list_contexts()] == [registry["defaults"]["python"], made["id"]]
    lines = await run(again, "shared")
    assert text(lines) == "from the first" and lines[0]["execution_count"] == 2
    await again.close()
    assert interpreter_pids(vm) == []
    assert json.loads((tmp_path / "e2b" / "contexts.json").read_text())["contexts"] == []
    with pytest.raises(InterpreterError, match="closed"):
        await run(again, "1")


@pytest.mark.asyncio
async def test_a_hostile_registry_is_ignored(vm: VM, tmp_path: Path) -> None:
    directory = tmp_path / "e2b"
    directory.mkdir()
    for content in (
        '{"format": 1, "contexts": [{"id": 5}, "x", {"id": "a", "language": "cobol"}], "python": ["sh"]}',
        "[]",
        "not json",
    ):
        (directory / "contexts.json").write_text(content)
        interpreter = CodeInterpreter(AsyncVM(vm), directory=str(directory))
        try:
            assert [context["language"] for context in await interpreter.list_contexts()] == ["python"]
            assert text(await run(interpreter, "6 * 7")) == "42"
        finally:
            await interpreter.close()


@pytest.mark.asyncio
async def test_close_leaves_no_interpreter_process(vm: VM, interpreter: CodeInterpreter) -> None:
    await interpreter.create_context()
    await run(interpreter, "1")
    assert len(interpreter_pids(vm)) == 2
    await interpreter.close()
    assert interpreter_pids(vm) == [] and vm.processes() == []
