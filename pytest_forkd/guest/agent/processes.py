"""Processes started by ``spawn``: they outlive their request, and their output waits for a host to attach."""

from __future__ import annotations

import collections
import contextlib
import fcntl
import os
import select
import signal
import subprocess
import threading
import time

from .cgroups import CommandCgroups, _CommandGroup
from .commands import _discard_until_eof
from .common import (
    _PIPE_READ_SIZE,
    _PIPE_SIZE,
    _STDIN_WRITE_SIZE,
    OUTPUT_DRAIN_AFTER_EXIT,
    RequestError,
    log_to_stderr,
    no_input,
)
from .launch import start_command
from .streams import _LiveBuffer, _read_or_eio
from .terminal import _set_window_size, _start_on_terminal
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
    from collections.abc import Callable, Sequence
    from typing import Any

#: Longest the pump waits, once a process's output ended, for the process itself to end (see _Spawned._linger).
EXIT_LINGER = 0.01


class _Spawned:
    """A process started by ``spawn``: it outlives the request, and its output waits (bounded) for a reader.

    The agent's :class:`_ProcessPump` reads its stdout and stderr (or its
    terminal) as soon as anything arrives, so the process never blocks on a
    full pipe, and keeps what no host has taken in a :class:`_LiveBuffer` per
    stream: at most ``max_output`` bytes, the oldest unread half and the
    newest half, counting what was dropped between them. A host *attaches* with a request
    (``attach``) that then streams: output within per-stream credit, one
    ``exited`` frame as soon as the process ends, ``eof`` per stream, and the
    final frame once everything was delivered; then the agent forgets the
    process. Attaching again (a VM forked from a snapshot of this one, whose
    host knows nothing of the old request) moves the stream to the new
    request; a request from a new host client drops the old attachment at once.
    """

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        command: list[str],
        outputs: dict[int, int],
        stdin_fd: int | None,
        terminal_fd: int | None,
        group: _CommandGroup | None,
        cgroups: CommandCgroups | None,
        max_output: int,
        send_frames: Callable[[Sequence[tuple[dict[str, Any], bytes | memoryview]]], None],
        finished: Callable[[_Spawned], None],
        pump: _ProcessPump,
    ) -> None:
        self.pid = process.pid
        self.command = command
        self._process = process
        self._open = dict(outputs)  # fd -> stream number, while it may still be read
        self._stdin_fd = stdin_fd
        self._terminal_fd = terminal_fd
        self._owned_fds = set(outputs) | {fd for fd in (stdin_fd, terminal_fd) if fd is not None}
        self._group = group
        self._cgroups = cgroups
        self._send_frames = send_frames
        self._finished = finished
        self._buffers = {wire.STDOUT: _LiveBuffer(max_output), wire.STDERR: _LiveBuffer(max_output)}
        self._closed_streams = {wire.STDOUT, wire.STDERR} - set(outputs.values())
        self._lock = threading.Lock()
        self._stdin_lock = threading.Lock()
        self._attachment: _Attachment | None = None
        self._replaced: list[_Attachment] = []
        self.exit_code: int | None = None
        self._exited_at: float | None = None
        self._pump = pump
        self._exit_fd = os.pidfd_open(process.pid)
        for fd in self._owned_fds:
            os.set_blocking(fd, False)
        pump.follow(self)

    @classmethod
    def start(
        cls,
        argv: list[str],
        *,
        env: dict[str, str] | None,
        cwd: str | None,
        terminal: tuple[int, int] | None,
        max_output: int,
        cgroups: CommandCgroups | None,
        oom_target: bool,
        send_frames: Callable[[Sequence[tuple[dict[str, Any], bytes | memoryview]]], None],
        finished: Callable[[_Spawned], None],
        pump: _ProcessPump,
        credentials: Credentials = ROOT,
        stdin: bool = True,
    ) -> _Spawned:
        """Start ``argv`` in a new session and its own cgroup, on pipes or on a new terminal.

        ``stdin=False``: the process reads end-of-file at once (no pipe to write to); a terminal always has input.
        """
        group = cgroups.take() if cgroups is not None else None
        child_ends: list[int] = []
        ours: list[int] = []
        try:
            if terminal is None:
                stdin_fd: int | None = None
                child_stdin = no_input()
                if stdin:
                    child_stdin, stdin_fd = os.pipe2(os.O_CLOEXEC)
                    child_ends.append(child_stdin)
                    ours.append(stdin_fd)
                stdout_fd, stdout_write = os.pipe2(os.O_CLOEXEC)
                stderr_fd, stderr_write = os.pipe2(os.O_CLOEXEC)
                child_ends += [stdout_write, stderr_write]
                ours += [stdout_fd, stderr_fd]
                for fd in (stdout_fd, stderr_fd):
                    with contextlib.suppress(OSError):
                        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _PIPE_SIZE)

                def start(command: list[str]) -> subprocess.Popen[bytes]:
                    return subprocess.Popen(
                        command,
                        stdin=child_stdin,
                        stdout=stdout_write,
                        stderr=stderr_write,
                        cwd=cwd,
                        env=env,
                        start_new_session=True,
                    )

                outputs = {stdout_fd: wire.STDOUT, stderr_fd: wire.STDERR}
                terminal_fd = None
            else:
                stdin_fd = None

                def start(command: list[str]) -> subprocess.Popen[bytes]:
                    process, master = _start_on_terminal(command, env, cwd, terminal)
                    ours.append(master)
                    return process

            process = start_command(
                argv, start, group=group, cgroups=cgroups, credentials=credentials, oom_target=oom_target
            )
            if terminal is not None:
                terminal_fd = ours[-1]
                outputs = {terminal_fd: wire.STDOUT}
        except BaseException:
            for fd in ours:
                os.close(fd)
            if group is not None and cgroups is not None:
                cgroups.release(group)
            raise
        finally:
            for fd in child_ends:
                os.close(fd)
        return cls(
            process, argv, outputs, stdin_fd, terminal_fd, group, cgroups, max_output, send_frames, finished, pump
        )

    # -- requests (handler and reader threads) ---------------------------------------------------

    def describe(self) -> dict[str, Any]:
        return {"pid": self.pid, "command": self.command, "exit_code": self.exit_code}

    def attach(self, request_id: int, client: str | None, window: int) -> None:
        """Stream the output to ``request_id`` from now on, naming the process to it in the first frame.

        The switch and that frame happen under the lock that every flush takes:
        a host may write to the process the moment it reads the frame, and
        what the process answers must go to this request, after the frame,
        never to the one it replaced.
        """
        with self._lock:
            if self._attachment is not None:
                self._replaced.append(self._attachment)
            self._attachment = _Attachment(request_id, client, window)
            self._send_frames([({"id": request_id, "more": True, "pid": self.pid}, b"")])
        self._wake()

    def drop_attachments_except(self, client: str) -> None:
        """Forget an attachment of another host client, silently: nobody waits for its frames any more."""
        with self._lock:
            if self._attachment is not None and self._attachment.client != client:
                self._attachment = None
            self._replaced = [old for old in self._replaced if old.client == client]

    def add_credit(self, request_id: int, fd_number: object, nbytes: int) -> None:
        with self._lock:
            attachment = self._attachment
            if attachment is None or attachment.request_id != request_id:
                return
            for number in (wire.STDOUT, wire.STDERR) if fd_number is None else (fd_number,):
                if number in attachment.credit:
                    attachment.credit[number] += nbytes
        self._wake()

    def write_stdin(self, data: bytes, *, close: bool) -> int:
        """Write ``data`` to the process's stdin (blocks while it does not read); ``close``: then end it.

        On a terminal, ending input means typing the end-of-file character (Ctrl-D).
        """
        with self._stdin_lock:
            fd = self._stdin_fd if self._terminal_fd is None else self._terminal_fd
            if fd is None:
                raise RequestError("StdinClosed", f"the stdin of process {self.pid} was already closed")
            view = memoryview(data + (b"\x04" if close and self._terminal_fd is not None else b""))
            while view:
                poller = select.poll()
                poller.register(fd, select.POLLOUT)
                poller.register(self._exit_fd, select.POLLIN)
                events = dict(poller.poll())
                if fd not in events:
                    if self.exit_code is not None or self._exit_fd in events:
                        raise RequestError("BrokenPipe", f"process {self.pid} ended before reading its stdin")
                    continue
                try:
                    view = view[os.write(fd, view[:_STDIN_WRITE_SIZE]) :]
                except BlockingIOError:
                    continue
                except (BrokenPipeError, OSError) as exc:
                    raise RequestError("BrokenPipe", f"process {self.pid} no longer reads its stdin ({exc})") from None
            if close and self._terminal_fd is None:
                self._stdin_fd = None
                os.close(fd)
                self._owned_fds.discard(fd)
        return len(data)

    def send_signal(self, number: int) -> bool:
        """Signal the process's group (it leads its own session); False if it already ended."""
        if self.exit_code is not None:
            return False
        try:
            os.killpg(self.pid, number)
        except ProcessLookupError:
            try:
                os.kill(self.pid, number)
            except ProcessLookupError:
                return False
        return True

    def resize(self, size: tuple[int, int]) -> None:
        """Set the terminal's window size; the kernel sends SIGWINCH to its foreground job."""
        if self._terminal_fd is None:
            raise RequestError("NoTerminal", f"process {self.pid} does not run on a terminal (spawn it with pty=True)")
        _set_window_size(self._terminal_fd, size)

    def _wake(self) -> None:
        self._pump.wake(self)

    # -- followed by the pump thread -----------------------------------------------------------------

    def watched(self) -> list[int]:
        """The descriptors the pump polls for this process: its exit while it runs, its open outputs."""
        return ([self._exit_fd] if self.exit_code is None else []) + list(self._open)

    def drain_left(self, now: float) -> float | None:
        """Seconds left to read what background processes still write after the process ended, else None."""
        if self._exited_at is None or not self._open:
            return None
        return self._exited_at + OUTPUT_DRAIN_AFTER_EXIT - now

    def ready(self, fd: int) -> None:
        """``fd`` (one of :meth:`watched`) has something: the exit, or output."""
        if fd == self._exit_fd:
            self.exit_code = self._process.wait()
            self._exited_at = time.monotonic()
        elif fd in self._open:
            self._read(fd)
            if fd not in self._open and self.exit_code is None:
                self._linger()

    def _linger(self) -> None:
        """An output ended, most often because the process is ending: wait a moment for the rest of that.

        On the guest's one CPU the pump, woken by each stream's end, would
        otherwise run between the process's closing of its stdout, of its
        stderr and its exit, and send a frame for each; waiting here lets the
        process finish, and the ends and the exit go out together. At most
        :data:`EXIT_LINGER` s, during which the pump follows no other process.
        """
        deadline = time.monotonic() + EXIT_LINGER
        while self.exit_code is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            poller = select.poll()
            for fd in [self._exit_fd, *self._open]:
                poller.register(fd, select.POLLIN)
            for fd, _events in poller.poll(max(left * 1000, 1)):
                if fd == self._exit_fd:
                    self.exit_code = self._process.wait()
                    self._exited_at = time.monotonic()
                elif fd in self._open:
                    self._read(fd)

    def advance(self, now: float) -> bool:
        """Give up outputs whose drain ran out, send what the attachment has credit for; True once done."""
        left = self.drain_left(now)
        if left is not None and left <= 0:
            self._give_up_outputs()
        if self.exit_code is None and not self._open:
            # Its outputs closed, most often because it ended: its exit goes out with their ends, in one write.
            returncode = self._process.poll()
            if returncode is not None:
                self.exit_code, self._exited_at = returncode, now
        return self._flush()

    def _read(self, fd: int) -> None:
        data = _read_or_eio(fd, _PIPE_READ_SIZE)
        number = self._open[fd]
        if data is None:
            return
        if not data:
            del self._open[fd]
            self._closed_streams.add(number)
            if fd != self._terminal_fd:
                os.close(fd)
                self._owned_fds.discard(fd)
            return
        with self._lock:
            self._buffers[number].add(data)

    def _give_up_outputs(self) -> None:
        """After the process ended: what its background processes still write is drained and discarded."""
        lingering = []
        for fd, number in self._open.items():
            self._closed_streams.add(number)
            if fd != self._terminal_fd:
                lingering.append(os.fdopen(fd, "rb", buffering=0))
                self._owned_fds.discard(fd)
        self._open.clear()
        if lingering:
            threading.Thread(target=_discard_until_eof, args=(lingering,), name="drain", daemon=True).start()

    def _flush(self) -> bool:
        """Send what the attachment has credit for; True once the final frame went out."""
        frames: list[tuple[dict[str, Any], bytes]] = []
        done = False
        with self._lock:
            replaced, self._replaced = self._replaced, []
            for old in replaced:
                frames.append(
                    (
                        {
                            "id": old.request_id,
                            "error": {"type": "Detached", "message": f"another request attached to process {self.pid}"},
                        },
                        b"",
                    )
                )
            attachment = self._attachment
            if attachment is not None:
                request_id = attachment.request_id
                endings = 0  # end-of-stream and exit frames this flush added (the last frames so far)
                for number, buffer in self._buffers.items():
                    while attachment.credit[number] > 0 and buffer.size:
                        chunk, skipped = buffer.take(min(attachment.credit[number], wire.OUTPUT_CHUNK_SIZE))
                        attachment.credit[number] -= len(chunk)
                        extra = {"skipped": skipped} if skipped else {}
                        frames.append(({"id": request_id, "more": True, "fd": number, **extra}, chunk))
                        endings = 0
                    if not buffer.size and number in self._closed_streams and number not in attachment.eof_sent:
                        attachment.eof_sent.add(number)
                        frames.append(({"id": request_id, "more": True, "fd": number, "eof": True}, b""))
                        endings += 1
                if self.exit_code is not None and not attachment.exit_sent:
                    attachment.exit_sent = True
                    frames.append(({"id": request_id, "more": True, **self._exit_fields()}, b""))
                    endings += 1
                if attachment.exit_sent and len(attachment.eof_sent) == 2:
                    # The final frame says all of it (both streams ended, and the exit): the frames
                    # that said it just before it in this same write are left out.
                    del frames[len(frames) - endings :]
                    stdout, stderr = self._buffers[wire.STDOUT], self._buffers[wire.STDERR]
                    frames.append(
                        (
                            {
                                "id": request_id,
                                **self._exit_fields(),
                                "truncated": bool(stdout.dropped or stderr.dropped),
                                "stdout_total": stdout.total,
                                "stderr_total": stderr.total,
                            },
                            b"",
                        )
                    )
                    self._attachment = None
                    done = True
        if frames:
            self._send_frames(frames)
        return done

    def _exit_fields(self) -> dict[str, Any]:
        code = self.exit_code
        return {"exited": True, "exit_code": code, "signal": -code if code is not None and code < 0 else None}

    def abandon(self, reason: str) -> None:
        """Following the process failed: its stream ends with an error (the pump then kills it)."""
        with self._lock:
            attachment, self._attachment = self._attachment, None
        if attachment is not None:
            error = {"type": "InternalError", "message": f"the agent stopped following process {self.pid}: {reason}"}
            self._send_frames([({"id": attachment.request_id, "error": error}, b"")])

    def clean_up(self) -> None:
        """The pump is done with the process (it ended and all was delivered, or following it failed)."""
        self._finished(self)
        for fd in self._owned_fds | {self._exit_fd}:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._owned_fds.clear()
        if self.exit_code is None:  # the pump failed: do not leave an unreachable process behind
            with contextlib.suppress(OSError):
                os.killpg(self.pid, signal.SIGKILL)
            self._process.wait()
        if self._group is not None and self._cgroups is not None:
            self._cgroups.release(self._group)


