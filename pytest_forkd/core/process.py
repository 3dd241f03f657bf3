"""Live guest processes: what :meth:`VM.spawn <pytest_forkd.core.vm.VM.spawn>` returns.

A :class:`GuestProcess` is the host's handle of a process that runs in the
guest beyond the call that started it: a server a test starts, talks to and
stops, a REPL fed line by line, a shell on a terminal. Its output streams to
the host while it runs (``for line in proc.stdout``), its stdin stays open
(``write_stdin``), and ``wait``/``kill``/``returncode`` work as with
:class:`subprocess.Popen`.

Output is bounded on both sides, so a process that prints without end and
that nobody reads costs neither the guest nor the host more than a fixed
amount of memory, and never blocks on a full pipe:

- the host takes at most :data:`~pytest_forkd.guest.client.PROCESS_WINDOW`
  bytes per stream ahead of the reader (credit flow control; at most half of
  ``max_output``), plus the line being assembled (lines longer than
  ``max_output`` come in pieces);
- in the guest the agent reads the process's pipes at once and keeps what the
  host has not taken, at most ``max_output`` less that window per stream:
  the oldest unread half and the newest half. What falls between them is
  dropped, counted in ``stdout.skipped``/``stderr.skipped``, and
  ``truncated`` is set.

So what a reader gets of output it did not keep up with is at most
``max_output`` bytes per stream, as with ``exec``.

A server that follows many processes from an event loop does not read with
blocking calls: :meth:`GuestProcess.relay` hands every chunk and the end to a
:class:`ProcessSink` as they arrive, and the sink gives the credit back
(:meth:`ProcessOutput.consumed`) once it has passed a chunk on, so the same
bounds hold without a thread per stream.

The process lives in the guest, so it lives in every VM started from a
snapshot taken while it ran (``branch``, ``fork``, ``checkpoint``): the guest
memory with the process and the agent's bookkeeping of it are copied. The
child's host has no handle of it yet: ``child.process(pid)`` attaches one (it
sees the output written after the snapshot, plus what the guest still held
unread at that moment), and ``child.processes()`` lists them all.
"""

from __future__ import annotations

import collections
import signal as signal_module
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from pytest_forkd.errors import ForkdError, InvalidArgument, ProcessError, ProcessTimeout, VMError
from pytest_forkd.guest import wire
from pytest_forkd.guest.client import PROCESS_WINDOW, AgentTimeout, ChannelClosed, ProcessCall

if TYPE_CHECKING:
    from pytest_forkd.core.handles import VMHandle

T = TypeVar("T")

#: How long spawning waits for the agent to confirm that the process started.
START_TIMEOUT = 60.0


