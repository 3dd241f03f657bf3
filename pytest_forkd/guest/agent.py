"""The guest agent: runs commands and moves files for the host over one byte stream.

It runs inside the guest from ``/opt/forkd``, next to ``wire.py`` which
defines the protocol (read its docstring first), with the Python standard
library only: /init imports it, so that its byte-compiled form is used, and
calls :func:`main` with the port device (``/dev/vportNpM``) as argument. On
the host the same code runs over a socketpair for tests:
``Agent(fd, fd).serve_forever()`` in a thread, or ``python3 agent.py
--stdio`` with the channel on stdin and stdout.

One reader thread decodes requests; each complete request is handled in its
own thread, so a long command never delays a ping; every frame is written
under one lock. The agent never dies on a bad request: it answers with an
error, logs to stderr (the guest console) and keeps serving.

Commands run in their own session, so a timeout kills their whole process
group. A command is finished when its first process exits: output that its
background processes write afterwards is drained and discarded, and they keep
running, so ``server &`` does not block the exec until its timeout.

Imports are limited to what the protocol needs: under TCG every module costs.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time

if __package__:
    from . import wire
else:  # run as a script next to wire.py, as in the guest
    import wire

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

# How long the agent keeps collecting output after a command's first process
# exited while background processes still hold its stdout or stderr open.
OUTPUT_DRAIN_AFTER_EXIT = 0.1
# A virtio port reads as end of stream while nothing is connected on the host
# side, and cannot be waited on (poll reports a hang-up): retry at this pace.
RECONNECT_POLL_INTERVAL = 0.05

_PIPE_READ_SIZE = 256 * 1024
_STDIN_WRITE_SIZE = 64 * 1024


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


def log_to_stderr(message: str) -> None:
    print(f"forkd-agent: {message}", file=sys.stderr, flush=True)


class Agent:
    """Serves requests read from ``fd_in`` and writes replies to ``fd_out``.

    ``wait_on_eof``: treat end of input as "the host is not connected yet"
    and keep reading (the guest's virtio port) instead of returning (a
    socketpair in tests). ``set_clock``, ``reseed`` and ``log`` are injectable
    so tests can observe them without root.
    """

    def __init__(
        self,
        fd_in: int,
        fd_out: int,
        *,
        wait_on_eof: bool = False,
        set_clock: Callable[[float], None] = set_wall_clock,
        reseed: Callable[[bytes], None] = mix_into_urandom,
        log: Callable[[str], None] = log_to_stderr,
    ) -> None:
        self._fd_in = fd_in
        self._fd_out = fd_out
        self._wait_on_eof = wait_on_eof
        self._set_clock = set_clock
        self._reseed = reseed
        self._log = log
        self._reader = wire.FrameReader(self._read)
        self._write_lock = threading.Lock()
        self._epoch: str | None = None
        # Requests whose payload is still arriving, by id; reader thread only.
        self._incoming: dict[int, _IncomingRequest] = {}
        self._operations = {
            "ping": self._ping,
            "exec": self._exec,
            "read_file": self._read_file,
            "write_file": self._write_file,
        }

    def serve_forever(self) -> None:
        """Serve until the input ends (unless ``wait_on_eof``); read errors propagate."""
        while True:
            try:
                frame = self._reader.read_frame()
            except wire.MalformedFrame as exc:
                self._log(f"malformed input: {exc}")
                continue
            if frame is not None:
                self._on_frame(frame)
                continue
            self._abandon_incoming("the host disconnected")
            if not self._wait_on_eof:
                return
            time.sleep(RECONNECT_POLL_INTERVAL)

    def _read(self, size: int) -> bytes:
        return os.read(self._fd_in, size)

    # -- request assembly (reader thread) ------------------------------------

    def _on_frame(self, frame: wire.Frame) -> None:
        fields = frame.fields
        request_id = fields["id"]
        if "op" not in fields:
            incoming = self._incoming.get(request_id)
            if incoming is None:
                self._log(f"dropped a continuation frame for request {request_id}, which is not in progress")
                return
            incoming.sink.write(frame.payload)
            if not fields.get("more"):
                del self._incoming[request_id]
                self._start_handler(incoming)
            return
        abandoned = self._incoming.pop(request_id, None)
        if abandoned is not None:
            abandoned.sink.discard()
            self._log(f"request {request_id} was restarted before its payload was complete")
        self._sync_epoch(fields)
        incoming = _IncomingRequest(fields, self._sink_for(fields))
        incoming.sink.write(frame.payload)
        if fields.get("more"):
            self._incoming[request_id] = incoming
        else:
            self._start_handler(incoming)

    def _sink_for(self, fields: dict) -> _MemorySink | _UploadSink:
        if fields["op"] == "write_file" and isinstance(fields.get("path"), str):
            return _UploadSink(fields["path"], fields["id"])
        return _MemorySink()

    def _abandon_incoming(self, reason: str) -> None:
        for request_id, incoming in self._incoming.items():
            incoming.sink.discard()
            self._log(f"dropped the partial request {request_id}: {reason}")
        self._incoming.clear()

    def _sync_epoch(self, fields: dict) -> None:
        """Adopt the host's clock and randomness when a request opens a new epoch."""
        epoch = fields.get("epoch")
        if epoch is None or epoch == self._epoch:
            return
        self._epoch = epoch
        host_time = fields.get("time")
        if isinstance(host_time, (int, float)):
            try:
                self._set_clock(float(host_time))
            except OSError as exc:
                self._log(f"cannot set the wall clock: {exc}")
        seed = fields.get("seed")
        if isinstance(seed, str):
            try:
                self._reseed(bytes.fromhex(seed))
            except (ValueError, OSError) as exc:
                self._log(f"cannot reseed the random pool: {exc}")

    def _start_handler(self, incoming: _IncomingRequest) -> None:
        thread = threading.Thread(
            target=self._handle,
            args=(incoming.fields, incoming.sink),
            name=f"request-{incoming.fields['id']}",
            daemon=True,
        )
        thread.start()

    # -- request handling (one thread per request) ---------------------------

    def _handle(self, fields: dict, sink: _MemorySink | _UploadSink) -> None:
        try:
            error = self._perform(fields, sink)
        finally:
            # Before any error reply: the host must never see a stale upload file.
            sink.discard()
        if error is not None:
            self._send_error(fields["id"], error)

    def _perform(self, fields: dict, sink: _MemorySink | _UploadSink) -> dict | None:
        """Run the operation, which sends its own reply; return the error to send instead, if any."""
        operation = self._operations.get(fields["op"])
        try:
            if operation is None:
                raise RequestError(
                    "UnknownOperation",
                    f"unknown operation {fields['op']!r}; this agent (protocol {wire.PROTOCOL_VERSION}) "
                    f"supports {', '.join(sorted(self._operations))}: update the guest image",
                )
            operation(fields, sink)
        except RequestError as exc:
            return {"type": exc.error_type, "message": str(exc)}
        except OSError as exc:
            return _os_error_fields(exc)
        except Exception as exc:
            import traceback  # only needed when the agent itself is broken; imports cost in the guest

            self._log(f"request {fields['id']} ({fields['op']!r}) failed:\n{traceback.format_exc()}")
            return {
                "type": "InternalError",
                "message": f"the agent failed on {fields['op']!r}: {exc!r}; the guest console shows the traceback",
            }
        return None

    def _ping(self, fields: dict, sink: _MemorySink) -> None:
        self._send(
            {
                "id": fields["id"],
                "pid": os.getpid(),
                "monotonic": time.monotonic(),
                "wall_time": time.time(),
                "protocol": wire.PROTOCOL_VERSION,
            }
        )

    def _exec(self, fields: dict, sink: _MemorySink) -> None:
        argv = _command_argv(fields)
        env = _optional(fields, "env", dict)
        if env is not None:
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
                raise RequestError("BadRequest", "'env' must map strings to strings")
            env = {**os.environ, **env}
        cwd = _optional(fields, "cwd", str)
        timeout = _optional(fields, "timeout", (int, float))
        if timeout is not None and timeout <= 0:
            raise RequestError("BadRequest", f"'timeout' must be a positive number of seconds or null, got {timeout}")
        run = _run_command(argv, env=env, cwd=cwd, stdin=sink.contents(), timeout=timeout)
        self._send(
            {
                "id": fields["id"],
                "exit_code": run.exit_code,
                "stdout_len": sum(map(len, run.stdout)),
                "duration_ms": run.duration_ms,
                "timed_out": run.timed_out,
            },
            b"".join(run.stdout + run.stderr),  # one copy: guest memory is small
        )

    def _read_file(self, fields: dict, sink: _MemorySink) -> None:
        """Stream the file one chunk at a time, looking one chunk ahead to know when it ends."""
        path = _required(fields, "path", str)
        request_id = fields["id"]
        with open(path, "rb") as source:
            chunk = source.read(wire.CHUNK_SIZE)
            while True:
                try:
                    following = source.read(wire.CHUNK_SIZE)
                except OSError as exc:  # part of the file is sent: an error frame ends the reply
                    self._send_error(request_id, _os_error_fields(exc, path))
                    return
                self._send_frame({"id": request_id, "more": bool(following)}, chunk)
                if not following:
                    return
                chunk = following

    def _write_file(self, fields: dict, sink: _UploadSink) -> None:
        _required(fields, "path", str)  # the sink opened its temporary file beside it at the first frame
        mode = _optional(fields, "mode", int)
        if mode is not None and not 0 <= mode <= 0o7777:
            raise RequestError("BadRequest", f"'mode' must be permission bits between 0 and 0o7777, got {mode:#o}")
        size = sink.commit(mode)
        self._send({"id": fields["id"], "size": size})

    # -- writing --------------------------------------------------------------

    def _send(self, fields: dict, payload: bytes = b"") -> None:
        for frame_fields, chunk in wire.message_frames(fields, payload):
            self._send_frame(frame_fields, chunk)

    def _send_error(self, request_id: int, error: dict) -> None:
        self._send_frame({"id": request_id, "error": error}, b"")

    def _send_frame(self, fields: dict, payload: bytes | memoryview) -> None:
        header = wire.encode_header(fields, len(payload))
        try:
            with self._write_lock:
                _write_all(self._fd_out, header)
                _write_all(self._fd_out, payload)
        except OSError as exc:
            # The host went away; nobody is left to answer.
            self._log(f"cannot send the reply to request {fields['id']}: {exc}")