class _ProcessPump:
    """The one thread that starts spawned processes and follows them all: their output, exit and frames.

    A spawn request is short (a vfork and an exec), so it runs here
    (:meth:`run`) rather than on a thread of its own, and every process is
    followed from one ``poll`` loop rather than by a thread of its own. Under
    TCG a thread start costs ~2.5 ms of the guest's one CPU, which the new
    process wants at that moment too: two of them made a spawn's first frame
    come ~10 ms after the process had started. The thread starts with the
    first spawn. A process whose following fails is killed and forgotten; the
    others go on.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._followed: list[_Spawned] = []
        self._due: set[_Spawned] = set()
        self._jobs: collections.deque[Callable[[], None]] = collections.deque()
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread: threading.Thread | None = None
        self._serving_ident: int | None = None
        self._look_again = False  # set by the pump's own thread instead of writing to the wake-up pipe
        self._closing = False

    def run(self, job: Callable[[], None]) -> None:
        """Run ``job`` (a spawn request's handler, which answers it) on the pump thread, in turn."""
        with self._lock:
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="process-pump", daemon=True)
                self._thread.start()
        self._signal()

    def follow(self, spawned: _Spawned) -> None:
        with self._lock:
            self._followed.append(spawned)
            self._due.add(spawned)
        self._signal()

    def wake(self, spawned: _Spawned) -> None:
        """Something changed for ``spawned`` outside the pump (an attachment, credit): flush it."""
        with self._lock:
            self._due.add(spawned)
        self._signal()

    def close(self) -> None:
        """The agent stops serving: the thread ends once the processes it follows have ended."""
        with self._lock:
            self._closing = True
            if self._thread is None:
                self._close_pipe()
                return
        self._signal()

    def _signal(self) -> None:
        if threading.get_ident() == self._serving_ident:
            # A spawn running on the pump (it follows the new process, attaches its request): the pump
            # looks again before it waits, without a write and a read of the pipe.
            self._look_again = True
            return
        with self._lock:  # never a write to a descriptor number the pump has closed (and the system reused)
            if self._wake_write >= 0:
                with contextlib.suppress(BlockingIOError, OSError):
                    os.write(self._wake_write, b"w")

    def _close_pipe(self) -> None:
        """Under the lock: the wake-up pipe goes with the thread."""
        for fd in (self._wake_read, self._wake_write):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_read = self._wake_write = -1

    def _serve(self) -> None:
        self._serving_ident = threading.get_ident()
        while True:
            with self._lock:
                jobs = list(self._jobs)
                self._jobs.clear()
            for job in jobs:
                try:
                    job()
                except Exception as exc:  # noqa: BLE001 - a job answers its request itself; the pump goes on
                    log_to_stderr(f"a spawn request failed on the process pump: {exc!r}")
            with self._lock:
                followed = list(self._followed)
                if self._closing and not followed and not self._jobs:
                    self._thread = None
                    self._serving_ident = None
                    self._close_pipe()
                    return
            poller = select.poll()
            poller.register(self._wake_read, select.POLLIN)
            owners: dict[int, _Spawned] = {}
            now = time.monotonic()
            wait: float | None = None
            for spawned in followed:
                for fd in spawned.watched():
                    poller.register(fd, select.POLLIN)
                    owners[fd] = spawned
                left = spawned.drain_left(now)
                if left is not None:
                    wait = left if wait is None else min(wait, left)
            if self._look_again:
                self._look_again = False
                wait = 0.0
            touched: set[_Spawned] = set()
            for fd, _events in poller.poll(None if wait is None else max(wait * 1000, 0)):
                if fd == self._wake_read:
                    with contextlib.suppress(BlockingIOError, OSError):
                        os.read(self._wake_read, 4096)
                elif fd in owners:
                    self._step(owners[fd], owners[fd].ready, fd)
                    touched.add(owners[fd])
            now = time.monotonic()
            with self._lock:
                touched |= self._due
                self._due = set()
            for spawned in followed:
                left = spawned.drain_left(now)
                if left is not None and left <= 0:
                    touched.add(spawned)
            for spawned in touched:
                if self._step(spawned, spawned.advance, now):
                    self._forget(spawned)

    def _step(self, spawned: _Spawned, action: Callable[..., bool | None], *args: Any) -> bool:
        """``action(*args)`` of a followed process; one that fails is killed and forgotten (True: it is done)."""
        with self._lock:
            if spawned not in self._followed:
                return False
        try:
            return bool(action(*args))
        except Exception as exc:  # noqa: BLE001 - one broken process must neither stop the others nor be left running
            log_to_stderr(f"following process {spawned.pid} failed: {exc!r}")
            with contextlib.suppress(Exception):
                spawned.abandon(repr(exc))
            self._forget(spawned)
            return False

    def _forget(self, spawned: _Spawned) -> None:
        with self._lock:
            if spawned not in self._followed:
                return
            self._followed.remove(spawned)
            self._due.discard(spawned)
        spawned.clean_up()


class _Attachment:
    """The request a spawned process's output streams to, and the credit it has per stream."""

    __slots__ = ("client", "credit", "eof_sent", "exit_sent", "request_id")

    def __init__(self, request_id: int, client: str | None, window: int) -> None:
        self.request_id = request_id
        self.client = client
        self.credit = {wire.STDOUT: window, wire.STDERR: window}
        self.eof_sent: set[int] = set()
        self.exit_sent = False
