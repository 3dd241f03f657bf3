"""A persistent Python context inside the guest: what E2B's code interpreter (``run_code``) runs cells in.

The host copies this file into the VM when a sandbox first runs code (it is
not part of the image) and starts one process per context, with the guest's
``python3`` or forkd's own runtime. The process keeps the namespace between
cells and runs each as a Jupyter kernel does for E2B: the last expression is
the result (``text/plain`` and the object's ``_repr_*_`` formats), stdout and
stderr stream as they are written (descriptors 1 and 2 are pipes read here,
so C code and subprocesses are captured too), an exception comes back with
its ``name``, ``value`` and ``traceback``, and every cell is counted.

The host speaks to it over its original stdin and stdout, one JSON object per
line (the cells' stdin is /dev/null). Requests:

``{"op": "execute", "cell": ID, "code": SOURCE, "env": {NAME: VALUE}}``
    run a cell (``env`` for that cell only); cells run one after another.
``{"op": "credit", "bytes": N}``
    the host consumed N bytes of output lines. Output waits beyond
    :data:`WINDOW` unconsumed bytes, so the guest agent's buffer for the host
    never overflows (it would drop the middle).
``{"op": "hello", "cell": ID}``
    a new host follows this process (a VM forked or resumed from a snapshot):
    forget the old host's credit, say whether a cell runs.

Answers are E2B's own ``/execute`` lines, tagged with their ``cell``:
``number_of_executions``, ``stdout``/``stderr`` (``text``, ISO 8601
``timestamp``), ``result`` (``is_main_result`` for the last expression),
``error``; and this program's ``ready`` (at start; with ``error`` and
``reason``, ``python`` or ``cwd``, when it cannot serve), ``hello`` and
``done``. SIGINT interrupts a running cell (``KeyboardInterrupt``, as
Jupyter's interrupt) and is ignored between cells.

It imports nothing of pytest-forkd and runs on Python 3.8 and later, whatever
the image ships; tests/e2b/test_interpreter_unit.py runs it on the host.
"""

from __future__ import annotations

import ast
import base64
import builtins
import codecs
import collections
import datetime
import io
import json
import linecache
import os
import pprint
import queue
import re
import select
import signal
import sys
import threading
import time
import traceback
import types
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

#: Version of the line protocol above; the host restarts a context that speaks another.
PROTOCOL = 1
#: Bytes of output lines that may wait for the host's credit.
WINDOW = 4 << 20
#: The longest line sent: larger results lose their biggest formats, larger text is cut.
MESSAGE_LIMIT = 16 << 20
#: Pending output is sent at least this often (seconds), as Jupyter's 0.2 s flush interval.
FLUSH_INTERVAL = 0.1
#: Pending output of one stream is sent once it reaches this many characters.
CHUNK_CHARS = 64 << 10
#: Line types that count against the credit window (the host credits exactly these).
DATA_TYPES = frozenset({"stdout", "stderr", "result", "error"})
#: MIME types (IPython's order), the ``_repr_*_`` method giving each, and the field of E2B's result line it fills.
FORMATS = (
    ("text/html", "_repr_html_", "html"),
    ("text/markdown", "_repr_markdown_", "markdown"),
    ("image/svg+xml", "_repr_svg_", "svg"),
    ("image/png", "_repr_png_", "png"),
    ("image/jpeg", "_repr_jpeg_", "jpeg"),
    ("application/pdf", "_repr_pdf_", "pdf"),
    ("text/latex", "_repr_latex_", "latex"),
    ("application/json", "_repr_json_", "json"),
    ("application/javascript", "_repr_javascript_", "javascript"),
)
#: MIME types and their fields in E2B's result line (the code interpreter server's mapping); others go to ``extra``.
RESULT_FIELDS = {"text/plain": "text", "e2b/data": "data", "e2b/chart": "chart", **{m: f for m, _, f in FORMATS}}
#: Binary formats, sent base64-encoded as Jupyter sends them.
BINARY_TYPES = frozenset({"image/png", "image/jpeg", "application/pdf"})
#: co_flags bit of a code object that must be awaited (a cell with top-level ``await``).
CO_COROUTINE = 0x0080
COMPILE_FLAGS = getattr(ast, "PyCF_ALLOW_TOP_LEVEL_AWAIT", 0)
#: This program's file: its frames are left out of a cell's traceback.
PROGRAM_FILE = __file__


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


