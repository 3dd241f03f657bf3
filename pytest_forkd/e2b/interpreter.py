"""E2B's code interpreter on a forkd VM: each context a persistent Python process in the guest.

E2B's ``run_code`` and its contexts (``POST /execute``, ``/contexts`` on the
sandbox's port 49999) run cells in Jupyter kernels that keep their state. Here
a context is one process of the guest program
:mod:`pytest_forkd.guest.interpreter`, copied into the VM on first use (it is
not part of the image, so the image's key does not change) and started with
the guest's ``python3``, or with forkd's own runtime in a container image that
has no Python. :class:`CodeInterpreter` is the host's side: it starts,
restarts and removes contexts and turns a cell's run into the JSON lines of
E2B's ``/execute`` stream, which the official clients parse into their
``Execution``, ``Result``, ``Logs`` and ``ExecutionError``.

A context is a process of the guest, so it lives in every VM made from a
snapshot of it: a branch, a fork, a pause and resume. The contexts are
listed in a small registry file in the guest (:data:`GUEST_DIR`), and a new
:class:`CodeInterpreter` on such a VM finds them there and attaches to their
processes (``vm.process(pid)``), state and all; what one copy runs afterwards
never reaches the other. A cell that was running when the snapshot was taken
is interrupted in the copy when the copy first uses that context (its output
went to the original).

Only the VM API is used (spawn, attach, write_file, read_file, exec): one
:class:`CodeInterpreter` per VM, called from one event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import signal
import uuid
from collections.abc import AsyncGenerator, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from pytest_forkd.e2b.interpreter_channel import (
    PROTOCOL,
    ContextChannel,
    ContextEnded,
    check_cwd,
    check_execute,
    is_interpreter_command,
    output_line,
    program,
    timeout_error,
)
from pytest_forkd.errors import (
    AgentError,
    CommandNotFound,
    ForkdError,
    InvalidArgument,
    NoSuchProcess,
    ProcessError,
)

if TYPE_CHECKING:
    from pytest_forkd.aio import AsyncVM

__all__ = [
    "DEFAULT_CWD",
    "GUEST_DIR",
    "CodeInterpreter",
    "InterpreterError",
    "UnknownContext",
    "UnsupportedLanguage",
    "is_interpreter_command",
    "normalize_language",
]

log = logging.getLogger(__name__)

#: Where the guest keeps the program and the registry of contexts (under /run: never a change of the sandbox's files).
GUEST_DIR: Final = "/run/forkd/e2b"
#: The working directory of a context created without one, if the guest has it (E2B's default), else the VM's.
DEFAULT_CWD: Final = "/home/user"
#: Version of the registry file's format.
REGISTRY_FORMAT: Final = 1
#: Languages a context can run.
SUPPORTED_LANGUAGES: Final = ("python",)
#: E2B's short names (its server's ``normalize_language``), and Python's own.
LANGUAGE_ALIASES: Final = {"js": "javascript", "ts": "typescript", "python3": "python", "py": "python"}
#: forkd's own Python in a container image (/init mounts it at /.forkd), run through its own loader.
RUNTIME_PYTHON: Final = (
    "/.forkd/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
    "--library-path",
    "/.forkd/usr/lib/x86_64-linux-gnu",
    "/.forkd/usr/bin/python3",
)
#: Interpreters tried in turn: the guest's own, then forkd's runtime.
PYTHON_CANDIDATES: Final = (("python3",), RUNTIME_PYTHON)
#: Output a context may leave unread in the guest; more than its credit window plus its longest line.
MAX_OUTPUT: Final = 64 << 20
#: A ``keepalive`` line goes out after this long without output (E2B's server sends one every 5 s).
KEEPALIVE_S: Final = 5.0
#: How long a new context's Python may take to start (imports under emulation are slow).
START_TIMEOUT_S: Final = 120.0
#: How long an attached context may take to answer its new host.
HELLO_TIMEOUT_S: Final = 60.0
#: How long an interrupted cell may take to end before its context is killed and restarted.
INTERRUPT_GRACE_S: Final = 10.0
#: SIGINT is sent again this often while an interrupted cell has not ended.
INTERRUPT_REPEAT_S: Final = 2.0
#: Characters of a failed start's stderr quoted in its error.
STDERR_TAIL_CHARS: Final = 2000
#: How long ending a context's process may take.
END_TIMEOUT_S: Final = 30.0


class InterpreterError(ForkdError):
    """A context's Python could not be started or was closed (no Python 3.8+ in the sandbox, a dead VM...)."""