def output_bounds(max_output: int) -> tuple[int, int]:
    """Split ``max_output`` into (host window, guest buffer) per stream: what the host holds ahead of
    the reader counts toward the bound, and the guest keeps the rest."""
    window = max(1, min(PROCESS_WINDOW, max_output // 2))
    return window, max(max_output - window, 0)


class ProcessSink(Protocol):
    """Where :meth:`GuestProcess.relay` hands a process's output: called in the agent client's reader thread.

    Neither method may block or call back into the process; a sink passes
    things on (to an event loop, say) and returns.
    """

    def output(self, stream: ProcessOutput, data: bytes) -> None:
        """``data`` arrived on ``stream``; call ``stream.consumed(len(data))`` once it was passed on."""

    def finished(self, process: GuestProcess) -> None:
        """Everything arrived: ``process.returncode`` is its exit code, or None if its stream broke
        (``process.wait()`` then raises why: the VM died, was closed or restored)."""


class ProcessOutput:
    """One output stream (stdout or stderr) of a :class:`GuestProcess`: lines of bytes as they come.

    ``for line in proc.stdout`` yields each line with its ``b"\\n"``, blocking
    until the next line is complete, and ends when the stream ends (the
    process and everything it started closed it). :meth:`readline`,
    :meth:`read` and :meth:`read_chunk` take a ``timeout`` and raise
    :class:`~pytest_forkd.errors.ProcessTimeout` when it runs out (the
    data stays for the next read). Thread-safe; one reader at a time makes sense.
    """

    def __init__(self, process: GuestProcess, name: str, fd: int, max_line: int) -> None:
        self._process = process
        self.name = name
        self._fd = fd
        self._max_line = max(max_line, 1)
        self._condition = threading.Condition(threading.Lock())
        self._chunks: collections.deque[bytes] = collections.deque()
        self._partial = bytearray()
        self._ended = False
        self.skipped = 0
        """Bytes of this stream dropped in the guest because nobody read them in time."""
        self.total = 0
        """Bytes of this stream received so far."""
        self._relayed_credit = 0  # bytes handed to a sink that were already credited (see consumed)

    # -- fed by the agent client's reader thread ---------------------------------------
    def _feed(self, data: bytes, skipped: int, *, keep: bool = True) -> None:
        """Count what arrived; ``keep``: and keep it for the readers (not when a sink takes it)."""
        with self._condition:
            self.skipped += skipped
            self.total += len(data)
            if keep:
                if data:
                    self._chunks.append(data)
                self._condition.notify_all()

    def _end(self) -> None:
        with self._condition:
            if self._ended:
                return
            self._ended = True
            self._condition.notify_all()

    def _take_backlog(self) -> bytes:
        """What arrived and was not read yet, for a sink that takes over the stream (see GuestProcess.relay)."""
        with self._condition:
            data = bytes(self._partial) + b"".join(self._chunks)
            self._relayed_credit += len(self._partial)  # moved into _partial by a read, which credited it
            self._partial.clear()
            self._chunks.clear()
            return data

    def consumed(self, nbytes: int) -> None:
        """A :class:`ProcessSink` passed on ``nbytes`` of this stream: the guest may send as much more."""
        with self._condition:
            already = min(self._relayed_credit, nbytes)
            self._relayed_credit -= already
        if nbytes > already:
            self._process._credit(self._fd, nbytes - already)

    # -- reading ---------------------------------------------------------------------------
    @property
    def ended(self) -> bool:
        """Whether the stream ended and everything in it was read."""
        with self._condition:
            return self._ended and not self._chunks and not self._partial

    def __iter__(self) -> Iterator[bytes]:
        while True:
            line = self.readline()
            if not line:
                return
            yield line

    def readline(self, timeout: float | None = None) -> bytes:
        """The next line (with its newline; the last may lack it), or ``b""`` at the end of the stream."""
        return self._take(timeout, self._line)

    def readlines(self) -> list[bytes]:
        """Every line up to the end of the stream (``list(proc.stdout)``)."""
        return list(self)

    def read(self, timeout: float | None = None) -> bytes:
        """Everything up to the end of the stream (at most what the bounds keep)."""
        return self._take(
            timeout, lambda: bytes(self._partial) if self._ended and not self._chunks else None, whole=True
        )

    def read_chunk(self, timeout: float | None = None) -> bytes:
        """Whatever arrived and was not read yet, as soon as there is any; ``b""`` at the end of the stream.

        For relaying a terminal, where a prompt has no newline.
        """
        return self._take(timeout, lambda: bytes(self._partial) if self._partial else None)

    def _line(self) -> bytes | None:
        newline = self._partial.find(b"\n")
        if newline >= 0:
            return bytes(self._partial[: newline + 1])
        if len(self._partial) >= self._max_line:
            return bytes(self._partial[: self._max_line])
        return None

    def _take(self, timeout: float | None, pick: Callable[[], bytes | None], *, whole: bool = False) -> bytes:
        """Wait until ``pick`` finds something in the assembled bytes, or the stream ends."""
        credit = 0
        found: bytes | None = None
        try:
            with self._condition:
                deadline = None if timeout is None else time.monotonic() + timeout
                while True:
                    while self._chunks and (whole or pick() is None):
                        data = self._chunks.popleft()
                        self._partial += data
                        credit += len(data)
                    found = pick()
                    if found is not None:
                        del self._partial[: len(found)]
                        return found
                    if self._ended and not self._chunks:
                        found = bytes(self._partial)
                        self._partial.clear()
                        break
                    if credit:  # before waiting: the guest sends the rest only for credit
                        self._condition.release()
                        try:
                            self._process._credit(self._fd, credit)
                        finally:
                            self._condition.acquire()
                        credit = 0
                        continue  # what arrived (or the end) while the lock was released was notified to nobody
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise ProcessTimeout(
                            f"no {'end' if whole else 'line'} of the {self.name} of process {self._process.pid} "
                            f"({self._process.command_line!r}) within {timeout:g} s; it keeps running, and what "
                            "arrived stays for the next read"
                        )
                    self._condition.wait(left)
        finally:
            if credit:
                self._process._credit(self._fd, credit)
        # The stream ended: normally, or because the VM died or was closed (raised outside the lock).
        if found or self._process._ended_normally():
            return found
        self._process._raise_failure(f"reading the {self.name} of process {self._process.pid}")
        return b""

    def _unread(self, data: bytes) -> None:
        """Put ``data`` back in front (a read whose caller went away, such as a cancelled async read)."""
        if data:
            with self._condition:
                self._partial[:0] = data
                self._condition.notify_all()


class GuestProcess:
    """A process running in a guest, started by :meth:`VM.spawn` (or found by :meth:`VM.process`).

    ``pid`` is its pid in the guest; ``stdout``/``stderr`` are
    :class:`ProcessOutput` streams of lines; ``returncode`` is None while it
    runs, then its exit code (``-N`` when signal N killed it). Use it as a
    context manager to have it killed (SIGKILL, with everything it started
    in its process group) if it still runs when the block ends.
    """

    def __init__(
        self, vm: VMHandle, command: str | Sequence[str], *, pty: bool, max_output: int, window: int = PROCESS_WINDOW
    ) -> None:
        self._vm = vm
        self.command = command if isinstance(command, str) else tuple(command)
        self.pty = pty
        self.pid = 0
        self._window = window
        self.stdout = ProcessOutput(self, "stdout", wire.STDOUT, max_output)
        self.stderr = ProcessOutput(self, "stderr", wire.STDERR, max_output)
        self._returncode: int | None = None
        self._exited = threading.Event()
        self._call: ProcessCall | None = None
        self._detached: str | None = None
        self._sink: ProcessSink | None = None
        self._relay_lock = threading.Lock()
        self._ended = False
        self.truncated = False
        """Whether output was dropped because nobody read it in time (see ``skipped`` of each stream)."""

    # -- starting (VM.spawn, VM.process) ------------------------------------------------------
    def _start(self, request: dict[str, Any]) -> None:
        """Send the spawn request and wait until the guest started the process (or said why not)."""
        self._call = self._vm.agent.spawn(request, self, window=self._window)
        self.pid = self._call.wait_started(START_TIMEOUT)

    def _attach(self, pid: int) -> None:
        self._call = self._vm.agent.attach(pid, self, window=self._window)
        self.pid = self._call.wait_started(START_TIMEOUT)

    def relay(self, sink: ProcessSink) -> None:
        """Hand this process's output to ``sink`` as it arrives, and its end, instead of keeping it for reads.

        For a server that follows processes from an event loop: no thread
        waits on a read. What arrived before is handed over first, in order;
        once relayed, ``stdout``/``stderr`` read nothing more. The output
        stays bounded: the guest sends a stream's next chunks only as the
        sink reports what it passed on (:meth:`ProcessOutput.consumed`).
        """
        with self._relay_lock:
            if self._sink is not None:
                raise ProcessError(f"the output of process {self.pid} is relayed already")
            self._sink = sink
            for stream in (self.stdout, self.stderr):
                backlog = stream._take_backlog()
                if backlog:
                    sink.output(stream, backlog)
            if self._ended:
                sink.finished(self)

    # -- ProcessListener (the client's reader thread; must not block) -------------------------
    def on_output(self, fd: int, data: bytes, skipped: int) -> None:
        if skipped:
            self.truncated = True
        stream = self.stdout if fd == wire.STDOUT else self.stderr
        with self._relay_lock:
            sink = self._sink
            stream._feed(data, skipped, keep=sink is None)
            if sink is not None and data:
                sink.output(stream, data)

    def on_eof(self, fd: int) -> None:
        (self.stdout if fd == wire.STDOUT else self.stderr)._end()

    def on_exit(self, exit_code: int) -> None:
        self._returncode = exit_code
        self._exited.set()

    def on_end(self, call: ProcessCall) -> None:
        if call.complete and call.fields is not None and call.fields.get("truncated"):
            self.truncated = True
        self.stdout._end()
        self.stderr._end()
        self._exited.set()
        with self._relay_lock:
            self._ended = True
            sink = self._sink
            if sink is not None:
                sink.finished(self)

    # -- state -----------------------------------------------------------------------------
    @property
    def returncode(self) -> int | None:
        """None while the process runs; then its exit code, ``-N`` if signal N killed it."""
        return self._returncode

    @property
    def command_line(self) -> str:
        return self.command if isinstance(self.command, str) else " ".join(self.command)

    @property
    def vm(self) -> VMHandle:
        return self._vm

    def __repr__(self) -> str:
        state = "running" if self._returncode is None else f"exited {self._returncode}"
        return f"<GuestProcess {self.pid} {self.command_line!r} in {self._vm.name} {state}>"

    # -- operations ----------------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> int:
        """Wait until the process ends and return its exit code; its output need not have been read.

        Raises :class:`~pytest_forkd.errors.ProcessTimeout` after ``timeout``
        seconds (the process keeps running), and the VM's error if the guest
        died or the VM was closed or restored meanwhile.
        """
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0):
            raise InvalidArgument(f"timeout must be a number of seconds >= 0 or None, got {timeout!r}")
        if not self._exited.wait(timeout):
            raise ProcessTimeout(
                f"process {self.pid} ({self.command_line!r}) in VM {self._vm.name} is still running after "
                f"{timeout:g} s; it keeps running: kill() it, or wait longer"
            )
        if self._returncode is None:
            self._raise_failure(f"waiting for process {self.pid}")
        assert self._returncode is not None
        return self._returncode

    def poll(self) -> int | None:
        """The exit code if the process ended, else None (as :meth:`subprocess.Popen.poll`)."""
        return self._returncode

    def write_stdin(self, data: bytes | str) -> None:
        """Write ``data`` to the process's stdin; returns once the guest wrote it (the process may block it).

        On a terminal (``pty=True``) the bytes are typed: ``b"\\x03"`` is Ctrl-C.
        """
        if isinstance(data, str):
            data = data.encode()
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidArgument(f"write_stdin takes bytes or str, got {type(data).__name__}")
        self._request(
            f"writing to the stdin of process {self.pid}", self._vm.agent.process_stdin, self.pid, bytes(data)
        )

    def close_stdin(self) -> None:
        """End the process's input (on a terminal: type the end-of-file character, Ctrl-D)."""
        self._request(
            f"closing the stdin of process {self.pid}", self._vm.agent.process_stdin, self.pid, b"", close=True
        )

    def kill(self, sig: int = signal_module.SIGTERM) -> None:
        """Send ``sig`` (default SIGTERM) to the process and its process group; nothing if it already ended."""
        number = int(sig)
        if not 0 < number < 65:
            raise InvalidArgument(f"sig must be a signal number such as signal.SIGTERM, got {sig!r}")
        if self._returncode is not None:
            return
        entry = self._vm.transcript.record("signal", pid=self.pid, signal=_signal_name(number))
        delivered = self._request(f"signalling process {self.pid}", self._vm.agent.process_signal, self.pid, number)
        entry["delivered"] = delivered

    send_signal = kill

    def terminate(self) -> None:
        """SIGTERM, as :meth:`subprocess.Popen.terminate`."""
        self.kill(signal_module.SIGTERM)

    def resize(self, rows: int, columns: int) -> None:
        """Set the window size of the process's terminal (``pty=True``); its foreground job gets SIGWINCH."""
        for name, value in (("rows", rows), ("columns", columns)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
                raise InvalidArgument(f"{name} must be a number between 1 and 65535, got {value!r}")
        self._request(
            f"resizing the terminal of process {self.pid}", self._vm.agent.process_resize, self.pid, rows, columns
        )

    def __enter__(self) -> GuestProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._returncode is None and self._detached is None and not self._vm.closed:
            try:
                self.kill(signal_module.SIGKILL)
                self.wait(timeout=30)
            except ForkdError:
                pass

    # -- internals --------------------------------------------------------------------------
    def _request(self, what: str, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self._detached is not None:
            raise ProcessError(f"process {self.pid} cannot be used for {what}: {self._detached}")
        return self._vm._call(what, function, *args, **kwargs)

    def _credit(self, fd: int, nbytes: int) -> None:
        if self._call is not None:
            self._call.credit(fd, nbytes)

    def _detach(self, reason: str) -> None:
        """This handle no longer follows the process (the VM was restored to a snapshot)."""
        self._detached = reason
        if self._call is not None and not self._call.done.is_set():
            self._call.fail(ProcessError(f"process {self.pid} is no longer followed: {reason}"))

    @property
    def _finished(self) -> bool:
        """Whether the guest has forgotten the process: it ended and everything it wrote was delivered."""
        return self._call is not None and self._call.done.is_set()

    def _ended_normally(self) -> bool:
        call = self._call
        return call is None or not call.done.is_set() or call.complete

    def _raise_failure(self, what: str) -> None:
        """Raise why the process's stream ended early, as the VM would (GuestCrashed if the guest died)."""
        call = self._call
        error = call.early_end() if call is not None else None
        if self._detached is not None:
            raise ProcessError(f"process {self.pid} cannot be used for {what}: {self._detached}")
        if isinstance(error, (ChannelClosed, AgentTimeout)):
            if self._vm.closed:
                raise VMError(f"VM {self._vm.name} was closed while {what}") from None

            def fail() -> None:
                raise error

            self._vm._call(what, fail)  # turns it into GuestCrashed with the console tail, closes the VM
        if error is not None:
            raise error
        raise ProcessError(f"the output stream of process {self.pid} ended before the process did ({what})")


def _signal_name(number: int) -> str:
    try:
        return signal_module.Signals(number).name
    except ValueError:
        return f"signal {number}"