def helper_thread(target: Callable[[], None], name: str) -> None:
    """Start one of this program's threads, deaf to SIGINT: the kernel then hands SIGINT to the main thread.

    A signal delivered to another thread sets Python's flag but does not wake
    the main thread, so a cell in ``time.sleep`` would not be interrupted.
    """

    def run() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        target()

    threading.Thread(target=run, name=name, daemon=True).start()


def encode(message: Dict[str, Any]) -> bytes:
    """One protocol line; a lone surrogate (undecodable bytes) becomes a JSON escape, not an error."""
    text = json.dumps(message, ensure_ascii=False, default=repr)
    return text.encode("utf-8", "backslashreplace") + b"\n"


class Channel:
    """The lines to the host, written by one thread so that an interrupt never cuts one in half.

    Data lines (:data:`DATA_TYPES`) wait while :data:`WINDOW` bytes are sent
    or queued and not yet credited; control lines never wait.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._condition = threading.Condition()
        self._lines: Deque[Tuple[bytes, bool]] = collections.deque()
        self._queued = 0
        self._unacked = 0
        helper_thread(self._write, "forkd-channel")

    def send(self, message: Dict[str, Any]) -> None:
        line = encode(message)
        data = message.get("type") in DATA_TYPES
        with self._condition:
            while data and self._queued + self._unacked >= WINDOW:
                self._condition.wait()
            self._lines.append((line, data))
            if data:
                self._queued += len(line)
            self._condition.notify_all()

    def finish(self) -> None:
        """Wait until every queued line is written (before the process exits)."""
        with self._condition:
            while self._lines:
                self._condition.wait()

    def credit(self, nbytes: int) -> None:
        with self._condition:
            self._unacked = max(0, self._unacked - nbytes)
            self._condition.notify_all()

    def reset(self) -> None:
        """A new host: what the old one never credited is not waited for."""
        with self._condition:
            self._unacked = 0
            self._condition.notify_all()

    def _write(self) -> None:
        while True:
            with self._condition:
                while not self._lines:
                    self._condition.wait()
                line, data = self._lines.popleft()
            view = memoryview(line)
            try:
                while view:
                    view = view[os.write(self._fd, view) :]
            except OSError:  # the agent is gone: nobody will ever read this context again
                os._exit(1)
            with self._condition:
                if data:
                    self._queued -= len(line)
                    self._unacked += len(line)
                self._condition.notify_all()


class Output:
    """The cell's stdout and stderr, gathered into E2B's ``stdout``/``stderr`` lines.

    Text of one stream is joined until the other stream writes, it reaches
    :data:`CHUNK_CHARS`, someone flushes, or :data:`FLUSH_INTERVAL` passes, so
    ``print("a"); print("b")`` is one line ``"a\\nb\\n"`` and the order of the
    two streams is kept. Output written between cells (a background thread)
    belongs to no cell and is dropped, as Jupyter's server drops it.
    """

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self._lock = threading.Lock()
        self._cell: Optional[str] = None
        self._stream = ""
        self._parts: List[str] = []
        self._size = 0
        self._pending = threading.Event()
        helper_thread(self._tick, "forkd-flush")

    def start(self, cell: str) -> None:
        with self._lock:
            self._cell = cell

    def stop(self) -> None:
        with self._lock:
            self._flush_locked()
            self._cell = None

    def write(self, stream: str, text: str) -> None:
        if not text:
            return
        with self._lock:
            if self._cell is None:
                return
            if stream != self._stream:
                self._flush_locked()
                self._stream = stream
            self._parts.append(text)
            self._size += len(text)
            if self._size >= CHUNK_CHARS:
                self._flush_locked()
            else:
                self._pending.set()

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        if not self._parts or self._cell is None:
            return
        text = "".join(self._parts)
        self._parts = []
        self._size = 0
        self._channel.send({"type": self._stream, "text": text, "timestamp": now(), "cell": self._cell})

    def _tick(self) -> None:
        """Send what waited :data:`FLUSH_INTERVAL`; an idle context never wakes (it costs nothing under emulation)."""
        while True:
            self._pending.wait()
            self._pending.clear()
            time.sleep(FLUSH_INTERVAL)
            self.flush()


class _BinaryStream:
    """``sys.stdout.buffer``: bytes written by Python code, decoded into the text stream."""

    def __init__(self, text: TextStream) -> None:
        self._text = text
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def write(self, data: bytes) -> int:
        self._text.write(self._decoder.decode(bytes(data)))
        return len(data)

    def flush(self) -> None:
        self._text.flush()


class TextStream(io.TextIOBase):
    """``sys.stdout`` and ``sys.stderr`` of the cells: straight into :class:`Output`, in order."""

    encoding = "utf-8"
    errors = "replace"

    def __init__(self, output: Output, name: str, fd: int) -> None:
        super().__init__()
        self._output = output
        self.name = name
        self._fd = fd
        self.buffer = _BinaryStream(self)

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        self._output.write(self.name, text)
        return len(text)

    def flush(self) -> None:
        self._output.flush()

    def fileno(self) -> int:
        """The captured descriptor (1 or 2): what a subprocess writes there arrives too."""
        return self._fd

    def writable(self) -> bool:
        return True


class PipeCapture:
    """Descriptor 1 or 2 made a pipe that this process reads: output of C code and subprocesses.

    A reader thread forwards what arrives; :meth:`drain` (the main thread,
    at the end of a cell) takes what is still in the pipe, under the same
    lock, so everything written during the cell is in the cell's output.
    """

    def __init__(self, fd: int, stream: str, output: Output) -> None:
        read_end, write_end = os.pipe()
        os.dup2(write_end, fd)  # inheritable: the cell's subprocesses write here too
        os.close(write_end)
        os.set_blocking(read_end, False)
        self._fd = read_end
        self._stream = stream
        self._output = output
        self._lock = threading.Lock()
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        helper_thread(self._read, f"forkd-{stream}")

    def _read(self) -> None:
        open_ = True
        while open_:
            select.select([self._fd], [], [])
            with self._lock:
                open_ = self._take()

    def _take(self) -> bool:
        """Forward what the pipe holds; False once it ended (a cell closed the descriptor for good)."""
        while True:
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                return True
            if not data:
                return False
            self._output.write(self._stream, self._decoder.decode(data))

    def drain(self) -> None:
        with self._lock:
            self._take()


class StdinNotImplementedError(NotImplementedError):
    """``input()`` in a cell: E2B's code interpreter answers no input requests (as Jupyter's kernel says)."""


def _no_input(prompt: object = "") -> str:
    raise StdinNotImplementedError("raw_input was called, but this frontend does not support input requests.")


class Interpreter:
    """One context: the namespace, the execution count, and the cells run in it."""

    def __init__(self, channel: Channel, output: Output, captures: List[PipeCapture]) -> None:
        self.channel = channel
        self.output = output
        self.captures = captures
        module = types.ModuleType("__main__")
        module.__dict__["__builtins__"] = builtins
        self._program = sys.modules.get("__main__")  # this program's own module lives on beside the cells'
        sys.modules["__main__"] = module  # pickle and dataclasses find the cells' classes here
        self.namespace: Dict[str, Any] = module.__dict__
        self.execution_count = 0
        self.in_cell = False
        self.running: Optional[str] = None
        self.state = threading.Lock()
        self.requests: queue.Queue[Optional[Dict[str, Any]]] = queue.Queue()
        self._loop: Any = None
        self._cell: Optional[str] = None

    # -- the host's requests (reader thread) -----------------------------------------------
    def serve_requests(self, fd: int) -> None:
        with os.fdopen(fd, "rb", buffering=0) as source:
            pending = b""
            while True:
                chunk = source.read(65536)
                if not chunk:
                    self.requests.put(None)
                    return
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    self._request(line)

    def _request(self, line: bytes) -> None:
        try:
            request = json.loads(line)
        except ValueError:
            return
        if not isinstance(request, dict):
            return
        op = request.get("op")
        if op == "credit" and isinstance(request.get("bytes"), int):
            self.channel.credit(request["bytes"])
        elif op == "hello":
            self.channel.reset()
            with self.state:  # the same lock as "done": busy is true exactly until its done is queued
                self.channel.send(
                    {
                        "type": "hello",
                        "cell": str(request.get("cell")),
                        "protocol": PROTOCOL,
                        "pid": os.getpid(),
                        "busy": self.running is not None,
                        "running": self.running,
                        "execution_count": self.execution_count,
                        "cwd": os.getcwd(),
                    }
                )
        elif op == "execute" and isinstance(request.get("code"), str):
            self.requests.put(request)

    # -- SIGINT ------------------------------------------------------------------------------
    def on_sigint(self, signum: int, frame: Any) -> None:
        if self.in_cell:
            raise KeyboardInterrupt

    # -- cells (main thread) -------------------------------------------------------------------
    def serve(self) -> None:
        while True:
            request = self.requests.get()
            if request is None:
                return
            self.execute(request)

    def execute(self, request: Dict[str, Any]) -> None:
        cell = str(request.get("cell"))
        env = request.get("env") or {}
        with self.state:
            self.running = cell
            self.execution_count += 1
            count = self.execution_count
        self._cell = cell
        self.channel.send({"type": "number_of_executions", "execution_count": count, "cell": cell})
        self.output.start(cell)
        saved = self._set_env(env if isinstance(env, dict) else {})
        error = self.run_cell(request["code"], count)
        self._restore_env(saved)
        for capture in self.captures:
            capture.drain()
        self.output.stop()
        if error is not None:
            self.channel.send(error)
        with self.state:
            self.running = None
            self.channel.send({"type": "done", "cell": cell, "execution_count": count})

    @staticmethod
    def _set_env(env: Dict[str, Any]) -> Dict[str, Optional[str]]:
        saved: Dict[str, Optional[str]] = {}
        for name, value in env.items():
            if isinstance(name, str) and isinstance(value, str) and name and "=" not in name and "\0" not in name:
                saved[name] = os.environ.get(name)
                os.environ[name] = value.replace("\0", "")
        return saved

    @staticmethod
    def _restore_env(saved: Dict[str, Optional[str]]) -> None:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    def run_cell(self, code: str, count: int) -> Optional[Dict[str, Any]]:
        """Run one cell; return its error line (None when it succeeded)."""
        try:
            try:
                self.in_cell = True
                body, last = compile_cell(code, f"Cell In[{count}]")
                self._run(body)
                if last is not None:
                    value = self._run(last)
                    if value is not None:
                        self._remember(value)
                        self.publish(value, main=True)
            finally:
                self.in_cell = False
        except BaseException as exc:  # the cell's own error, KeyboardInterrupt and SystemExit included
            return self._error_line(exc)
        return None

    def _run(self, code: types.CodeType) -> Any:
        if code.co_flags & CO_COROUTINE:
            return self._event_loop().run_until_complete(eval(code, self.namespace))
        return eval(code, self.namespace)

    def _event_loop(self) -> Any:
        """The loop that cells with top-level ``await`` run in (asyncio is imported only for them)."""
        import asyncio

        if self._loop is None or self._loop.is_closed() or self._loop.is_running():
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
        return self._loop

    def _remember(self, value: Any) -> None:
        """``_``, ``__`` and ``___``: the last three results, as IPython keeps them."""
        namespace = self.namespace
        namespace["___"] = namespace.get("__")
        namespace["__"] = namespace.get("_")
        namespace["_"] = value

    def _error_line(self, exc: BaseException) -> Dict[str, Any]:
        try:
            value = str(exc)
        except Exception:  # a broken __str__ must not lose the error
            value = f"<unprintable {type(exc).__name__} object>"
        try:
            report = traceback.TracebackException(type(exc), exc, exc.__traceback__)
            # This program's own frames (running the cell, the SIGINT handler) are not the cell's.
            report.stack = traceback.StackSummary.from_list(
                [frame for frame in report.stack if frame.filename != PROGRAM_FILE]
            )
            text = "".join(report.format())
        except Exception:
            text = f"{type(exc).__name__}: {value}\n"
        return {"type": "error", "name": type(exc).__name__, "value": value, "traceback": text, "cell": self._cell}

    # -- results -------------------------------------------------------------------------------
    def publish(self, value: Any, *, main: bool, raw: bool = False) -> None:
        """Send ``value`` as a result line (the last expression's, or one ``display()`` shows)."""
        bundle = dict(value) if raw and isinstance(value, dict) else self._formats(value)
        if not bundle:
            return
        self.output.flush()  # what the cell printed before comes first
        self.channel.send(result_line(bundle, main=main, cell=self._cell))

    def _formats(self, value: Any) -> Dict[str, Any]:
        data: Dict[str, Any] = {}
        bundle_method = real_method(value, "_repr_mimebundle_")
        if bundle_method is not None:
            bundle = self._call_formatter(bundle_method, "_repr_mimebundle_", include=None, exclude=None)
            if isinstance(bundle, tuple) and len(bundle) == 2:
                bundle = bundle[0]
            if isinstance(bundle, dict):
                data.update((str(key), item) for key, item in bundle.items() if item is not None)
        for mime, name, _field in FORMATS:
            method = None if mime in data else real_method(value, name)
            if method is None:
                continue
            shown = self._call_formatter(method, name)
            if isinstance(shown, tuple) and len(shown) == 2:
                shown = shown[0]
            if shown is not None:
                data[mime] = shown
        if "text/plain" not in data:
            try:
                data["text/plain"] = plain_text(value)
            except Exception:
                self._formatter_failed("__repr__")
        return data

    def _call_formatter(self, method: Callable[..., Any], name: str, **kwargs: Any) -> Any:
        try:
            return method(**kwargs)
        except Exception:  # as IPython: the traceback goes to stderr, the other formats still show
            self._formatter_failed(name)
            return None

    def _formatter_failed(self, name: str) -> None:
        sys.stderr.write(f"Error in {name} of the displayed object:\n{traceback.format_exc()}")

    def magic(self, name: str, argument: str) -> None:
        """A ``!command`` or ``%magic`` line; what a command printed comes before what the cell prints next."""
        try:
            run_magic(name, argument)
        finally:
            for capture in self.captures:
                capture.drain()

    def display(self, *objects: Any, raw: bool = False, **_ignored: Any) -> None:
        """IPython's ``display()``: show each object as a result that is not the cell's own."""
        for item in objects:
            self.publish(item, main=False, raw=raw)


def real_method(value: Any, name: str) -> Optional[Callable[..., Any]]:
    """``value.name`` if it is a real method: not on a class, not from a ``__getattr__`` that answers everything."""
    if isinstance(value, type):
        return None
    try:
        if getattr(value, "_ipython_canary_method_should_not_exist_", None) is not None:
            return None
        method = getattr(value, name, None)
    except Exception:
        return None
    return method if callable(method) else None


def plain_text(value: Any) -> str:
    """``text/plain``: the pretty repr, wrapped at 79 columns as IPython wraps containers."""
    if isinstance(value, (dict, list, tuple, set, frozenset)):
        return pprint.pformat(value, width=79, sort_dicts=False)
    return repr(value)


def result_line(bundle: Dict[str, Any], *, main: bool, cell: Optional[str]) -> Dict[str, Any]:
    """E2B's ``result`` line from a MIME bundle, as its code interpreter server builds it."""
    line: Dict[str, Any] = {"type": "result"}
    extra: Dict[str, Any] = {}
    for mime, data in bundle.items():
        if mime in BINARY_TYPES and isinstance(data, (bytes, bytearray)):
            data = base64.b64encode(bytes(data)).decode("ascii")
        elif mime == "application/json":
            try:
                json.dumps(data)
            except (TypeError, ValueError):
                data = None  # not JSON: the object's _repr_json_ broke its promise
        elif isinstance(data, (bytes, bytearray)):
            data = bytes(data).decode("utf-8", "replace")
        if data is None:
            continue
        field = RESULT_FIELDS.get(mime)
        if field is None:
            extra[mime] = data
        else:
            line[field] = data
    text = line.get("text")
    if isinstance(text, str) and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        line["text"] = text[1:-1]  # the server shows a string result without its quotes
    line["extra"] = extra
    line["is_main_result"] = main
    line["cell"] = cell
    return fit(line)


def fit(line: Dict[str, Any]) -> Dict[str, Any]:
    """Keep a result line under :data:`MESSAGE_LIMIT`: drop its largest formats but text, then cut the text."""
    while len(encode(line)) > MESSAGE_LIMIT:
        sizes = [(len(encode({key: line[key]})), key) for key in line if key not in ("type", "text", "cell")]
        sizes = [(size, key) for size, key in sizes if size > 1024]
        if not sizes:
            line["text"] = str(line.get("text", ""))[: MESSAGE_LIMIT // 8] + "\n[cut: too large to send]"
            break
        del line[max(sizes)[1]]
    return line


def strip_leading_indent(code: str) -> str:
    """IPython's ``leading_indent``: a cell whose first line is indented loses that indent on every line."""
    lines = code.splitlines(True)
    first = next((line for line in lines if line.strip()), "")
    indent = first[: len(first) - len(first.lstrip())]
    if not indent:
        return code
    return "".join(line[len(indent) :] if line.startswith(indent) else line for line in lines)


SHELL_LINE = re.compile(r"^(\s*)!(.*)$")
MAGIC_LINE = re.compile(r"^(\s*)%(\w+)(.*)$")


def transform_magics(code: str) -> Optional[str]:
    """IPython's ``!command``, ``%cd`` and ``%pip`` lines as Python; None if the cell has none.

    Used only for a cell that does not compile as Python, so valid Python is
    never rewritten.
    """
    changed = False
    lines = []
    for line in code.splitlines():
        shell = SHELL_LINE.match(line)
        magic = MAGIC_LINE.match(line)
        if shell is not None:
            lines.append(f"{shell.group(1)}__forkd_magic__('!', {shell.group(2).strip()!r})")
            changed = True
        elif magic is not None:
            lines.append(f"{magic.group(1)}__forkd_magic__({magic.group(2)!r}, {magic.group(3).strip()!r})")
            changed = True
        else:
            lines.append(line)
    return "\n".join(lines) + "\n" if changed else None


class UsageError(Exception):
    """An unknown ``%magic`` (IPython's name for the error)."""


def run_magic(name: str, argument: str) -> None:
    import shlex
    import subprocess

    if name == "!":
        subprocess.run(argument, shell=True)
    elif name == "cd":
        os.chdir(os.path.expanduser(argument or "~"))
        print(os.getcwd())
    elif name == "pip":
        subprocess.run([sys.executable, "-m", "pip", *shlex.split(argument)])
    else:
        raise UsageError(f"Line magic function `%{name}` not found.")


def compile_cell(code: str, filename: str) -> Tuple[types.CodeType, Optional[types.CodeType]]:
    """The cell as (its statements, its last expression or None), with its source kept for tracebacks."""
    source = strip_leading_indent(code)
    try:
        tree = compile(source, filename, "exec", ast.PyCF_ONLY_AST | COMPILE_FLAGS)
    except SyntaxError as error:
        transformed = transform_magics(source)
        if transformed is None:
            raise
        try:
            tree = compile(transformed, filename, "exec", ast.PyCF_ONLY_AST | COMPILE_FLAGS)
        except SyntaxError:
            raise error from None  # the cell's own mistake, not one of the rewriting
        source = transformed
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    last: Optional[types.CodeType] = None
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not ends_with_semicolon(source):
        expression = ast.Expression(tree.body.pop().value)
        last = compile(expression, filename, "eval", COMPILE_FLAGS)
    return compile(tree, filename, "exec", COMPILE_FLAGS), last


def ends_with_semicolon(source: str) -> bool:
    """Whether the cell's last token is ``;`` (IPython then shows no result)."""
    if ";" not in source:
        return False
    import io
    import tokenize

    last = ""
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.ENDMARKER):
                if token.type not in (tokenize.INDENT, tokenize.DEDENT):
                    last = token.string
    except (tokenize.TokenError, SyntaxError):
        return False
    return last == ";"


def start(arguments: List[str]) -> Tuple[Interpreter, int]:
    """Take over descriptors 0-2 and become the context: returns it and the host's request descriptor."""
    replies, requests = os.dup(1), os.dup(0)  # not inheritable: the cells' subprocesses never see them
    channel = Channel(replies)
    ready: Dict[str, Any] = {
        "type": "ready",
        "protocol": PROTOCOL,
        "pid": os.getpid(),
        "python": ".".join(str(part) for part in sys.version_info[:3]),
    }
    if sys.version_info < (3, 8):
        channel.send({**ready, "reason": "python", "error": f"Python {ready['python']} is too old (3.8+ needed)"})
        channel.finish()
        raise SystemExit(3)
    cwd, fallback = _option(arguments, "--cwd"), _option(arguments, "--default-cwd")
    try:
        if cwd is not None:
            os.chdir(cwd)
        elif fallback is not None and os.path.isdir(fallback):
            os.chdir(fallback)
    except OSError as exc:
        channel.send({**ready, "reason": "cwd", "error": f"cannot use {cwd} as the working directory: {exc.strerror}"})
        channel.finish()
        raise SystemExit(2) from None
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    output = Output(channel)
    captures = [PipeCapture(1, "stdout", output), PipeCapture(2, "stderr", output)]
    interpreter = Interpreter(channel, output, captures)
    sys.stdout = TextStream(output, "stdout", 1)
    sys.stderr = TextStream(output, "stderr", 2)
    sys.argv = [""]
    if sys.path and os.path.dirname(os.path.abspath(__file__)) == os.path.abspath(sys.path[0] or "."):
        sys.path[0] = ""  # the cells import from their working directory, as in a notebook, not from here
    builtins.input = _no_input
    builtins.display = interpreter.display  # type: ignore[attr-defined]
    builtins.__forkd_magic__ = interpreter.magic  # type: ignore[attr-defined]
    signal.signal(signal.SIGINT, interpreter.on_sigint)
    channel.send({**ready, "cwd": os.getcwd()})
    return interpreter, requests


def _option(arguments: List[str], name: str) -> Optional[str]:
    if name in arguments[:-1]:
        return arguments[arguments.index(name) + 1]
    return None


def main() -> int:
    interpreter, requests = start(sys.argv[1:])
    helper_thread(lambda: interpreter.serve_requests(requests), "forkd-requests")
    interpreter.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