class UnknownContext(ForkdError):
    """No context with that id in this sandbox (E2B's server answers 404)."""


class UnsupportedLanguage(InvalidArgument):
    """A context of a language forkd's code interpreter does not run (it runs Python)."""


def normalize_language(language: str | None) -> str:
    """E2B's language name: None or empty is ``python``; ``js`` and ``ts`` are the long names."""
    if language is None or not language.strip():
        return "python"
    name = language.strip().lower()
    return LANGUAGE_ALIASES.get(name, name)


def check_language(language: str | None) -> str:
    """The normalized language, or :class:`UnsupportedLanguage` naming it."""
    if language is not None and not isinstance(language, str):
        raise InvalidArgument(f"language must be a string such as 'python', got {type(language).__name__}")
    name = normalize_language(language)
    if name not in SUPPORTED_LANGUAGES:
        raise UnsupportedLanguage(
            f"language {name!r} is not supported: forkd's code interpreter runs Python (language 'python', "
            f"the default). Run {name} code as a command instead (sandbox.commands.run), with a runtime the "
            "sandbox's image has"
        )
    return name


@dataclass(eq=False)
class _Context:
    id: str
    language: str
    cwd: str
    requested_cwd: str | None
    pid: int | None = None
    channel: ContextChannel | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    removed: bool = False
    restarts: int = 0
    """Counts restarts, so that a cell cut short by one says so."""

    def describe(self) -> dict[str, Any]:
        """E2B's Context JSON."""
        return {"id": self.id, "language": self.language, "cwd": self.cwd}


