"""What every part of the agent shares: limits, request errors, field parsing, writing frames."""

from __future__ import annotations

import os
import sys
import threading
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any

# How long the agent keeps collecting output after a command's first process
# exited while background processes still hold its stdout or stderr open.
OUTPUT_DRAIN_AFTER_EXIT = 0.1
# How long a cancel request waits for the cancelled request to finish (its
# command killed and reaped, its reply sent) before answering anyway.
CANCEL_WAIT = 5.0
# A virtio port reads as end of stream while nothing is connected on the host
# side, and cannot be waited on (poll reports a hang-up): retry at this pace.
RECONNECT_POLL_INTERVAL = 0.05

# If the host gives no credit for this long, a command's remaining output is dropped.
CREDIT_STALL_TIMEOUT = 60.0
# The largest tail ring the agent keeps per stream; past it the host keeps the tail.
AGENT_TAIL_LIMIT = 4 << 20
# The largest credit window a request may ask for.
MAX_OUTPUT_WINDOW = 64 << 20
CGROUP_ROOT = "/sys/fs/cgroup"
# The agent's own cgroup below CGROUP_ROOT, beside ``forkd`` (whose groups are the commands').
AGENT_CGROUP = "forkd-agent"
# How long a timeout waits for the killed command's cgroup to empty.
KILL_WAIT = 10.0
# Processes one command may have at a time (a fork bomb stops here).
COMMAND_PIDS_MAX = 1024
# Commands are the out-of-memory killer's preferred victims (the agent is at -1000).
COMMAND_OOM_SCORE_ADJ = 500
# The CPU weight of the agent's cgroup (commands' groups have the default, 100): see cgroups.py.
AGENT_CPU_WEIGHT = 10000
# Memory left to the agent and the kernel when commands are capped: this or
# 1/8 of the guest's memory, whichever is larger.
AGENT_MEMORY_RESERVE = 24 << 20
MIN_COMMAND_MEMORY = 16 << 20
# Empty command cgroups kept for reuse.
_FREE_GROUPS = 4

_PIPE_READ_SIZE = 256 * 1024
_PIPE_SIZE = 1 << 20
_STDIN_WRITE_SIZE = 64 * 1024
# Buffers one writev() takes (the kernel's IOV_MAX).
_IOV_MAX = 1024


class RequestError(Exception):
    """A request cannot be served; becomes an error reply of the given type."""

    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(message)
        self.error_type = error_type


def set_wall_clock(seconds: float) -> None:
    """Set CLOCK_REALTIME; needs CAP_SYS_TIME, which the agent has as root in the guest."""
    time.clock_settime(time.CLOCK_REALTIME, seconds)


def mix_into_urandom(seed: bytes) -> None:
    """Stir host-provided bytes into the kernel pool so restored siblings diverge."""
    with open("/dev/urandom", "wb") as pool:
        pool.write(seed)


def _leave_clock_alone(seconds: float) -> None:
    pass


_devnull_lock = threading.Lock()
_devnull_fd = -1


def no_input() -> int:
    """What a command without input gets as stdin: /dev/null, opened once and kept.

    ``subprocess.DEVNULL`` opens and closes it for every command, which in an
    emulated guest is a cost on every start. Falls back to that where the
    guest has no /dev/null.
    """
    global _devnull_fd
    with _devnull_lock:
        if _devnull_fd < 0:
            try:
                _devnull_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                import subprocess

                return subprocess.DEVNULL
        return _devnull_fd


def log_to_stderr(message: str) -> None:
    print(f"forkd-agent: {message}", file=sys.stderr, flush=True)


# The request a handler thread serves, so a command it starts can be cancelled.
_current = threading.local()


def _tarstream() -> Any:
    """The tar stream module, imported on first use (every import costs in an emulated guest)."""
    if TYPE_CHECKING:
        from .. import tarstream
    else:
        try:
            from .. import tarstream
        except ImportError:  # in the guest: beside this package
            import tarstream
    return tarstream


def _command_argv(fields: dict[str, Any]) -> list[str]:
    argv = fields.get("argv")
    shell = fields.get("shell")
    if (argv is None) == (shell is None):
        raise RequestError("BadRequest", "an exec request needs exactly one of 'argv' and 'shell'")
    if shell is not None:
        if not isinstance(shell, str):
            raise RequestError("BadRequest", "'shell' must be a string")
        return ["/bin/sh", "-c", shell]
    if not isinstance(argv, list) or not argv or not all(isinstance(arg, str) for arg in argv):
        raise RequestError("BadRequest", "'argv' must be a non-empty list of strings")
    return argv


def _required(fields: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = fields.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise RequestError("BadRequest", f"{fields['op']!r} needs {name!r} of type {_kind_name(kind)}")
    return value


def _optional(fields: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    if fields.get(name) is None:
        return None
    return _required(fields, name, kind)


def _request_env(fields: dict[str, Any]) -> dict[str, str] | None:
    """A request's ``env`` merged over the agent's own environment (None: inherit it unchanged)."""
    env = _optional(fields, "env", dict)
    if env is None:
        return None
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise RequestError("BadRequest", "'env' must map strings to strings")
    return {**os.environ, **env}


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _os_error_fields(exc: OSError, path: str | None = None) -> dict[str, Any]:
    path = exc.filename if exc.filename is not None else path
    message = exc.strerror or str(exc)
    return {
        "type": type(exc).__name__,
        "message": f"{path}: {message}" if path is not None else message,
        "errno": exc.errno,
        "path": path,
    }


def _with_path(exc: OSError, path: str) -> OSError:
    """The same error, naming the destination instead of the temporary file."""
    return type(exc)(exc.errno, exc.strerror, path)


def _write_frame(fd: int, header: bytes, payload: bytes | memoryview) -> None:
    """Write a frame with one system call when the channel takes it whole (each one costs under emulation)."""
    if not payload:
        _write_all(fd, header)
        return
    written = os.writev(fd, [header, payload])
    if written < len(header):
        _write_all(fd, header[written:])
        written = len(header)
    _write_all(fd, memoryview(payload)[written - len(header) :])


def _write_frames(fd: int, parts: Sequence[bytes | memoryview]) -> None:
    """Write several frames' headers and payloads, in order, with as few system calls as the channel allows."""
    views = [memoryview(part) for part in parts if len(part)]
    while views:
        written = os.writev(fd, views[:_IOV_MAX])
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
