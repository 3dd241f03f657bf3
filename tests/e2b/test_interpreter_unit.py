"""The code interpreter's guest program, run on the host: one persistent Python context per process.

No VM: the program is plain Python over its stdin and stdout, so these tests
start it as a host subprocess and speak its line protocol, as the host's
:class:`~pytest_forkd.e2b.interpreter.CodeInterpreter` does. Its lines are
E2B's ``/execute`` lines, and they are checked with the official client's own
parser (``e2b_code_interpreter.models.parse_output``): the SDK's ``Execution``,
``Result``, ``Logs`` and ``ExecutionError`` must come out right.
"""

from __future__ import annotations

import base64
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_forkd.guest import interpreter as guest_program
from pytest_forkd.guest import interpreter_program
from pytest_forkd.waiting import poll_until

PROGRAM = interpreter_program()


class GuestContext:
    """The guest program as a host subprocess, driven as the host drives it (requests in, lines out, credit)."""

    def __init__(self, *arguments: str, cwd: str | None = None, env: dict[str, str] | None = None) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(PROGRAM), *arguments],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=env,
            start_new_session=True,  # as the guest agent starts it: SIGINT goes to its own group
        )
        self._lines: queue.Queue[tuple[dict[str, Any], int] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = self.next()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            self._lines.put((json.loads(raw), len(raw)))
        self._lines.put(None)

    def send(self, message: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(message).encode() + b"\n")
        self.process.stdin.flush()

    def next(self, timeout: float = 30, *, credit: bool = True) -> dict[str, Any]:
        item = self._lines.get(timeout=timeout)
        if item is None:
            raise EOFError(f"the context exited: {self.stderr()}")
        message, size = item
        if credit and message["type"] in guest_program.DATA_TYPES:
            self.send({"op": "credit", "bytes": size})
        return message

    def start(self, code: str, env: dict[str, str] | None = None) -> str:
        cell = uuid.uuid4().hex
        self.send({"op": "execute", "cell": cell, "code": code, **({"env": env} if env else {})})
        return cell

    def until_done(self, cell: str, timeout: float = 30) -> list[dict[str, Any]]:
        lines = []
        while True:
            message = self.next(timeout)
            assert message.get("cell") == cell, message
            lines.append(message)
            if message["type"] == "done":
                return lines

    def run(self, code: str, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
        return self.until_done(self.start(code, env))

    def interrupt(self) -> None:
        os.killpg(self.process.pid, signal.SIGINT)  # as GuestProcess.kill(SIGINT): the whole group

    def stderr(self) -> str:
        if self.process.poll() is None:
            return ""
        assert self.process.stderr is not None
        return self.process.stderr.read().decode(errors="replace")

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def context(tmp_path: Path) -> Iterator[GuestContext]:
    started = GuestContext("--default-cwd", str(tmp_path))
    yield started
    started.close()


def kinds(lines: list[dict[str, Any]]) -> list[str]:
    return [line["type"] for line in lines]


def of_type(lines: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [line for line in lines if line["type"] == kind]


def results(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return of_type(lines, "result")


def main_text(lines: list[dict[str, Any]]) -> str | None:
    main = [line for line in results(lines) if line["is_main_result"]]
    assert len(main) <= 1
    return main[0].get("text") if main else None


# -- start ---------------------------------------------------------------------------------------


def test_ready_names_the_protocol_the_process_and_its_working_directory(context: GuestContext, tmp_path: Path) -> None:
    ready = context.ready
    assert ready["type"] == "ready" and "error" not in ready
    assert ready["protocol"] == guest_program.PROTOCOL
    assert ready["pid"] == context.process.pid
    assert ready["python"] == ".".join(map(str, sys.version_info[:3]))
    assert ready["cwd"] == str(tmp_path)


def test_a_missing_working_directory_is_refused_and_the_default_one_falls_back(tmp_path: Path) -> None:
    refused = GuestContext("--cwd", str(tmp_path / "missing"))
    try:
        assert refused.ready["reason"] == "cwd" and "missing" in refused.ready["error"]
        assert refused.process.wait(timeout=30) == 2
    finally:
        refused.close()
    fallback = GuestContext("--default-cwd", str(tmp_path / "missing"), cwd=str(tmp_path))
    try:
        assert "error" not in fallback.ready and fallback.ready["cwd"] == str(tmp_path)
    finally:
        fallback.close()


# -- state and results ---------------------------------------------------------------------------


def test_state_lives_on_between_cells(context: GuestContext) -> None:
    assert kinds(context.run("x = 1\nimport json\ndef double(v):\n    return 2 * v")) == [
        "number_of_executions",
        "done",
    ]
    assert main_text(context.run("x += 1; x")) == "2"
    assert main_text(context.run("json.dumps({'x': double(x)})")) == '{"x": 4}'


def test_the_last_expression_is_the_result_and_nothing_else_is(context: GuestContext) -> None:
    assert main_text(context.run("1 + 1")) == "2"
    assert results(context.run("y = 3")) == []  # an assignment shows nothing
    assert results(context.run("None")) == []
    assert results(context.run("y;")) == []  # IPython: a trailing semicolon hides the result
    assert main_text(context.run("y; # comment after it\ny * 2")) == "6"
    assert main_text(context.run("[y, 'a']")) == "[3, 'a']"
    assert main_text(context.run("'text'")) == "text"  # E2B's server drops a string result's quotes
    assert main_text(context.run("_")) == "text"  # `_` is the last result
    assert main_text(context.run("{'b': 2, 'a': 1}")) == "{'b': 2, 'a': 1}"  # insertion order, as IPython
    assert main_text(context.run("list(range(30))")).splitlines()[:2] == ["[0,", " 1,"]  # wrapped at 79
    line = results(context.run("7"))[0]
    assert line["is_main_result"] is True and line["extra"] == {}


def test_a_cell_indented_as_a_whole_runs_as_ipython_dedents_it(context: GuestContext) -> None:
    assert main_text(context.run("\n    a = 5\n    if a:\n        a += 1\n    a\n    ")) == "6"


def test_rich_representations_come_with_the_text(context: GuestContext) -> None:
    code = (
        "class Rich:\n"
        "    def _repr_html_(self): return '<b>rich</b>'\n"
        "    def _repr_markdown_(self): return '**rich**'\n"
        "    def _repr_json_(self): return {'rich': True}\n"
        "    def _repr_png_(self): return b'\\x89PNG-bytes'\n"
        "    def _repr_latex_(self): return ('$r$', {'meta': 1})\n"
        "    def _repr_svg_(self): return None\n"
        "    def __repr__(self): return 'Rich()'\n"
        "Rich()"
    )
    (line,) = results(context.run(code))
    assert line["text"] == "Rich()"
    assert line["html"] == "<b>rich</b>" and line["markdown"] == "**rich**"
    assert line["json"] == {"rich": True}
    assert base64.b64decode(line["png"]) == b"\x89PNG-bytes"
    assert line["latex"] == "$r$"  # (data, metadata): the data
    assert "svg" not in line  # a method that returns None gives no format


def test_a_mime_bundle_and_unknown_types_land_in_their_fields(context: GuestContext) -> None:
    code = (
        "class Bundle:\n"
        "    def _repr_mimebundle_(self, include=None, exclude=None):\n"
        "        return {'text/plain': 'plain', 'text/html': '<i>b</i>', 'application/x-custom': 'c'}\n"
        "Bundle()"
    )
    (line,) = results(context.run(code))
    assert (line["text"], line["html"], line["extra"]) == ("plain", "<i>b</i>", {"application/x-custom": "c"})


def test_a_broken_formatter_goes_to_stderr_and_the_other_formats_still_show(context: GuestContext) -> None:
    code = "class Half:\n    def _repr_html_(self): raise ValueError('no html')\n    def __repr__(self): return 'Half'\nHalf()"
    lines = context.run(code)
    assert main_text(lines) == "Half" and "html" not in results(lines)[0]
    assert "ValueError: no html" in "".join(line["text"] for line in of_type(lines, "stderr"))
    assert of_type(lines, "error") == []


def test_display_shows_results_that_are_not_the_cells_own(context: GuestContext) -> None:
    lines = context.run("print('before')\ndisplay(1, 'two')\ndisplay({'text/latex': 'x'}, raw=True)\n3")
    assert kinds(lines) == ["number_of_executions", "stdout", "result", "result", "result", "result", "done"]
    shown = results(lines)
    assert [(line.get("text"), line["is_main_result"]) for line in shown] == [
        ("1", False),
        ("two", False),
        (None, False),
        ("3", True),
    ]
    assert shown[2]["latex"] == "x"


def test_top_level_await_runs(context: GuestContext) -> None:
    assert (
        main_text(context.run("import asyncio\nawait asyncio.sleep(0)\nawait asyncio.sleep(0, result=41) + 1")) == "42"
    )


def test_execution_count_counts_every_cell_failed_ones_too(context: GuestContext) -> None:
    counts = []
    for code in ("1", "1/0", "def broken(:", "2"):
        lines = context.run(code)
        (started,) = of_type(lines, "number_of_executions")
        assert lines[-1]["execution_count"] == started["execution_count"]
        counts.append(started["execution_count"])
    assert counts == [1, 2, 3, 4]


# -- output ----------------------------------------------------------------------------------------


def test_stdout_and_stderr_keep_their_order_and_prints_of_one_stream_join(context: GuestContext) -> None:
    lines = context.run(
        "import sys\nprint('a'); print('b')\nprint('c', file=sys.stderr)\nprint('d')\nsys.stderr.write('e')\n'end'"
    )
    assert [(line["type"], line.get("text")) for line in lines[1:-1]] == [
        ("stdout", "a\nb\n"),
        ("stderr", "c\n"),
        ("stdout", "d\n"),
        ("stderr", "e"),
        ("result", "end"),
    ]
    assert all(line["timestamp"].endswith("+00:00") for line in lines if line["type"] in ("stdout", "stderr"))


def test_output_of_subprocesses_and_of_the_descriptors_is_captured(context: GuestContext) -> None:
    lines = context.run(
        "import os, subprocess, sys\n"
        "os.write(1, b'fd one\\n')\n"
        "subprocess.run([sys.executable, '-c', 'import sys; print(\"child out\"); print(\"child err\", file=sys.stderr)'])\n"
        "os.system('echo from shell')"
    )
    stdout = "".join(line["text"] for line in of_type(lines, "stdout"))
    stderr = "".join(line["text"] for line in of_type(lines, "stderr"))
    assert stdout == "fd one\nchild out\nfrom shell\n"
    assert stderr == "child err\n"
    assert main_text(lines) == "0"


def test_output_streams_while_the_cell_still_runs(context: GuestContext, tmp_path: Path) -> None:
    go_on = tmp_path / "go-on"
    cell = context.start(
        "import os, sys, time\n"
        "print('first', flush=True)\n"
        f"while not os.path.exists({str(go_on)!r}):\n"
        "    time.sleep(0.02)\n"
        "print('second')"
    )
    assert context.next()["type"] == "number_of_executions"
    first = context.next()
    assert (first["type"], first["text"]) == ("stdout", "first\n")  # the cell is still waiting for go-on
    go_on.write_text("")
    rest = context.until_done(cell)
    assert [line.get("text") for line in rest] == ["second\n", None]


def test_output_between_cells_belongs_to_no_cell(context: GuestContext, tmp_path: Path) -> None:
    go_on, printed = tmp_path / "go-on", tmp_path / "printed"
    context.run(
        "import os, threading, time\n"
        "def late():\n"
        f"    while not os.path.exists({str(go_on)!r}):\n"
        "        time.sleep(0.01)\n"
        "    print('late', flush=True)\n"
        f"    open({str(printed)!r}, 'w').close()\n"
        "threading.Thread(target=late).start()"
    )
    go_on.write_text("")  # the cell is over: the thread prints between cells
    poll_until(printed.exists, timeout=30, what="the thread's print between cells")
    assert of_type(context.run("'next'"), "stdout") == []


def test_output_waits_for_credit_beyond_the_window(context: GuestContext) -> None:
    chunk = 64 << 10
    count = (guest_program.WINDOW // chunk) * 3
    cell = context.start(f"import sys\nfor i in range({count}):\n    sys.stdout.write('x' * {chunk})")
    received = 0
    while received < guest_program.WINDOW // 2:  # what the window allows comes at once
        message = context.next(credit=False)
        assert message["type"] != "done", "the whole output went out without credit"
        received += len(message.get("text", ""))
    while True:  # then it stops: a context that ignored the window would go on to its end
        try:
            message = context.next(timeout=0.2, credit=False)
        except queue.Empty:
            break  # it stopped: the window is full
        assert message["type"] != "done", "the whole output went out without credit"
        received += len(message.get("text", ""))
    assert guest_program.WINDOW // 2 <= received <= guest_program.WINDOW + chunk
    context.send({"op": "credit", "bytes": 1 << 40})
    rest = context.until_done(cell, timeout=60)
    received += sum(len(line.get("text", "")) for line in rest)
    assert received == count * chunk


# -- errors ----------------------------------------------------------------------------------------


def test_an_error_has_its_name_value_and_the_cells_traceback(context: GuestContext) -> None:
    lines = context.run("print('before')\n1/0")
    assert kinds(lines) == ["number_of_executions", "stdout", "error", "done"]
    (error,) = of_type(lines, "error")
    assert (error["name"], error["value"]) == ("ZeroDivisionError", "division by zero")
    assert 'File "Cell In[1]", line 2, in <module>' in error["traceback"]
    assert "1/0" in error["traceback"]
    assert error["traceback"].endswith("ZeroDivisionError: division by zero\n")
    assert str(PROGRAM.name) not in error["traceback"]  # none of the program's own frames


def test_errors_of_every_kind_keep_the_context_alive(context: GuestContext) -> None:
    context.run("class FinalAnswerException(Exception): pass\nkept = 'yes'")
    cases = {
        "raise FinalAnswerException('the answer')": ("FinalAnswerException", "the answer"),
        "undefined_name": ("NameError", "name 'undefined_name' is not defined"),
        "def broken(:": ("SyntaxError", "invalid syntax (Cell In[4], line 1)"),
        "import sys; sys.exit(3)": ("SystemExit", "3"),
        "input('say: ')": (
            "StdinNotImplementedError",
            "raw_input was called, but this frontend does not support input requests.",
        ),
        "%nomagic": ("UsageError", "Line magic function `%nomagic` not found."),
    }
    for code, expected in cases.items():
        (error,) = of_type(context.run(code), "error")
        assert (error["name"], error["value"]) == expected, code
    assert main_text(context.run("kept")) == "yes"


def test_sigint_interrupts_the_running_cell_and_nothing_else(context: GuestContext) -> None:
    context.run("state = 'kept'")
    context.interrupt()  # between cells: ignored
    # The signal reaches the context while it waits for the next request, before it reads that one.
    assert main_text(context.run("state")) == "kept" and context.process.poll() is None
    cell = context.start("import time\nprint('sleeping', flush=True)\ntime.sleep(60)")
    assert context.next()["type"] == "number_of_executions"
    assert context.next()["text"] == "sleeping\n"
    context.interrupt()
    lines: list[dict[str, Any]] = []
    deadline = time.monotonic() + 30
    while not lines or lines[-1]["type"] != "done":
        try:
            lines.append(context.next(timeout=1))
        except queue.Empty:
            # It came between the print and the sleep: CPython runs the handler when the sleep returns.
            # The host sends SIGINT again while the cell runs (INTERRUPT_REPEAT_S); so does this test.
            assert time.monotonic() < deadline, "the cell was never interrupted"
            context.interrupt()
    assert all(line.get("cell") == cell for line in lines)
    (error,) = of_type(lines, "error")
    assert error["name"] == "KeyboardInterrupt"
    assert "time.sleep(60)" in error["traceback"] and "on_sigint" not in error["traceback"]
    assert main_text(context.run("state")) == "kept"


# -- the cell's environment ------------------------------------------------------------------------


def test_env_vars_hold_for_one_cell_and_old_values_come_back(context: GuestContext) -> None:
    context.run("import os, subprocess\nos.environ['KEEP'] = 'old'")
    lines = context.run(
        "print(os.environ['FOO'], os.environ['KEEP'])\nsubprocess.run(['sh', '-c', 'echo $FOO'])",
        env={"FOO": "bar", "KEEP": "new"},
    )
    assert "".join(line["text"] for line in of_type(lines, "stdout")) == "bar new\nbar\n"
    assert main_text(context.run("(os.environ.get('FOO', 'default'), os.environ['KEEP'])")) == "('default', 'old')"


def test_the_cells_are_main_read_no_stdin_and_import_from_their_directory(
    context: GuestContext, tmp_path: Path
) -> None:
    (tmp_path / "helper_module.py").write_text("VALUE = 'imported'\n")
    assert main_text(context.run("import helper_module; helper_module.VALUE")) == "imported"
    assert main_text(context.run("__name__")) == "__main__"
    assert main_text(context.run("import pickle\nclass P: pass\ntype(pickle.loads(pickle.dumps(P()))).__name__")) == "P"
    assert main_text(context.run("import sys; sys.stdin.read()")) == ""


def test_shell_and_magic_lines_run_only_in_cells_that_are_not_python(context: GuestContext, tmp_path: Path) -> None:
    lines = context.run(f"!echo bang\n%cd {tmp_path}\nimport os\nos.getcwd()")
    assert "".join(line["text"] for line in of_type(lines, "stdout")) == f"bang\n{tmp_path}\n"
    assert main_text(lines) == str(tmp_path)
    assert main_text(context.run("1 != 2")) == "True"  # valid Python is never rewritten


# -- a new host ----------------------------------------------------------------------------------------


def test_hello_says_whether_a_cell_runs_and_resets_the_credit(context: GuestContext) -> None:
    context.send({"op": "hello", "cell": "h1"})
    idle = context.next()
    assert (idle["type"], idle["cell"], idle["busy"], idle["protocol"]) == (
        "hello",
        "h1",
        False,
        guest_program.PROTOCOL,
    )
    cell = context.start("import time\ntime.sleep(60)")
    assert context.next()["type"] == "number_of_executions"
    context.send({"op": "hello", "cell": "h2"})
    busy = context.next()
    assert (busy["busy"], busy["running"], busy["execution_count"]) == (True, cell, 1)
    context.interrupt()
    assert kinds(context.until_done(cell)) == ["error", "done"]


# -- the official client's parser ----------------------------------------------------------------------


def test_the_lines_parse_into_the_official_clients_types(context: GuestContext) -> None:
    models = pytest.importorskip("e2b_code_interpreter.models")
    context.run("x = 10")
    lines = context.run("import sys\nprint('out')\nprint('err', file=sys.stderr)\ndisplay('shown')\nx * 2")
    execution = models.Execution()
    stdout: list[Any] = []
    shown: list[Any] = []
    for line in lines:
        models.parse_output(execution, json.dumps(line), on_stdout=stdout.append, on_result=shown.append)
    assert execution.text == "20"
    assert execution.logs.stdout == ["out\n"] and execution.logs.stderr == ["err\n"]
    assert [str(message) for message in stdout] == ["out\n"] and not stdout[0].error
    assert [(result.text, result.is_main_result) for result in execution.results] == [("shown", False), ("20", True)]
    assert shown == execution.results and list(execution.results[1].formats()) == ["text"]
    assert execution.error is None and execution.execution_count == 2

    failed = models.Execution()
    for line in context.run("1/0"):
        models.parse_output(failed, json.dumps(line))
    assert isinstance(failed.error, models.ExecutionError)
    assert (failed.error.name, failed.error.value) == ("ZeroDivisionError", "division by zero")
    assert "Cell In[3]" in failed.error.traceback and failed.execution_count == 3

    rich = models.Execution()
    for line in context.run("class H:\n    def _repr_html_(self): return '<p>h</p>'\nH()"):
        models.parse_output(rich, json.dumps(line))
    (result,) = rich.results
    assert result.html == "<p>h</p>" and result._repr_html_() == "<p>h</p>"
    assert set(result.formats()) == {"text", "html"}