class CodeInterpreter:
    """The code interpreter of one sandbox VM: its contexts and the cells they run.

    ``vm`` may already have contexts (a VM forked or resumed from a snapshot
    of a sandbox that ran code): they are found in the guest's registry on
    first use. ``directory``: where the guest keeps the program and the
    registry (tests give a private one).
    """

    def __init__(self, vm: AsyncVM, *, directory: str = GUEST_DIR) -> None:
        if not directory.startswith("/") or "\0" in directory:
            raise InvalidArgument(f"directory must be an absolute guest path, got {directory!r}")
        self._vm = vm
        self._directory = directory.rstrip("/") or "/"
        self._registry_path = f"{self._directory}/contexts.json"
        self._program_path = f"{self._directory}/{program()[1]}"
        self._contexts: dict[str, _Context] = {}
        self._defaults: dict[str, str] = {}
        self._python: tuple[str, ...] | None = None
        self._installed = False
        self._loaded = False
        self._closed = False
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()

    # -- E2B's /contexts ----------------------------------------------------------------------
    async def create_context(self, *, language: str | None = None, cwd: str | None = None) -> dict[str, Any]:
        """Start a new context (a Python process) and return E2B's Context JSON ``{"id", "language", "cwd"}``.

        ``cwd`` must exist in the guest (:class:`~pytest_forkd.errors.InvalidArgument`
        otherwise); without it the context starts in ``/home/user`` if the
        guest has it, else in the VM's working directory.
        """
        name = check_language(language)
        check_cwd(cwd)
        await self._ensure_loaded()
        context = _Context(str(uuid.uuid4()), name, cwd or "", cwd)
        async with context.lock:
            await self._start(context)
            async with self._lock:
                self._contexts[context.id] = context
                await self._save()
        return context.describe()

    async def default_context(self, language: str | None = None) -> dict[str, Any]:
        """The context cells of ``language`` run in when none is named, started if need be.

        E2B's sandbox has its default Python context from the start; a server
        may call this while preparing a template's parent, so that every
        sandbox forked from it finds a warm interpreter.
        """
        return (await self._default(check_language(language))).describe()

    async def list_contexts(self) -> list[dict[str, Any]]:
        """E2B's Context JSON of every context, the default Python one (started if need be) first."""
        with contextlib.suppress(InterpreterError):  # no Python in the sandbox: execute says so
            await self._default("python")
        defaults = set(self._defaults.values())
        ordered = sorted(self._contexts.values(), key=lambda context: context.id not in defaults)
        return [context.describe() for context in ordered]

    async def restart_context(self, context_id: str) -> None:
        """Kill the context's process and start a fresh one (its state is gone); a running cell ends with an error."""
        context = await self._lookup(context_id)
        context.restarts += 1
        await self._follow(context)
        await self._signal(context, signal.SIGKILL)
        async with context.lock:
            if context.removed:
                raise UnknownContext(f"context {context_id!r} was removed meanwhile")
            await self._discard(context)
            await self._start(context)
            async with self._lock:
                await self._save()

    async def remove_context(self, context_id: str) -> None:
        """Kill the context's process and forget it; a running cell ends with an error."""
        context = await self._lookup(context_id)
        context.removed = True
        await self._follow(context)
        await self._signal(context, signal.SIGKILL)
        async with self._lock:
            self._contexts.pop(context.id, None)
            self._defaults = {name: known for name, known in self._defaults.items() if known != context.id}
            await self._save()
        async with context.lock:
            await self._discard(context)

    # -- E2B's /execute -------------------------------------------------------------------------
    async def execute(
        self,
        code: str,
        *,
        context_id: str | None = None,
        language: str | None = None,
        env_vars: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Run ``code`` as one cell; yield the JSON lines of E2B's ``/execute`` stream as they come.

        The lines: ``number_of_executions``, then ``stdout``/``stderr``,
        ``result`` and ``error`` in the order the cell made them, a
        ``keepalive`` after every 5 s of silence (as E2B's server sends; the
        clients skip it), and last ``end_of_execution``. Bad input is raised
        by the first ``__anext__``, before any line: :class:`UnknownContext`
        (E2B answers 404), :class:`UnsupportedLanguage` and
        :class:`~pytest_forkd.errors.InvalidArgument` (both context and
        language given, malformed ``env_vars``), :class:`InterpreterError`
        (no Python in the sandbox).

        ``env_vars`` hold for this cell only. After ``timeout_s`` seconds the
        cell is interrupted (SIGINT, Jupyter's interrupt) and its error line
        is named ``TimeoutError``; a cell that ignores the interrupt for
        10 s more is killed with its context, which restarts without its
        state. Closing the iterator early (a client that went away) interrupts
        the cell the same way; the context's next cell waits until that
        settled.
        """
        check_execute(code, context_id, language, env_vars, timeout_s)
        context = await self._resolve(context_id, language)
        await context.lock.acquire()
        started: str | None = None
        ended = False
        try:
            if context.removed:
                raise UnknownContext(f"context {context.id!r} was removed")
            await self._ensure_running(context)
            channel = context.channel
            assert channel is not None
            restarts = context.restarts
            started = uuid.uuid4().hex
            await channel.send({"op": "execute", "cell": started, "code": code, "env": dict(env_vars or {})})
            async with contextlib.aclosing(self._cell_lines(context, channel, started, restarts, timeout_s)) as lines:
                async for line in lines:
                    yield line
            ended = True  # the cell is over in the guest, whether or not the last line is taken
            yield {"type": "end_of_execution"}
        finally:
            if ended or started is None or context.channel is None:
                context.lock.release()
            else:  # abandoned mid-cell: stop the cell in the background, then let the next one in
                self._in_background(self._settle(context, started))

    async def _cell_lines(
        self, context: _Context, channel: ContextChannel, cell: str, restarts: int, timeout_s: float | None
    ) -> AsyncGenerator[dict[str, Any], None]:
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        interrupted_at: float | None = None
        errored = False
        while True:
            now = loop.time()
            if deadline is not None and interrupted_at is None and now >= deadline:
                interrupted_at = now
                await self._signal(context, signal.SIGINT)
            if interrupted_at is not None:
                if now - interrupted_at >= INTERRUPT_GRACE_S:  # it ignores the interrupt: end the context
                    await self._signal(context, signal.SIGKILL)
                    await self._discard(context)
                    yield timeout_error(timeout_s, "", restarted=True)
                    return
                wait = INTERRUPT_REPEAT_S
            else:
                wait = KEEPALIVE_S if deadline is None else min(KEEPALIVE_S, max(deadline - now, 0.0))
            try:
                message = await channel.receive(wait)
            except ContextEnded:
                yield await self._ended_error(context, restarted=context.restarts != restarts)
                return
            if message is None:
                if interrupted_at is not None:
                    await self._signal(context, signal.SIGINT)  # again: the first may have come between cells
                elif deadline is None or loop.time() < deadline:
                    yield {"type": "keepalive"}
                continue
            if message.get("cell") != cell:
                continue  # a line of a cell interrupted earlier, or of a snapshot's
            kind = message["type"]
            if kind == "done":
                if interrupted_at is not None and not errored:
                    yield timeout_error(timeout_s, "", restarted=False)
                return
            line = output_line(message)
            if line is None:
                continue
            if kind == "error":
                errored = True
                if interrupted_at is not None and line["name"] == "KeyboardInterrupt":
                    line = timeout_error(timeout_s, line["traceback"], restarted=False)
            yield line

    # -- the end ----------------------------------------------------------------------------------
    async def close(self) -> None:
        """End every context's process (the VM keeps running) and empty the registry.

        To keep the contexts in a snapshot (pause, fork), take the snapshot
        before closing; a VM that is about to be killed needs no close.
        """
        if self._closed:
            return
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        contexts, self._contexts, self._defaults = list(self._contexts.values()), {}, {}
        for context in contexts:
            context.removed = True
            with contextlib.suppress(ForkdError):
                await self._follow(context, even_in_use=True)
            await self._signal(context, signal.SIGKILL)
        for context in contexts:
            await self._discard(context)
        if self._loaded and not self._vm.closed:
            with contextlib.suppress(ForkdError):
                await self._save()

    # -- contexts -----------------------------------------------------------------------------------
    async def _lookup(self, context_id: str) -> _Context:
        if not isinstance(context_id, str):
            raise InvalidArgument(f"context_id must be a string, got {type(context_id).__name__}")
        await self._ensure_loaded()
        context = self._contexts.get(context_id)
        if context is None:
            raise UnknownContext(f"Context {context_id} not found")
        return context

    async def _resolve(self, context_id: str | None, language: str | None) -> _Context:
        if context_id is not None and language is not None:
            raise InvalidArgument("Only one of context_id or language can be provided")
        if context_id is not None:
            return await self._lookup(context_id)
        return await self._default(check_language(language))

    async def _default(self, language: str) -> _Context:
        await self._ensure_loaded()
        async with self._lock:  # one default per language, however many cells ask at once
            known = self._contexts.get(self._defaults.get(language, ""))
            if known is not None:
                return known
            context = _Context(str(uuid.uuid4()), language, "", None)
            async with context.lock:
                await self._start(context)
            self._contexts[context.id] = context
            self._defaults[language] = context.id
            await self._save()
            return context

    async def _ensure_running(self, context: _Context) -> None:
        """Give ``context`` a live process: its own, the one a snapshot left (attached), or a fresh one."""
        channel = context.channel
        if channel is not None and not channel.ended and channel.process.returncode is None:
            return
        if channel is not None:
            await self._discard(context)
        if context.pid is not None and await self._attach(context):
            return
        await self._start(context)
        async with self._lock:
            await self._save()

    async def _start(self, context: _Context) -> None:
        """Start the context's process with the first interpreter that can run it."""
        self._check_open()
        await self._install()
        arguments = ["--cwd", context.requested_cwd] if context.requested_cwd else ["--default-cwd", DEFAULT_CWD]
        candidates = [self._python] if self._python is not None else list(PYTHON_CANDIDATES)
        problems = []
        for python in candidates:
            try:
                # As root whatever the image's own user, as E2B's Jupyter server runs its kernels.
                process = await self._vm.spawn(
                    [*python, self._program_path, *arguments], max_output=MAX_OUTPUT, user="0"
                )
            except CommandNotFound:
                problems.append(f"{python[-1]}: not found")
                continue
            channel = ContextChannel(process)
            ready = await self._wait_ready(channel)
            if ready is not None and not ready.get("error") and isinstance(ready.get("pid"), int):
                self._python = python
                context.channel, context.pid = channel, process.pid
                context.cwd = str(ready.get("cwd") or context.requested_cwd or "")
                return
            said = (await self._end(channel)).strip()[-STDERR_TAIL_CHARS:]
            if ready is not None and ready.get("reason") == "cwd":
                raise InvalidArgument(f"cannot start a context in {context.requested_cwd}: {ready.get('error')}")
            problems.append(f"{python[-1]}: {ready.get('error') if ready else f'exited without starting: {said!r}'}")
        raise InterpreterError(
            f"the code interpreter needs Python 3.8 or later in the sandbox, and none could start "
            f"({'; '.join(problems)}); install python3 in the sandbox's image"
        )

    async def _wait_ready(self, channel: ContextChannel) -> dict[str, Any] | None:
        """The process's ``ready`` line, or None if it ended (or took too long) first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_TIMEOUT_S
        while loop.time() < deadline:
            try:
                message = await channel.receive(deadline - loop.time())
            except ContextEnded:
                return None
            if message is not None and message.get("type") == "ready":
                return message
        return None

    async def _attach(self, context: _Context) -> bool:
        """Follow the process a snapshot left for ``context``; False if it is gone or not usable."""
        assert context.pid is not None
        try:
            process = await self._vm.process(context.pid)
        except NoSuchProcess:
            return False
        channel = ContextChannel(process)
        if not is_interpreter_command(process.command):
            return False  # the pid is some other process's now
        hello = uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        deadline = loop.time() + HELLO_TIMEOUT_S
        answer: dict[str, Any] | None = None
        try:
            await channel.send({"op": "hello", "cell": hello})
            while answer is None and loop.time() < deadline:
                message = await channel.receive(deadline - loop.time())
                if message is not None and message.get("type") == "hello" and message.get("cell") == hello:
                    answer = message
        except (ContextEnded, ProcessError):
            answer = None
        if answer is None or answer.get("protocol") != PROTOCOL:
            await self._end(channel)  # gone quiet, or another version of the program: start anew
            return False
        context.channel = channel
        running = answer.get("running")
        if answer.get("busy") and isinstance(running, str):
            await self._settle(context, running, release=False)
        return context.channel is not None

    async def _settle(self, context: _Context, cell: str, *, release: bool = True) -> None:
        """Interrupt ``cell`` and wait until it ended (its lines discarded); kill the context if it will not."""
        try:
            channel = context.channel
            if channel is None:
                return
            loop = asyncio.get_running_loop()
            deadline = loop.time() + INTERRUPT_GRACE_S
            await self._signal(context, signal.SIGINT)
            while loop.time() < deadline:
                message = await channel.receive(min(INTERRUPT_REPEAT_S, deadline - loop.time()))
                if message is None:
                    await self._signal(context, signal.SIGINT)
                elif message.get("type") == "done" and message.get("cell") == cell:
                    return
            await self._signal(context, signal.SIGKILL)
            await self._discard(context)
        except (ContextEnded, ForkdError):
            await self._discard(context)
        finally:
            if release:
                context.lock.release()

    async def _follow(self, context: _Context, *, even_in_use: bool = False) -> None:
        """Get a handle of the process a snapshot left for ``context`` (to end it), if it has none yet."""
        if context.channel is not None or context.pid is None or (context.lock.locked() and not even_in_use):
            return  # a cell in progress is attaching it: the restart or removal waits for its end
        try:
            process = await self._vm.process(context.pid)
        except NoSuchProcess:
            context.pid = None
            return
        if is_interpreter_command(process.command):
            context.channel = ContextChannel(process)

    async def _signal(self, context: _Context, sig: int) -> None:
        channel = context.channel
        if channel is None or channel.ended:
            return
        with contextlib.suppress(ForkdError):  # it ended already, or its VM did
            await channel.process.kill(sig)

    async def _discard(self, context: _Context) -> None:
        """End the context's process (if it still runs) and forget it: the next cell starts a fresh one."""
        channel, context.channel = context.channel, None
        context.pid = None
        if channel is not None:
            await self._end(channel)

    async def _end(self, channel: ContextChannel) -> str:
        """Kill the process and read its streams to their end, so the guest's agent forgets it too; its stderr."""
        process = channel.process
        channel.ended = True
        if self._vm.closed:
            return ""
        stderr = b""
        try:
            if process.returncode is None:
                await process.kill(signal.SIGKILL)
            await process.stdout.read(timeout=END_TIMEOUT_S)
            stderr = await process.stderr.read(timeout=END_TIMEOUT_S)
            await process.wait(timeout=END_TIMEOUT_S)
        except ForkdError as exc:  # a dead VM, or a process that outlived SIGKILL: nothing more to do here
            log.debug("ending code interpreter process %s: %s", process.pid, exc)
        return stderr.decode(errors="replace")

    async def _ended_error(self, context: _Context, *, restarted: bool) -> dict[str, Any]:
        channel = context.channel
        status: int | str = "unknown"
        if channel is not None:
            with contextlib.suppress(ForkdError):  # its output ended first: the exit follows at once
                status = await channel.process.wait(timeout=END_TIMEOUT_S)
        await self._discard(context)
        if restarted:
            return {"type": "error", "name": "ContextRestarting", "value": "Context was restarted", "traceback": ""}
        if context.removed:
            value = "Context was removed"
        else:
            value = (
                f"the context's Python process ended (status {status}) before the execution finished; "
                "the next execution starts it anew, without the previous state"
            )
        return {"type": "error", "name": "UnexpectedEndOfExecution", "value": value, "traceback": ""}

    # -- the guest's files -------------------------------------------------------------------------
    async def _install(self) -> None:
        """Copy the guest program into the VM (once; a VM forked from one that has it has it too)."""
        if self._installed:
            return
        source = program()[0]
        try:
            await self._vm.write_file(self._program_path, source)
        except AgentError as exc:
            if getattr(exc, "errno", None) != errno.ENOENT:
                raise
            await self._make_directory()
            await self._vm.write_file(self._program_path, source)
        self._installed = True

    async def _make_directory(self) -> None:
        commands = [["mkdir", "-p", self._directory]] + [
            [*python, "-c", "import os, sys; os.makedirs(sys.argv[1], exist_ok=True)", self._directory]
            for python in PYTHON_CANDIDATES
        ]
        for command in commands:
            try:  # as root: an image's own user may not write to /run
                await self._vm.exec(command, check=True, user="0")
                return
            except CommandNotFound:
                continue
        raise InterpreterError(f"cannot create {self._directory} in the sandbox: it has neither mkdir nor Python")

    async def _ensure_loaded(self) -> None:
        """Read the registry a snapshot left (once): the contexts this VM already has."""
        self._check_open()
        if self._loaded:
            return
        async with self._lock:
            if self._loaded:
                return
            try:
                raw = await self._vm.read_file(self._registry_path, max_size=1 << 20)
            except AgentError as exc:
                if getattr(exc, "errno", None) != errno.ENOENT:
                    raise
                raw = b""
            self._adopt(raw)
            self._loaded = True

    def _adopt(self, raw: bytes) -> None:
        """Take the contexts of a registry; anything malformed in it (the guest is not trusted) is ignored."""
        try:
            registry = json.loads(raw) if raw else {}
        except ValueError:
            registry = {}
        if not isinstance(registry, dict) or registry.get("format") != REGISTRY_FORMAT:
            return
        for entry in registry.get("contexts") or ():
            if not isinstance(entry, dict):
                continue
            context_id, language, cwd, pid = (entry.get(key) for key in ("id", "language", "cwd", "pid"))
            requested = entry.get("requested_cwd")
            if not (isinstance(context_id, str) and 0 < len(context_id) <= 128 and language in SUPPORTED_LANGUAGES):
                continue
            if not isinstance(cwd, str) or not (requested is None or isinstance(requested, str)):
                continue
            valid_pid = pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None
            self._contexts[context_id] = _Context(context_id, str(language), cwd, requested, pid=valid_pid)
        defaults = registry.get("defaults")
        if isinstance(defaults, dict):
            self._defaults = {
                name: known for name, known in defaults.items() if isinstance(known, str) and known in self._contexts
            }
        python = registry.get("python")
        if python in [list(candidate) for candidate in PYTHON_CANDIDATES]:
            self._python = tuple(python)
        self._installed = registry.get("program") == self._program_path

    async def _save(self) -> None:
        """Write the registry (the caller holds ``self._lock``)."""
        registry = {
            "format": REGISTRY_FORMAT,
            "program": self._program_path if self._installed else None,
            "python": list(self._python) if self._python is not None else None,
            "defaults": self._defaults,
            "contexts": [
                {
                    "id": context.id,
                    "language": context.language,
                    "cwd": context.cwd,
                    "requested_cwd": context.requested_cwd,
                    "pid": context.pid,
                }
                for context in self._contexts.values()
            ],
        }
        if not self._installed and not self._contexts:
            return  # nothing in the guest yet, not even the directory
        await self._vm.write_file(self._registry_path, json.dumps(registry, indent=1) + "\n")

    # -- helpers ------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise InterpreterError(f"the code interpreter of VM {self._vm.name} was closed")

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
