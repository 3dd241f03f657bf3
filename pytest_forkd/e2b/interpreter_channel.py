"""The lines between the host and one code interpreter context, and the E2B lines made of them.

A context is a process of the guest program :mod:`pytest_forkd.guest.interpreter`
(its docstring has the protocol): requests go to its stdin as JSON lines,
and its answers come back on its stdout, one JSON object per line, with credit
so that the guest's agent never holds more than it may. :class:`ContextChannel`
speaks that; :func:`output_line` turns the guest's messages into the lines of
E2B's ``/execute`` stream, keeping only E2B's fields, each of its type (the
guest runs the sandbox's code, so nothing it sends is trusted).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from pytest_forkd.errors import InvalidArgument, ProcessError, ProcessTimeout
from pytest_forkd.guest import interpreter_program

if TYPE_CHECKING:
    from pytest_forkd.aio import AsyncGuestProcess

#: Version of the line protocol of the guest program (its ``PROTOCOL``).
PROTOCOL: Final = 1
#: The longest line read from a context (the guest program sends at most 16 MiB).
MAX_LINE: Final = 32 << 20
#: The host tells the guest it consumed output after this many bytes.
CREDIT_STEP: Final = 1 << 20
#: Line types that count against the guest's credit window.
DATA_TYPES: Final = frozenset({"stdout", "stderr", "result", "error"})
#: Fields of E2B's result line, and the types their values must have.
RESULT_FIELDS: Final[dict[str, type | tuple[type, ...]]] = {
    "text": str,
    "html": str,
    "markdown": str,
    "svg": str,
    "png": str,
    "jpeg": str,
    "pdf": str,
    "latex": str,
    "json": (dict, list),
    "javascript": str,
    "data": dict,
    "chart": dict,
    "extra": dict,
    "is_main_result": bool,
}


@functools.cache
def program() -> tuple[bytes, str]:
    """The guest program's source and its file name in the guest (by content: versions never mix)."""
    source = interpreter_program().read_bytes()
    return source, f"interpreter-{hashlib.sha256(source).hexdigest()[:16]}.py"


#: The guest program's file name (its digest varies with its version).
PROGRAM_NAME: Final = re.compile(r"interpreter-[0-9a-f]{16}\.py")


def is_interpreter_command(command: str | Sequence[str]) -> bool:
    """Whether a spawned process's command is a code interpreter context (to keep it out of command lists)."""
    words = command.split() if isinstance(command, str) else list(command)
    return any(PROGRAM_NAME.fullmatch(word.rpartition("/")[2]) for word in words)


class ContextEnded(Exception):
    """The context's process ended (its output stream closed)."""


class ContextChannel:
    """The protocol lines of one context's process: requests to its stdin, JSON lines from its stdout."""

    def __init__(self, process: AsyncGuestProcess) -> None:
        self.process = process
        self._pending = bytearray()
        self._skipped = 0
        self._uncredited = 0
        self.ended = False

    async def send(self, message: Mapping[str, Any]) -> None:
        await self.process.write_stdin(json.dumps(message) + "\n")

    async def receive(self, timeout: float | None) -> dict[str, Any] | None:
        """The next JSON object (lines that are not one are skipped); None after ``timeout`` s; :class:`_Ended`."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            left = None if deadline is None else max(deadline - loop.time(), 0.01)
            try:
                piece = await self.process.stdout.readline(timeout=left)
            except ProcessTimeout:
                return None
            if not piece:
                self.ended = True
                raise ContextEnded
            if self._skipped or len(self._pending) + len(piece) > MAX_LINE:
                self._skipped += len(self._pending) + len(piece)  # a line no guest program sends: skipped
                self._pending.clear()
            else:
                self._pending += piece
            if not piece.endswith(b"\n"):
                continue
            line, self._pending = bytes(self._pending), bytearray()
            skipped, self._skipped = self._skipped, 0
            message = parse_line(line) if line else None
            if message is None or message.get("type") in DATA_TYPES:  # credit too much rather than too little
                await self._credit(skipped + len(line))
            if message is not None:
                return message

    async def _credit(self, nbytes: int) -> None:
        self._uncredited += nbytes
        if self._uncredited >= CREDIT_STEP:
            nbytes, self._uncredited = self._uncredited, 0
            with contextlib.suppress(ProcessError):  # it ended: the end of its output follows
                await self.send({"op": "credit", "bytes": nbytes})


def parse_line(line: bytes) -> dict[str, Any] | None:
    try:
        message = json.loads(line)
    except ValueError:
        return None
    return message if isinstance(message, dict) and isinstance(message.get("type"), str) else None


def output_line(message: dict[str, Any]) -> dict[str, Any] | None:
    """A line of E2B's stream from the guest's message, with only its fields, each of its type (else None)."""
    kind = message["type"]
    if kind in ("stdout", "stderr"):
        text = message.get("text")
        timestamp = message.get("timestamp")
        if not isinstance(text, str):
            return None
        return {"type": kind, "text": text, "timestamp": timestamp if isinstance(timestamp, str) else None}
    if kind == "error":
        fields = {key: message.get(key) for key in ("name", "value", "traceback")}
        return {"type": "error", **{key: value if isinstance(value, str) else "" for key, value in fields.items()}}
    if kind == "number_of_executions":
        count = message.get("execution_count")
        if isinstance(count, int) and not isinstance(count, bool):
            return {"type": kind, "execution_count": count}
        return None
    if kind == "result":
        line: dict[str, Any] = {"type": "result"}
        for key, kind_of in RESULT_FIELDS.items():
            value = message.get(key)
            if isinstance(value, kind_of):
                line[key] = value
        return line
    return None


def timeout_error(timeout_s: float | None, traceback: str, *, restarted: bool) -> dict[str, Any]:
    limit = f"{timeout_s:g} s" if timeout_s is not None else "its time"
    how = (
        "it did not stop when interrupted, so its context was restarted without its state"
        if restarted
        else "it was interrupted"
    )
    return {
        "type": "error",
        "name": "TimeoutError",
        "value": f"Execution timed out after {limit}: {how}",
        "traceback": traceback,
    }


def check_cwd(cwd: str | None) -> None:
    if cwd is None:
        return
    if not isinstance(cwd, str) or not cwd or "\0" in cwd or len(cwd) > 4096:
        raise InvalidArgument(f"cwd must be a guest directory such as /home/user, got {cwd!r}")


def check_execute(
    code: str,
    context_id: str | None,
    language: str | None,
    env_vars: Mapping[str, str] | None,
    timeout_s: float | None,
) -> None:
    if not isinstance(code, str):
        raise InvalidArgument(f"code must be a string, got {type(code).__name__}")
    if context_id is not None and not isinstance(context_id, str):
        raise InvalidArgument(f"context_id must be a string, got {type(context_id).__name__}")
    if env_vars is not None:
        if not isinstance(env_vars, Mapping):
            raise InvalidArgument(f"env_vars must map names to values, got {type(env_vars).__name__}")
        for name, value in env_vars.items():
            if not isinstance(name, str) or not name or "=" in name or "\0" in name:
                raise InvalidArgument(f"env_vars: {name!r} is not an environment variable name")
            if not isinstance(value, str) or "\0" in value:
                raise InvalidArgument(f"env_vars[{name!r}] must be a string without NUL, got {value!r}")
    if timeout_s is not None and (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, (int, float))
        or not math.isfinite(timeout_s)
        or timeout_s <= 0
    ):
        raise InvalidArgument(f"timeout_s must be a number of seconds > 0 or None, got {timeout_s!r}")
