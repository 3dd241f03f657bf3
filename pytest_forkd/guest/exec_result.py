"""The outcome of one command run in a guest."""

from __future__ import annotations

import shlex
import signal
from dataclasses import dataclass

from pytest_forkd.errors import ExecError, ExecTimeout

# How much output an error message or a repr shows: enough to see what went
# wrong, never megabytes.
_TAIL_LINES = 20
_TAIL_CHARS = 2000
_REPR_PREVIEW_BYTES = 60
#: What a timed-out command's :attr:`ExecResult.exit_status` (and ``forkd exec``) says.
TIMEOUT_EXIT_STATUS = 124


@dataclass(frozen=True, repr=False)
class ExecResult:
    """What a guest command produced.

    ``command`` is what was asked for: a shell string, or the argv as a tuple.

    Exit codes follow one convention, here and on the ``forkd exec`` command
    line: ``exit_code`` is the command's own status (0-255), or ``-N`` when
    signal ``N`` killed it, like :mod:`subprocess`; then ``signal`` is ``N``.
    ``timed_out``: the agent killed it (with its whole cgroup) at the
    timeout; ``oom_killed``: the out-of-memory killer ended it.
    :attr:`exit_status` folds all of that into the one number a shell would
    show, which ``forkd exec`` exits with.

    ``truncated``: a stream was longer than ``max_output``; its first and last
    halves of ``max_output`` are kept and the middle is dropped.
    """

    command: str | tuple[str, ...]
    exit_code: int
    stdout_bytes: bytes
    stderr_bytes: bytes
    duration_ms: float
    timed_out: bool = False
    truncated: bool = False
    oom_killed: bool = False
    signal: int | None = None

    def __post_init__(self) -> None:
        if self.signal is None and self.exit_code < 0:
            object.__setattr__(self, "signal", -self.exit_code)

    @property
    def exit_status(self) -> int:
        """The shell's view: 124 for a timeout (as coreutils ``timeout``), 128+N for signal N, else the code."""
        if self.timed_out:
            return TIMEOUT_EXIT_STATUS
        if self.signal is not None:
            return 128 + self.signal
        return self.exit_code

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

    def _failure_message(self) -> str:
        message = f"command {self.command_line!r} {describe_outcome(self.exit_code, self.timed_out, self.oom_killed)}"
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
        for flag in ("timed_out", "oom_killed", "truncated"):
            if getattr(self, flag):
                parts.append(f"{flag}=True")
        return f"ExecResult({', '.join(parts)})"


def describe_outcome(exit_code: int, timed_out: bool = False, oom_killed: bool = False) -> str:
    """Say in words how a command ended: 'exited with code 2', 'was killed by SIGSEGV'..."""
    if timed_out:
        return "timed out and was killed with everything it started"
    if oom_killed:
        return "ran out of memory and was killed by the out-of-memory killer (give the VM more memory)"
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