# -- request payload sinks -------------------------------------------------------


class _IncomingRequest:
    __slots__ = ("fields", "sink")

    def __init__(self, fields: dict, sink: _MemorySink | _UploadSink) -> None:
        self.fields = fields
        self.sink = sink


class _MemorySink:
    """Collects a request payload (an exec's stdin) in memory."""

    def __init__(self) -> None:
        self._chunks: list[bytes] = []

    def write(self, chunk: bytes) -> None:
        if chunk:
            self._chunks.append(chunk)

    def contents(self) -> bytes:
        return b"".join(self._chunks)

    def discard(self) -> None:
        self._chunks.clear()


class _UploadSink:
    """Writes an upload to a temporary file beside its destination, chunk by chunk.

    The destination only changes at :meth:`commit`, by rename, so a reader in
    the guest never sees half a file. The first OS error is kept and reported
    at commit; later chunks are dropped.
    """

    def __init__(self, path: str, request_id: int) -> None:
        self._path = path
        directory, name = os.path.split(path)
        self._temporary = os.path.join(directory, f".{name}.{os.getpid()}-{request_id}.forkd-upload")
        self._size = 0
        self._error: OSError | None = None
        self._fd: int | None = None
        self._temporary_exists = False
        try:
            self._fd = os.open(self._temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
            self._temporary_exists = True
        except OSError as exc:
            self._error = exc

    def write(self, chunk: bytes) -> None:
        if self._fd is None or not chunk:
            return
        try:
            _write_all(self._fd, chunk)
            self._size += len(chunk)
        except OSError as exc:
            self._error = exc
            self.discard()

    def commit(self, mode: int | None) -> int:
        """Give the file its mode and move it into place; return its size."""
        if self._error is not None:
            raise _with_path(self._error, self._path)
        if mode is None:
            # Replacing a file keeps its mode; a new one gets 0o666 less the umask, as open() gives.
            with contextlib.suppress(OSError):
                mode = os.stat(self._path).st_mode & 0o7777
        try:
            if mode is not None:
                os.fchmod(self._fd, mode)
            os.rename(self._temporary, self._path)
        except OSError as exc:
            raise _with_path(exc, self._path) from None
        self._temporary_exists = False
        return self._size

    def discard(self) -> None:
        """Close the file and remove it unless it was committed; safe to call twice."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._temporary_exists:
            self._temporary_exists = False
            with contextlib.suppress(OSError):
                os.unlink(self._temporary)


# -- running commands ------------------------------------------------------------


class _CommandRun:
    __slots__ = ("duration_ms", "exit_code", "stderr", "stdout", "timed_out")

    def __init__(self, exit_code: int, stdout: list, stderr: list, duration_ms: float, timed_out: bool) -> None:
        self.exit_code = exit_code
        self.stdout = stdout
        self.stderr = stderr
        self.duration_ms = duration_ms
        self.timed_out = timed_out


def _run_command(
    argv: list[str], *, env: dict | None, cwd: str | None, stdin: bytes, timeout: float | None
) -> _CommandRun:
    """Run ``argv`` in a new session and collect what it writes to stdout and stderr."""
    started = time.monotonic()
    try:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=env,
            start_new_session=True,
        )
    except OSError as exc:
        if exc.filename is None or exc.filename == cwd:
            raise  # could not fork or enter cwd: not the program's fault
        # Report it like a shell does, as the command's own failure.
        exit_code = 127 if isinstance(exc, FileNotFoundError) else 126
        message = f"{argv[0]}: {exc.strerror}\n".encode()
        return _CommandRun(exit_code, [], [message], (time.monotonic() - started) * 1000, False)
    return _CommandCollector(process, stdin, started, timeout).collect()


class _CommandCollector:
    """Feeds a running command its stdin and collects its output until it exits.

    The stdin pipe, both output pipes and a pidfd of the command are
    multiplexed with poll(), so no amount of output can deadlock. At the
    deadline the whole process group is killed and the output captured so far
    is kept.
    """

    def __init__(self, process: subprocess.Popen, stdin: bytes, started: float, timeout: float | None) -> None:
        self._process = process
        self._started = started
        self._deadline = None if timeout is None else started + timeout
        self._timed_out = False
        self._exited_at: float | None = None
        self._poller = select.poll()
        self._output: dict[int, list[bytes]] = {process.stdout.fileno(): [], process.stderr.fileno(): []}
        self._open_outputs = set(self._output)
        for fd in self._output:
            self._poller.register(fd, select.POLLIN)
        self._pending_stdin = memoryview(stdin)
        self._stdin_fd = None
        if stdin:
            self._stdin_fd = process.stdin.fileno()
            os.set_blocking(self._stdin_fd, False)
            self._poller.register(self._stdin_fd, select.POLLOUT)
        self._exit_fd = os.pidfd_open(process.pid)
        self._poller.register(self._exit_fd, select.POLLIN)

    def collect(self) -> _CommandRun:
        process = self._process
        stdout = self._output[process.stdout.fileno()]
        stderr = self._output[process.stderr.fileno()]
        try:
            self._poll_until_done()
            exit_code = process.wait()
        except BaseException:
            # Nobody will collect this command's result: do not leave it running.
            if process.returncode is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            raise
        finally:
            os.close(self._exit_fd)
            if self._stdin_fd is not None:
                process.stdin.close()
        self._release_outputs()
        duration_ms = (self._exited_at - self._started) * 1000
        return _CommandRun(exit_code, stdout, stderr, duration_ms, self._timed_out)

    def _poll_until_done(self) -> None:
        while self._open_outputs or self._exited_at is None:
            wait = self._seconds_to_wait()
            if wait is not None and wait <= 0:
                if self._exited_at is not None:
                    return  # what is still open belongs to background processes
                os.killpg(self._process.pid, signal.SIGKILL)
                self._timed_out, self._deadline = True, None
                continue
            for fd, _events in self._poller.poll(None if wait is None else wait * 1000):
                if fd == self._exit_fd:
                    self._poller.unregister(fd)
                    self._exited_at = time.monotonic()
                elif fd == self._stdin_fd:
                    self._feed_stdin()
                else:
                    self._read_output(fd)

    def _seconds_to_wait(self) -> float | None:
        """Time left until the output drain ends (after exit) or the deadline; None: no limit."""
        if self._exited_at is not None:
            return self._exited_at + OUTPUT_DRAIN_AFTER_EXIT - time.monotonic()
        if self._deadline is not None:
            return self._deadline - time.monotonic()
        return None

    def _feed_stdin(self) -> None:
        try:
            written = os.write(self._stdin_fd, self._pending_stdin[:_STDIN_WRITE_SIZE])
            self._pending_stdin = self._pending_stdin[written:]
        except BrokenPipeError:
            self._pending_stdin = self._pending_stdin[:0]  # the command stopped reading
        if not self._pending_stdin:
            self._poller.unregister(self._stdin_fd)
            self._process.stdin.close()
            self._stdin_fd = None

    def _read_output(self, fd: int) -> None:
        data = os.read(fd, _PIPE_READ_SIZE)
        if data:
            self._output[fd].append(data)
        else:
            self._poller.unregister(fd)
            self._open_outputs.discard(fd)

    def _release_outputs(self) -> None:
        """Close finished pipes; hand those that background processes still hold to a drain thread."""
        lingering = []
        for stream in (self._process.stdout, self._process.stderr):
            if stream.fileno() in self._open_outputs:
                lingering.append(stream)
            else:
                stream.close()
        if lingering:
            threading.Thread(target=_discard_until_eof, args=(lingering,), name="drain", daemon=True).start()


def _discard_until_eof(streams: list) -> None:
    """Keep reading pipes held by a command's background processes, so they never hit SIGPIPE."""
    poller = select.poll()
    by_fd = {stream.fileno(): stream for stream in streams}
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    while by_fd:
        for fd, _events in poller.poll():
            if not os.read(fd, _PIPE_READ_SIZE):
                poller.unregister(fd)
                by_fd.pop(fd).close()


# -- helpers -----------------------------------------------------------------------


def _command_argv(fields: dict) -> list[str]:
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


def _required(fields: dict, name: str, kind: type | tuple) -> Any:
    value = fields.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise RequestError("BadRequest", f"{fields['op']!r} needs {name!r} of type {_kind_name(kind)}")
    return value


def _optional(fields: dict, name: str, kind: type | tuple) -> Any:
    if fields.get(name) is None:
        return None
    return _required(fields, name, kind)


def _kind_name(kind: type | tuple) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _os_error_fields(exc: OSError, path: str | None = None) -> dict:
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


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def main(argv: list[str] | None = None) -> int:
    """``agent.py PORT_DEVICE`` in the guest; ``agent.py --stdio`` on a host, over stdin/stdout."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: agent.py PORT_DEVICE | --stdio", file=sys.stderr)
        return 2
    if args[0] == "--stdio":
        # Outside a guest: never move the machine's clock, even as root.
        agent = Agent(sys.stdin.fileno(), sys.stdout.fileno(), set_clock=_leave_clock_alone)
    else:
        try:
            port = os.open(args[0], os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            log_to_stderr(f"cannot open the agent port: {exc}")
            return 1
        agent = Agent(port, port, wait_on_eof=True)
    log_to_stderr(f"serving on {args[0]} (pid {os.getpid()})")
    try:
        agent.serve_forever()
    except OSError as exc:
        log_to_stderr(f"cannot read requests any more: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
