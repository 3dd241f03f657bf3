"""Running a command to its end: its cgroup, its stdin, its output streamed within credit, its timeout."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import select
import signal
import subprocess
import threading
import time

from .cgroups import CommandCgroups, _CommandGroup
from .common import (
    _PIPE_READ_SIZE,
    _PIPE_SIZE,
    _STDIN_WRITE_SIZE,
    CREDIT_STALL_TIMEOUT,
    KILL_WAIT,
    OUTPUT_DRAIN_AFTER_EXIT,
    RequestError,
    _current,
    no_input,
)
from .launch import start_command
from .streams import _OutputStream, _read_or_eio, _StreamCapture
from .terminal import _start_on_terminal
from .users import ROOT, Credentials

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .. import wire
else:
    try:
        from .. import wire
    except ImportError:  # in the guest: a top-level package beside wire.py
        import wire

if TYPE_CHECKING:
    from typing import IO, Any

# Shell words that are no program to look for.
_SHELL_WORDS = frozenset(
    "! { ( [ [[ . : alias bg break cd command continue echo eval exec exit export false fg for getopts hash "
    "if jobs kill let local printf pwd read readonly return set shift source test time times trap true type "
    "ulimit umask unalias unset until wait while case".split()
)


def _check_program(argv: list[str], env: Any, cwd: str | None) -> None:
    """Fail the request, naming the program, when the command's program does not exist.

    For ``/bin/sh -c SCRIPT`` the script's first word is looked up when it is
    a plain program name; anything more (builtins, assignments, quoting) is
    left to the shell.
    """
    name = argv[0]
    if argv[:2] == ["/bin/sh", "-c"] and len(argv) >= 3:
        words = argv[2].split(None, 1)
        if not words:
            return
        name = words[0]
        if name in _SHELL_WORDS or "=" in name or not all(c.isalnum() or c in "._-+/" for c in name):
            return
    path = env.get("PATH") or os.defpath
    if "/" in name:
        candidate = os.path.join(cwd, name) if cwd and not name.startswith("/") else name
        if not os.path.isfile(candidate):
            raise RequestError("CommandNotFound", f"{name}: no such program in the guest")
        if not os.access(candidate, os.X_OK):
            raise RequestError("CommandNotFound", f"{name}: the guest file is not executable")
        return
    for directory in path.split(os.pathsep):
        candidate = os.path.join(directory or ".", name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return
    raise RequestError("CommandNotFound", f"{name}: command not found in the guest (PATH={path})")


#: How the agent's own line starts when it cannot execute a command's program (its exit is then 126 or 127).
LAUNCH_ERROR_PREFIX = "forkd-exec: exec: "


class _CommandRun:
    __slots__ = ("captures", "duration_ms", "exit_code", "oom_killed", "timed_out")

    def __init__(
        self, exit_code: int, captures: list[_StreamCapture], duration_ms: float, timed_out: bool, oom_killed: bool
    ) -> None:
        self.exit_code = exit_code
        self.captures = captures
        self.duration_ms = duration_ms
        self.timed_out = timed_out
        self.oom_killed = oom_killed


def _run_command(
    argv: list[str],
    *,
    env: dict[str, Any] | None,
    cwd: str | None,
    stdin: bytes,
    timeout: float | None,
    stream: _OutputStream,
    max_output: int | None,
    cgroups: CommandCgroups | None,
    oom_target: bool,
    running: dict[int, _CommandCollector],
    terminal: tuple[int, int] | None = None,
    credentials: Credentials = ROOT,
) -> _CommandRun:
    """Run ``argv`` in a new session (and its own cgroup), streaming its stdout and stderr.

    ``terminal`` (rows, columns): run it on a new pseudo-terminal instead of
    pipes; what it writes to the terminal is its stdout, and ``stdin`` is typed in.
    """
    started = time.monotonic()
    captures = [_StreamCapture(wire.STDOUT, max_output), _StreamCapture(wire.STDERR, max_output)]
    group = cgroups.take() if cgroups is not None else None
    if group is not None:
        group.start()
    outputs: list[IO[bytes]] | None = None
    stdin_file: IO[bytes] | None = None
    try:
        try:
            masters: list[int] = []

            def start(command: list[str]) -> subprocess.Popen[bytes]:
                if terminal is not None:
                    process, master = _start_on_terminal(command, env, cwd, terminal)
                    masters.append(master)
                    return process
                return subprocess.Popen(
                    command,
                    stdin=subprocess.PIPE if stdin else no_input(),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    cwd=cwd,
                    env=env,
                    start_new_session=True,
                )

            try:
                process = start_command(
                    argv, start, group=group, cgroups=cgroups, credentials=credentials, oom_target=oom_target
                )
            except BaseException:
                for master in masters:
                    os.close(master)
                raise
            if masters:
                outputs = [os.fdopen(masters[0], "rb", buffering=0)]
                if stdin:
                    stdin_file = os.fdopen(os.dup(masters[0]), "wb", buffering=0)
        except OSError as exc:
            if exc.filename is None or exc.filename == cwd:
                raise  # could not fork or enter cwd: not the program's fault
            # Report it like a shell does, as the command's own failure.
            missing = isinstance(exc, FileNotFoundError)
            reason = "not found" if missing else exc.strerror
            message = captures[1].take(f"{LAUNCH_ERROR_PREFIX}{argv[0]}: {reason}\n".encode())
            exit_code = 127 if missing else 126
            if message:
                stream.send(wire.STDERR, message)
            return _CommandRun(exit_code, captures, (time.monotonic() - started) * 1000, False, False)
        collector = _CommandCollector(
            process, stdin, started, timeout, stream, captures, group, outputs=outputs, stdin_file=stdin_file
        )
        running[stream.request_id] = collector
        handling = getattr(_current, "running", None)
        if handling is not None:  # a cancel request for this exec kills its whole cgroup
            handling.attach(collector)
        try:
            exit_code, timed_out = collector.collect()
        finally:
            running.pop(stream.request_id, None)
        oom_killed = group.oom_killed() if group is not None else False
        if oom_killed and group is not None:
            # memory.oom.group kills the processes the group has at that instant; one forked
            # meanwhile (a fork bomb) lives on and the guest would spend itself in OOM kills.
            # cgroup.kill takes those too, so the reply can mean that all of it is gone.
            group.kill()
            group.wait_until_empty(KILL_WAIT)
        return _CommandRun(exit_code, captures, collector.duration_ms, timed_out, oom_killed)
    finally:
        if group is not None and cgroups is not None:
            cgroups.release(group)


class _CommandCollector:
    """Feeds a running command its stdin and streams its output until it exits.

    The stdin pipe, both output pipes, a pidfd of the command and the credit
    wake-up of the output stream are multiplexed with poll(), so no amount of
    output can deadlock. An output pipe is only read while the bytes read
    have somewhere to go: credit to send them, or the tail ring. At the
    deadline the command's cgroup (else its process group) is killed and the
    output captured so far is kept.
    """

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        stdin: bytes,
        started: float,
        timeout: float | None,
        stream: _OutputStream,
        captures: list[_StreamCapture],
        group: _CommandGroup | None,
        *,
        outputs: list[IO[bytes]] | None = None,
        stdin_file: IO[bytes] | None = None,
    ) -> None:
        self._process = process
        self._group = group
        self._stream = stream
        # The command's output files (its stdout and stderr pipes, or one terminal) and its stdin.
        if outputs is None:
            assert process.stdout is not None and process.stderr is not None  # pipes, as _run_command starts them
            outputs = [process.stdout, process.stderr]
            stdin_file = process.stdin
        self._outputs: list[IO[bytes]] = outputs
        self._stdin_file: IO[bytes] | None = stdin_file
        self._started = started
        self._deadline = None if timeout is None else started + timeout
        self._timed_out = False
        self._exited_at: float | None = None
        self._drain_left = OUTPUT_DRAIN_AFTER_EXIT
        self._blocked_since: float | None = None
        self._captures = {output.fileno(): capture for output, capture in zip(self._outputs, captures)}
        for fd in self._captures:
            os.set_blocking(fd, False)
            with contextlib.suppress(OSError):  # fewer, larger reads and frames
                fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _PIPE_SIZE)
        self._open_outputs = set(self._captures)
        self._pending_stdin = memoryview(stdin)
        self._stdin_fd: int | None = None
        if stdin:
            assert self._stdin_file is not None
            self._stdin_fd = self._stdin_file.fileno()
            os.set_blocking(self._stdin_fd, False)
        self._exit_fd = os.pidfd_open(process.pid)
        self.duration_ms = 0.0
        self._collected = False

    def kill(self) -> None:
        """Kill the command with everything it started (its cgroup, else its process group).

        Once the command's result is collected this does nothing: its cgroup
        may already serve the next command.
        """
        if self._collected:
            return
        if self._group is not None:
            self._group.kill()
        with contextlib.suppress(OSError):
            os.killpg(self._process.pid, signal.SIGKILL)

    def collect(self) -> tuple[int, bool]:
        """Return the exit code (negative: killed by that signal) and whether it timed out."""
        process = self._process
        try:
            self._poll_until_done()
            exit_code = process.wait()
        except BaseException:
            # Nobody will collect this command's result: do not leave it running.
            if process.returncode is None:
                self.kill()
                process.wait()
            raise
        finally:
            os.close(self._exit_fd)
            if self._stdin_fd is not None and self._stdin_file is not None:
                self._stdin_file.close()
            self._collected = True
        if self._timed_out and self._group is not None:
            # SIGKILL is delivered at once but thousands of processes take a while to go.
            self._group.wait_until_empty(KILL_WAIT)
        self._release_outputs()
        assert self._exited_at is not None  # _poll_until_done returns once the exit was seen
        self.duration_ms = (self._exited_at - self._started) * 1000
        return exit_code, self._timed_out

    def _poll_until_done(self) -> None:
        last = time.monotonic()
        while self._open_outputs or self._exited_at is None:
            poller = select.poll()
            if self._exited_at is None:
                poller.register(self._exit_fd, select.POLLIN)
            if self._stdin_fd is not None:
                poller.register(self._stdin_fd, select.POLLOUT)
            blocked = False
            room = self._stream.room
            for fd in self._open_outputs:
                if room <= 0 and self._captures[fd].needs_credit():
                    blocked = True
                else:
                    poller.register(fd, select.POLLIN)
            if blocked:
                poller.register(self._stream.wake_fd, select.POLLIN)
            now = time.monotonic()
            if self._exited_at is not None and not blocked:
                # The drain after exit only counts while output has somewhere to go.
                self._drain_left -= now - last
            last = now
            if not blocked:
                self._blocked_since = None
            elif self._blocked_since is None:
                self._blocked_since = now
            elif now - self._blocked_since >= CREDIT_STALL_TIMEOUT:
                self._stall()  # the host stopped giving credit: drop the rest
                continue
            wait = self._seconds_to_wait(now)
            if wait is not None and wait <= 0:
                if self._exited_at is not None:
                    return  # what is still open belongs to background processes
                self.kill()
                self._timed_out, self._deadline = True, None
                continue
            for fd, _events in poller.poll(None if wait is None else max(wait * 1000, 1)):
                if fd == self._exit_fd:
                    self._exited_at = time.monotonic()
                elif fd == self._stdin_fd:
                    self._feed_stdin()
                elif fd == self._stream.wake_fd:
                    self._stream.clear_wake()
                else:
                    self._read_output(fd)

    def _seconds_to_wait(self, now: float) -> float | None:
        """Time left until the output drain ends (after exit), the deadline or a credit stall; None: no limit."""
        limits = []
        if self._blocked_since is not None:
            limits.append(self._blocked_since + CREDIT_STALL_TIMEOUT - now)
        if self._exited_at is not None:
            if self._blocked_since is None:
                limits.append(self._drain_left)
        elif self._deadline is not None:
            limits.append(self._deadline - now)
        return min(limits) if limits else None

    def _stall(self) -> None:
        self._stream.stalled = True
        self._blocked_since = None
        for capture in self._captures.values():
            capture.discarding = True

    def _feed_stdin(self) -> None:
        assert self._stdin_fd is not None and self._stdin_file is not None  # polled only while stdin is open
        try:
            written = os.write(self._stdin_fd, self._pending_stdin[:_STDIN_WRITE_SIZE])
            self._pending_stdin = self._pending_stdin[written:]
        except BlockingIOError:
            return
        except BrokenPipeError:
            self._pending_stdin = self._pending_stdin[:0]  # the command stopped reading
        if not self._pending_stdin:
            self._stdin_file.close()
            self._stdin_fd = None

    def _read_output(self, fd: int) -> None:
        """Read what the pipe holds, up to one chunk (and the credit there is when it is to be sent)."""
        capture = self._captures[fd]
        limit = wire.OUTPUT_CHUNK_SIZE
        if capture.needs_credit():
            limit = min(limit, self._stream.room)
        parts = []
        got = 0
        end = False
        while got < limit:
            try:
                data = os.read(fd, limit - got)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno != errno.EIO:
                    raise
                data = b""  # a terminal whose last user left reads as EIO, not end of file
            if not data:
                end = True
                break
            parts.append(data)
            got += len(data)
        if got:
            send = capture.take(parts[0] if len(parts) == 1 else b"".join(parts))
            if send:
                self._stream.send(capture.fd_number, send)
        if end:
            self._open_outputs.discard(fd)

    def _release_outputs(self) -> None:
        """Close finished pipes; hand those that background processes still hold to a drain thread."""
        lingering: list[IO[bytes]] = []
        for stream in self._outputs:
            if stream.fileno() in self._open_outputs:
                lingering.append(stream)
            else:
                stream.close()
        if lingering:
            threading.Thread(target=_discard_until_eof, args=(lingering,), name="drain", daemon=True).start()


def _discard_until_eof(streams: list[IO[bytes]]) -> None:
    """Keep reading pipes held by a command's background processes, so they never hit SIGPIPE."""
    poller = select.poll()
    by_fd = {stream.fileno(): stream for stream in streams}
    for fd in by_fd:
        os.set_blocking(fd, True)
        poller.register(fd, select.POLLIN)
    while by_fd:
        for fd, _events in poller.poll():
            if not _read_or_eio(fd, _PIPE_READ_SIZE):
                poller.unregister(fd)
                by_fd.pop(fd).close()
