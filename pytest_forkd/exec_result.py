"""The outcome of one command run in a guest."""

from __future__ import annotations

import shlex
import signal
from dataclasses import dataclass

from .errors import ExecError, ExecTimeout

# How much output an error message or a repr shows: enough to see what went
# wrong, never megabytes.
_TAIL_LINES = 20
_TAIL_CHARS = 2000
_REPR_PREVIEW_BYTES = 60


@dataclass(frozen=True, repr=False)
class ExecResult:
    """What a guest command produced.

    ``command`` is what was asked for: a shell string, or the argv as a tuple.
    ``exit_code`` is negative when the command was killed by a signal (like
    :mod:`subprocess`); ``timed_out`` says that the agent killed it.
    """

    command: str | tuple[str, ...]
    exit_code: int
    stdout_bytes: bytes
    stderr_bytes: bytes
    duration_ms: float
    timed_out: bool = False

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", errors="replace")

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @property
    def command_line(self) -> str:
        """The command as one line a user could paste into a shell."""
        return self.command if isinstance(self.command, str) else shlex.join(self.command)

    def check(self) -> ExecResult:
        """Return self if the command succeeded; raise ExecError (ExecTimeout) otherwise."""
        if self.ok:
            return self
        error = ExecTimeout if self.timed_out else ExecError
        raise error(self._failure_message(), self)

    def record(self) -> ExecRecord:
        """A summary small enough to keep for every command of a test."""
        return ExecRecord(self.command_line, self.exit_code, self.duration_ms, self.timed_out)

    def _failure_message(self) -> str:
        message = f"command {self.command_line!r} {describe_outcome(self.exit_code, self.timed_out)}"
        for name, text in (("stderr", self.stderr), ("stdout", self.stdout)):
            tail = _tail(text)
            if tail:
                return f"{message}\n--- last lines of {name} ---\n{tail}"
        return f"{message} (no output)"

    def __repr__(self) -> str:
        parts = [
            f"command={self.command_line!r}",
            f"exit_code={self.exit_code}",
            f"stdout={_preview(self.stdout_bytes)}",
            f"stderr={_preview(self.stderr_bytes)}",
            f"duration_ms={self.duration_ms:.1f}",
        ]
        if self.timed_out:
            parts.append("timed_out=True")
        return f"ExecResult({', '.join(parts)})"


@dataclass(frozen=True)
class ExecRecord:
    """One line of a VM's command history, shown in the report of a failed test."""

    command: str
    exit_code: int
    duration_ms: float
    timed_out: bool = False

    def __str__(self) -> str:
        return f"$ {self.command}  # {describe_outcome(self.exit_code, self.timed_out)}, {self.duration_ms:.0f} ms"


def describe_outcome(exit_code: int, timed_out: bool = False) -> str:
    """Say in words how a command ended: 'exited with code 2', 'was killed by SIGSEGV'..."""
    if timed_out:
        return "timed out and was killed with its process group"
    if exit_code >= 0:
        return f"exited with code {exit_code}"
    try:
        name = signal.Signals(-exit_code).name
    except ValueError:
        name = f"signal {-exit_code}"
    return f"was killed by {name}"


def _tail(text: str) -> str:
    lines = text.rstrip("\n").splitlines()[-_TAIL_LINES:]
    tail = "\n".join(lines)
    return tail[-_TAIL_CHARS:]


def _preview(data: bytes) -> str:
    if len(data) <= _REPR_PREVIEW_BYTES:
        return repr(data.decode("utf-8", errors="replace"))
    return f"<{len(data)} bytes>"
