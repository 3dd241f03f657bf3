"""The guest agent: runs commands and moves files for the host over one byte stream.

It runs inside the guest from ``/opt/forkd``, next to ``wire.py`` which
defines the protocol (read its docstring first), with the Python standard
library only: /init imports it, so that its byte-compiled form is used, and
calls :func:`main` with the port device (``/dev/vportNpM``) as argument. On
the host the same code runs over a socketpair for tests:
``Agent(fd, fd).serve_forever()`` in a thread, or ``python3 agent.py
--stdio`` with the channel on stdin and stdout.

One reader thread decodes requests and answers pings itself (they only read
clocks); every other complete request is handled in its own thread, so a long
command never delays a ping; every frame is written under one lock. The agent
never dies on a bad request: it answers with an error, logs to stderr (the
guest console) and keeps serving.

Commands run in their own session and, in the guest, their own cgroup v2
(see :class:`CommandCgroups`): the agent itself is exempt from the
out-of-memory killer and each command is its preferred victim, so an OOM or a
fork bomb ends the command, not the agent, and a timeout kills the whole
cgroup. Output streams to the host as it is produced, within a credit window
(see ``exec`` in wire.py), so the agent holds a bounded amount of it whatever
a command prints. A command is finished when its first process exits: output
that its background processes write afterwards is drained and discarded, and
they keep running, so ``server &`` does not block the exec until its timeout.

Imports are limited to what the protocol needs: under TCG every module costs.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import os
import select
import signal
import subprocess
import sys
import threading
import time

TYPE_CHECKING = False
if __package__ or TYPE_CHECKING:
    from . import wire
else:  # run as a script next to wire.py, as in the guest
    import wire

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import IO, Any

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
# How long a timeout waits for the killed command's cgroup to empty.
KILL_WAIT = 10.0
# Processes one command may have at a time (a fork bomb stops here).
COMMAND_PIDS_MAX = 1024
# Commands are the out-of-memory killer's preferred victims (the agent is at -1000).
COMMAND_OOM_SCORE_ADJ = 500
# Memory left to the agent and the kernel when commands are capped: this or
# 1/8 of the guest's memory, whichever is larger.
AGENT_MEMORY_RESERVE = 24 << 20
MIN_COMMAND_MEMORY = 16 << 20
# Empty command cgroups kept for reuse.
_FREE_GROUPS = 4

_PIPE_READ_SIZE = 256 * 1024
_PIPE_SIZE = 1 << 20
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
    so tests can observe them without root. ``cgroups``: where commands get
    their own cgroup (None: they run without limits, as on a host);
    ``oom_target``: commands raise their own OOM score (the guest's agent
    lowered its own, which children would inherit).
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
        cgroups: CommandCgroups | None = None,
        oom_target: bool = False,
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
        self._cgroups = cgroups
        self._oom_target = oom_target
        # Output streams by request id, for credit; running commands by request id.
        self._streams: dict[int, _OutputStream] = {}
        self._running: dict[int, _CommandCollector] = {}
        # Requests being handled, by id, so that a cancel request can find them.
        self._handling: dict[int, _Running] = {}
        self._handling_lock = threading.Lock()
        # Each operation gets the sink _sink_for made for it: an _UploadSink for write_file, else a _MemorySink.
        self._operations: dict[str, Callable[[dict[str, Any], Any], None]] = {
            "ping": self._ping,
            "exec": self._exec,
            "read_file": self._read_file,
            "write_file": self._write_file,
            "copy_in": self._copy_in,
            "copy_out": self._copy_out,
        }
        # Processes started by `spawn`, by guest pid, and their host attachments by request id.
        self._processes: dict[int, _Spawned] = {}
        self._attachments: dict[int, _Spawned] = {}
        self._client: str | None = None
        self._client_lock = threading.Lock()  # orders attachments with the switch to a new host client
        self._operations.update(
            spawn=self._spawn,
            attach=self._attach,
            stdin=self._stdin,
            signal=self._signal,
            resize=self._resize,
            processes=self._list_processes,
        )

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
        if fields.get("op") == "credit":
            self._credit(fields)
            return
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
        self._sync_client(fields)
        incoming = _IncomingRequest(fields, self._sink_for(fields))
        incoming.sink.write(frame.payload)
        if fields.get("more"):
            self._incoming[request_id] = incoming
        else:
            self._start_handler(incoming)

    def _credit(self, fields: dict[str, Any]) -> None:
        """Return output credit to a streaming request; never replied to."""
        ref = fields.get("ref")
        nbytes = fields.get("bytes")
        spawned = self._attachments.get(ref) if type(ref) is int else None
        if spawned is not None:
            if type(nbytes) is int and nbytes > 0:
                spawned.add_credit(ref, fields.get("fd"), nbytes)  # type: ignore[arg-type]
            return
        stream = self._streams.get(ref) if type(ref) is int else None
        if stream is not None and type(nbytes) is int and nbytes > 0:
            stream.add_credit(nbytes)

    def kill_command(self, request_id: int) -> bool:
        """Kill the command that request ``request_id`` runs, with its whole cgroup; False if none runs."""
        collector = self._running.get(request_id)
        if collector is None:
            return False
        collector.kill()
        return True

    def _sink_for(self, fields: dict[str, Any]) -> _MemorySink | _UploadSink:
        if fields["op"] == "write_file" and isinstance(fields.get("path"), str):
            return _UploadSink(fields["path"], fields["id"])
        if fields["op"] == "copy_in" and isinstance(fields.get("path"), str):
            return _ArchiveSink(fields["path"])
        return _MemorySink()

    def _abandon_incoming(self, reason: str) -> None:
        for request_id, incoming in self._incoming.items():
            incoming.sink.discard()
            self._log(f"dropped the partial request {request_id}: {reason}")
        self._incoming.clear()

    def _sync_epoch(self, fields: dict[str, Any]) -> None:
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
        request_id = incoming.fields["id"]
        if incoming.fields["op"] == "cancel":
            self._start_cancel(incoming.fields)
            return
        if isinstance(incoming.sink, _WithdrawnPayload):
            self._send_error(request_id, {"type": "Cancelled", "message": "the request was cancelled by the host"})
            return
        if incoming.fields["op"] == "ping":
            # Answered here: it only reads clocks, and starting a thread (a new stack, its first
            # pages) cost more than the ping itself, in every restore's first round trip most of all.
            self._handle(incoming.fields, incoming.sink)
            return
        with self._handling_lock:
            self._handling[request_id] = _Running()
        thread = threading.Thread(
            target=self._handle_cancellable,
            args=(incoming.fields, incoming.sink),
            name=f"request-{incoming.fields['id']}",
            daemon=True,
        )
        thread.start()

    # -- request handling (one thread per request) ---------------------------

    def _handle(self, fields: dict[str, Any], sink: _MemorySink | _UploadSink) -> None:
        try:
            error = self._perform(fields, sink)
        finally:
            # Before any error reply: the host must never see a stale upload file.
            sink.discard()
        if error is not None:
            self._send_error(fields["id"], error)

    def _perform(self, fields: dict[str, Any], sink: _MemorySink | _UploadSink) -> dict[str, Any] | None:
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

    def _ping(self, fields: dict[str, Any], sink: _MemorySink) -> None:
        self._send(
            {
                "id": fields["id"],
                "pid": os.getpid(),
                "monotonic": time.monotonic(),
                "wall_time": time.time(),
                "protocol": wire.PROTOCOL_VERSION,
            }
        )

    def _exec(self, fields: dict[str, Any], sink: _MemorySink) -> None:
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
        max_output = _optional(fields, "max_output", int)
        if max_output is not None and max_output < 0:
            raise RequestError("BadRequest", f"'max_output' must be a number of bytes >= 0 or null, got {max_output}")
        window = _optional(fields, "window", int) or wire.OUTPUT_WINDOW
        window = min(max(window, wire.OUTPUT_CHUNK_SIZE), MAX_OUTPUT_WINDOW)
        terminal = _terminal_size(fields)
        request_id = fields["id"]
        stream = _OutputStream(self._send_frame, request_id, window)
        self._streams[request_id] = stream
        try:
            run = _run_command(
                argv,
                env=env,
                cwd=cwd,
                stdin=sink.contents(),
                timeout=timeout,
                stream=stream,
                max_output=max_output,
                cgroups=self._cgroups,
                child_setup=self._oom_target,
                running=self._running,
                terminal=terminal,
            )
            self._send_tails(stream, run.captures)
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            stream.close()
        stdout, stderr = run.captures
        self._send(
            {
                "id": request_id,
                "exit_code": run.exit_code,
                "signal": -run.exit_code if run.exit_code < 0 else None,
                "oom_killed": run.oom_killed,
                "timed_out": run.timed_out,
                "duration_ms": run.duration_ms,
                "truncated": bool(stdout.skipped or stderr.skipped),
                "stdout_total": stdout.total,
                "stderr_total": stderr.total,
            }
        )
        if self._cgroups is not None:
            self._cgroups.prepare()

    def _send_tails(self, stream: _OutputStream, captures: list[_StreamCapture]) -> None:
        """Send what the tail rings kept, within the credit window; the first frame says what was skipped."""
        for capture in captures:
            ring, capture.ring = capture.ring, None
            if ring is None or not ring.size:
                continue
            view = memoryview(ring.contents())
            extra = {"skipped": capture.skipped}
            while view:
                if not stream.wait_for_room():
                    capture.skipped += len(view)
                    break
                chunk = view[: min(stream.room, wire.OUTPUT_CHUNK_SIZE)]
                stream.send(capture.fd_number, chunk, **extra)
                view = view[len(chunk) :]
                extra = {}

    def _read_file(self, fields: dict[str, Any], sink: _MemorySink) -> None:
        """Stream the file one chunk at a time, looking one chunk ahead to know when it ends."""
        path = _required(fields, "path", str)
        max_size = _optional(fields, "max_size", int)
        request_id = fields["id"]
        with open(path, "rb") as source:
            size = os.fstat(source.fileno()).st_size
            if max_size is not None and size > max_size:
                raise RequestError(
                    "FileTooLarge", f"{path} has {size} bytes, more than the {max_size} the host accepts"
                )
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

    def _write_file(self, fields: dict[str, Any], sink: _UploadSink) -> None:
        _required(fields, "path", str)  # the sink opened its temporary file beside it at the first frame
        mode = _optional(fields, "mode", int)
        if mode is not None and not 0 <= mode <= 0o7777:
            raise RequestError("BadRequest", f"'mode' must be permission bits between 0 and 0o7777, got {mode:#o}")
        size = sink.commit(mode)
        self._send({"id": fields["id"], "size": size})

    # -- spawned processes (see _Spawned) ---------------------------------------

    def _sync_client(self, fields: dict[str, Any]) -> None:
        """A request from another host client (a VM restored from a snapshot): drop the old attachments.

        The processes keep running; their output waits for the new host to attach.
        """
        client = fields.get("client")
        if not isinstance(client, str) or client == self._client:
            return
        with self._client_lock:
            self._client = client
            for spawned in list(self._processes.values()):
                spawned.drop_attachments_except(client)

    def _spawn(self, fields: dict[str, Any], sink: _MemorySink) -> None:
        argv = _command_argv(fields)
        env = _optional(fields, "env", dict)
        if env is not None:
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
                raise RequestError("BadRequest", "'env' must map strings to strings")
            env = {**os.environ, **env}
        cwd = _optional(fields, "cwd", str)
        max_output = _optional(fields, "max_output", int)
        if max_output is None or max_output < 0:
            raise RequestError("BadRequest", f"'max_output' must be a number of bytes >= 0, got {max_output}")
        terminal = _terminal_size(fields)
        _check_program(argv, env if env is not None else os.environ, cwd)
        spawned = _Spawned.start(
            argv,
            env=env,
            cwd=cwd,
            terminal=terminal,
            max_output=max_output,
            cgroups=self._cgroups,
            child_setup=self._oom_target,
            send_frame=self._send_frame,
            finished=self._forget_process,
        )
        self._processes[spawned.pid] = spawned
        self._start_attachment(spawned, fields)

    def _process(self, fields: dict[str, Any]) -> _Spawned:
        pid = _required(fields, "pid", int)
        spawned = self._processes.get(pid)
        if spawned is None:
            raise RequestError(
                "NoSuchProcess",
                f"no process with pid {pid} was spawned in this guest, or it has ended and its result was taken",
            )
        return spawned

    def _attach(self, fields: dict[str, Any], sink: _MemorySink) -> None:
        """Stream the process's output to this request (replacing an earlier attachment); replies come from it."""
        self._start_attachment(self._process(fields), fields)

    def _start_attachment(self, spawned: _Spawned, fields: dict[str, Any]) -> None:
        """Name the process to the request (first frame), then stream its output to it."""
        window = _optional(fields, "window", int) or wire.OUTPUT_WINDOW
        window = min(max(window, 1), MAX_OUTPUT_WINDOW)
        client = fields.get("client") if isinstance(fields.get("client"), str) else None
        self._send_frame({"id": fields["id"], "more": True, "pid": spawned.pid}, b"")
        with self._client_lock:
            if client is not None and self._client is not None and client != self._client:
                return  # a newer host client spoke meanwhile: nobody reads this request any more
            self._attachments[fields["id"]] = spawned
            spawned.attach(fields["id"], client, window)

    def _forget_process(self, spawned: _Spawned) -> None:
        if self._processes.get(spawned.pid) is spawned:
            del self._processes[spawned.pid]
        for request_id in [key for key, value in self._attachments.items() if value is spawned]:
            del self._attachments[request_id]

    def _stdin(self, fields: dict[str, Any], sink: _MemorySink) -> None:
        spawned = self._process(fields)
        close = fields.get("close") is True
        size = spawned.write_stdin(sink.contents(), close=close)
        self._send({"id": fields["id"], "size": size})

    def _signal(self, fields: dict[str, Any], sink: _MemorySink) -> None:
        spawned = self._process(fields)
        number = _required(fields, "signal", int)
        if not 0 < number < 65:
            raise RequestError("BadRequest", f"'signal' must be a signal number between 1 and 64, got {number}")
        self._send({"id": fields["id"], "delivered": spawned.send_signal(number)})

    def _resize(self, fields: dict[str, Any], sink: _MemorySink) -> None:
        spawned = self._process(fields)
        size = _terminal_size({"op": "resize", "pty": fields.get("size")})
        if size is None:
            raise RequestError("BadRequest", "'resize' needs 'size': [rows, columns]")
        spawned.resize(size)
        self._send({"id": fields["id"]})

    def _list_processes(self, fields: dict[str, Any], sink: _MemorySink) -> None:
        described = [spawned.describe() for spawned in list(self._processes.values())]
        self._send({"id": fields["id"], "processes": described})

    def _copy_in(self, fields: dict[str, Any], sink: _MemorySink | _UploadSink) -> None:
        """The archive was unpacked as it arrived (see _ArchiveSink): report how it went."""
        _required(fields, "path", str)
        if not isinstance(sink, _ArchiveSink):
            raise RequestError("BadRequest", "'copy_in' needs 'path', a string")
        stats = sink.finish()
        self._send({"id": fields["id"], **stats.to_json()})

    def _copy_out(self, fields: dict[str, Any], sink: _MemorySink | _UploadSink) -> None:
        """Stream ``path`` as a tar archive in output frames (fd 1), within the host's credit window."""
        tarstream = _tarstream()
        path = _required(fields, "path", str)
        exclude = _optional(fields, "exclude", list) or []
        if not all(isinstance(pattern, str) for pattern in exclude):
            raise RequestError("BadRequest", "'exclude' must be a list of glob patterns (strings)")
        window = min(
            max(_optional(fields, "window", int) or wire.OUTPUT_WINDOW, wire.OUTPUT_CHUNK_SIZE), MAX_OUTPUT_WINDOW
        )
        request_id = fields["id"]
        stream = _OutputStream(self._send_frame, request_id, window)
        self._streams[request_id] = stream
        handling = getattr(_current, "running", None)
        if handling is not None:  # a cancel request stops the stream as it would kill a command
            handling.attach(_StreamStopper(stream))
        try:
            writer = tarstream.ChunkWriter(lambda chunk: _send_within_credit(stream, chunk), wire.OUTPUT_CHUNK_SIZE)
            stats = tarstream.pack(path, writer, exclude)
            writer.flush()
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            stream.close()
        self._send({"id": request_id, **stats.to_json()})

    # -- cancel ---------------------------------------------------------------

    def _handle_cancellable(self, fields: dict[str, Any], sink: _MemorySink | _UploadSink) -> None:
        """:meth:`_handle`, findable by a cancel request while it runs (a command it starts can be killed)."""
        with self._handling_lock:
            running = self._handling.get(fields["id"])
        _current.running = running
        try:
            self._handle(fields, sink)
        finally:
            _current.running = None
            with self._handling_lock:
                if self._handling.get(fields["id"]) is running:
                    del self._handling[fields["id"]]
            if running is not None:
                running.finished.set()

    def _start_cancel(self, fields: dict[str, Any]) -> None:
        """Stop request ``target``: kill its command's process group, or drop its payload if still arriving.

        Runs in the reader thread, so it is ordered with the target's frames:
        a payload still arriving is withdrawn before another of its chunks is
        read, and the target then gets a ``Cancelled`` error reply instead of
        running. The reply to the cancel itself waits (in its own thread, at
        most ``CANCEL_WAIT`` s) until the target has finished, so once the
        host has it, the command and its process group are gone.
        """
        target = fields.get("target")
        if type(target) is not int:
            self._send_error(
                fields["id"], {"type": "BadRequest", "message": "'cancel' needs 'target', an integer request id"}
            )
            return
        incoming = self._incoming.get(target)
        if incoming is not None:
            incoming.sink.discard()
            incoming.sink = _WithdrawnPayload()
            self._send({"id": fields["id"], "found": True, "finished": True})
            return
        with self._handling_lock:
            running = self._handling.get(target)
        if running is None:
            self._send({"id": fields["id"], "found": False, "finished": True})
            return
        running.cancel()
        threading.Thread(
            target=lambda: self._send(
                {"id": fields["id"], "found": True, "finished": running.finished.wait(CANCEL_WAIT)}
            ),
            name=f"cancel-{target}",
            daemon=True,
        ).start()

    # -- writing --------------------------------------------------------------

    def _send(self, fields: dict[str, Any], payload: bytes = b"") -> None:
        for frame_fields, chunk in wire.message_frames(fields, payload):
            self._send_frame(frame_fields, chunk)

    def _send_error(self, request_id: int, error: dict[str, Any]) -> None:
        self._send_frame({"id": request_id, "error": error}, b"")

    def _send_frame(self, fields: dict[str, Any], payload: bytes | memoryview) -> None:
        header = wire.encode_header(fields, len(payload))
        try:
            with self._write_lock:
                _write_frame(self._fd_out, header, payload)
        except OSError as exc:
            # The host went away; nobody is left to answer.
            self._log(f"cannot send the reply to request {fields['id']}: {exc}")


# -- request payload sinks -------------------------------------------------------


class _IncomingRequest:
    __slots__ = ("fields", "sink")

    def __init__(self, fields: dict[str, Any], sink: _MemorySink | _UploadSink) -> None:
        self.fields = fields
        self.sink: _MemorySink | _UploadSink | _WithdrawnPayload = sink


class _WithdrawnPayload:
    """Stands in for the payload of a request cancelled while it arrived: drops the rest."""

    def write(self, chunk: bytes) -> None:
        pass

    def discard(self) -> None:
        pass


class _Running:
    """A request being handled: its command, once started, and whether it was cancelled."""

    def __init__(self) -> None:
        self.finished = threading.Event()
        self._lock = threading.Lock()
        self._command: _CommandCollector | None = None
        self._cancelled = False

    def attach(self, command: _CommandCollector) -> None:
        with self._lock:
            self._command = command
            if self._cancelled:
                command.kill()

    def cancel(self) -> None:
        """Kill the command with everything it started (its cgroup), as a timeout does."""
        with self._lock:
            self._cancelled = True
            if self._command is not None:
                self._command.kill()


# The request a handler thread serves, so a command it starts can be cancelled.
_current = threading.local()


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
        assert self._fd is not None  # open unless an error was kept
        try:
            if mode is not None:
                os.fchmod(self._fd, mode)
            # Closed before it appears at its path: a file still open for writing cannot be
            # executed (ETXTBSY), and the next request may run it at once.
            os.close(self._fd)
            self._fd = None
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


class _ArchiveSink(_MemorySink):
    """Unpacks a ``copy_in`` upload (a tar stream) as it arrives, in a thread of its own.

    The reader thread hands chunks over through a bounded pipe, so neither
    the agent nor the host ever holds more than a few chunks of the tree; a
    slow disk slows the reader thread down, and with it the host's sending.
    Once unpacking failed (no space left, a file in the way) the rest of the
    upload is read and dropped, and the error is the request's reply.
    """

    def __init__(self, path: str) -> None:
        super().__init__()
        tarstream = _tarstream()
        self._path = path
        self._pipe = tarstream.ChunkPipe(limit=4 * wire.CHUNK_SIZE)
        self._stats = None
        self._error: BaseException | None = None
        self._finished = False
        self._thread = threading.Thread(target=self._unpack, name="copy-in", daemon=True)
        self._thread.start()

    def _unpack(self) -> None:
        tarstream = _tarstream()
        try:
            self._stats = tarstream.unpack(self._pipe, self._path)
        except tarstream.PipeClosed:
            self._error = RequestError("Cancelled", "the copy was cancelled by the host")
        except tarstream.ArchiveRefused as exc:
            self._error = RequestError("BadArchive", f"{exc} (member {exc.member!r})")
        except BaseException as exc:
            self._error = exc
        finally:
            self._pipe.close_reader()

    def write(self, chunk: bytes) -> None:
        self._pipe.put(chunk)

    def finish(self) -> Any:
        """Wait until the whole upload is unpacked; its stats, or the error unpacking it raised."""
        self._finished = True
        self._pipe.close()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._stats

    def contents(self) -> bytes:
        return b""

    def discard(self) -> None:
        if not self._finished:
            self._finished = True
            self._pipe.abort("the upload was dropped")


class _StreamStopper:
    """Stands in for a command in a cancellable request that streams an archive: a cancel stalls the stream."""

    def __init__(self, stream: _OutputStream) -> None:
        self._stream = stream

    def kill(self) -> None:
        self._stream.stalled = True
        self._stream.add_credit(0)  # wakes a wait for credit


def _send_within_credit(stream: _OutputStream, chunk: bytes) -> None:
    view = memoryview(chunk)
    while view:
        if not stream.wait_for_room():
            raise RequestError(
                "Cancelled",
                f"the host stopped taking the archive (cancelled, or no credit for {CREDIT_STALL_TIMEOUT:g} s)",
            )
        piece = view[: min(stream.room, wire.OUTPUT_CHUNK_SIZE)]
        stream.send(wire.STDOUT, piece)
        view = view[len(piece) :]


def _tarstream() -> Any:
    """The tar stream module, imported on first use (every import costs in an emulated guest)."""
    if __package__ or TYPE_CHECKING:
        from . import tarstream
    else:  # run as a script next to it, as in the guest
        import tarstream  # type: ignore[no-redef]
    return tarstream


# -- output streaming ------------------------------------------------------------


class _OutputStream:
    """Sends one request's output to the host within a credit window.

    The agent may have at most ``window`` bytes sent and not yet credited by
    the host (``credit`` requests, handled by the reader thread). A thread
    that waits for credit polls :attr:`wake_fd`, which becomes readable when
    credit arrives. If the host gives none for ``CREDIT_STALL_TIMEOUT``
    seconds, the stream is *stalled*: the rest of the output is discarded
    (and counted), so a host that went away never pins the command.
    """

    def __init__(
        self, send_frame: Callable[[dict[str, Any], bytes | memoryview], None], request_id: int, window: int
    ) -> None:
        self._send_frame = send_frame
        self.request_id = request_id
        self._lock = threading.Lock()
        self._room = window
        self.stalled = False
        self.wake_fd, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    @property
    def room(self) -> int:
        return 0 if self.stalled else self._room

    def add_credit(self, nbytes: int) -> None:
        """The host consumed ``nbytes`` of this stream (reader thread)."""
        with self._lock:
            self._room += nbytes
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_write, b"c")

    def clear_wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.read(self.wake_fd, 4096)

    def send(self, fd_number: int, data: bytes | memoryview, **extra: Any) -> None:
        """Send one output chunk (at most the room there is, unless the caller bypasses credit)."""
        with self._lock:
            self._room -= len(data)
        self._send_frame({"id": self.request_id, "more": True, "fd": fd_number, **extra}, data)

    def wait_for_room(self, deadline: float | None = None) -> bool:
        """Block until there is credit; False (and the stream stalls) after CREDIT_STALL_TIMEOUT."""
        stall_at = time.monotonic() + CREDIT_STALL_TIMEOUT
        while self.room <= 0 and not self.stalled:
            limit = stall_at if deadline is None else min(stall_at, deadline)
            left = limit - time.monotonic()
            if left <= 0:
                if limit == stall_at:
                    self.stalled = True
                return False
            select.select([self.wake_fd], [], [], left)
            self.clear_wake()
        return not self.stalled

    def close(self) -> None:
        os.close(self.wake_fd)
        os.close(self._wake_write)


class _StreamCapture:
    """What happens to one output stream of an exec: head sent at once, tail in a ring, middle dropped.

    ``max_output`` None: everything is sent. Otherwise the first half of it is
    sent as it comes and the last half kept in a ring that is sent at the
    end; what falls out of the ring is counted in ``skipped``. A ring larger
    than ``AGENT_TAIL_LIMIT`` would cost the guest too much memory: then
    everything past the head is sent and the host keeps the tail itself.
    """

    __slots__ = ("discarding", "fd_number", "head_left", "ring", "skipped", "tail_limit", "total")

    def __init__(self, fd_number: int, max_output: int | None) -> None:
        self.fd_number = fd_number
        self.total = 0
        self.skipped = 0
        self.discarding = False
        if max_output is None:
            self.head_left = self.tail_limit = None
            self.ring = None
        else:
            self.tail_limit = max_output // 2
            self.head_left = max_output - self.tail_limit
            self.ring = _TailRing(self.tail_limit) if self.tail_limit <= AGENT_TAIL_LIMIT else None

    def needs_credit(self) -> bool:
        """Whether the next bytes read will be sent (else they go to the ring or are dropped)."""
        if self.discarding:
            return False
        return self.head_left is None or self.head_left > 0 or self.ring is None

    def take(self, data: bytes) -> bytes:
        """Account for ``data`` read from the pipe; return the part to send now."""
        self.total += len(data)
        if self.discarding:
            self.skipped += len(data)
            return b""
        if self.head_left is None:
            return data
        send = data[: self.head_left]
        self.head_left -= len(send)
        rest = data[len(send) :]
        if not rest:
            return send
        if self.ring is None:
            return send + rest
        self.skipped += self.ring.add(rest)
        return send


class _TailRing:
    """The last ``limit`` bytes of a stream, as a queue of chunks (no large copies per chunk)."""

    __slots__ = ("chunks", "limit", "size")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.chunks: collections.deque[bytes] = collections.deque()
        self.size = 0

    def add(self, data: bytes) -> int:
        """Append ``data``; return how many of the oldest bytes fell out."""
        self.chunks.append(data)
        self.size += len(data)
        dropped = 0
        while self.size > self.limit:
            first = self.chunks[0]
            excess = self.size - self.limit
            if len(first) <= excess:
                self.chunks.popleft()
                cut = len(first)
            else:
                self.chunks[0] = first[excess:]
                cut = excess
            self.size -= cut
            dropped += cut
        return dropped

    def contents(self) -> bytes:
        return b"".join(self.chunks)


# -- spawned processes --------------------------------------------------------------


class _Spawned:
    """A process started by ``spawn``: it outlives the request, and its output waits (bounded) for a reader.

    One pump thread per process reads its stdout and stderr (or its terminal)
    as soon as anything arrives, so the process never blocks on a full pipe,
    and keeps what no host has taken in a :class:`_LiveBuffer` per stream: at
    most ``max_output`` bytes, the oldest unread half and the newest half,
    counting what was dropped between them. A host *attaches* with a request
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
        send_frame: Callable[[dict[str, Any], bytes], None],
        finished: Callable[[_Spawned], None],
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
        self._send_frame = send_frame
        self._finished = finished
        self._buffers = {wire.STDOUT: _LiveBuffer(max_output), wire.STDERR: _LiveBuffer(max_output)}
        self._closed_streams = {wire.STDOUT, wire.STDERR} - set(outputs.values())
        self._lock = threading.Lock()
        self._stdin_lock = threading.Lock()
        self._attachment: _Attachment | None = None
        self._replaced: list[_Attachment] = []
        self.exit_code: int | None = None
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._exit_fd = os.pidfd_open(process.pid)
        for fd in self._owned_fds:
            os.set_blocking(fd, False)
        threading.Thread(target=self._pump, name=f"spawned-{self.pid}", daemon=True).start()

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
        child_setup: bool,
        send_frame: Callable[[dict[str, Any], bytes], None],
        finished: Callable[[_Spawned], None],
    ) -> _Spawned:
        """Start ``argv`` in a new session and its own cgroup, on pipes or on a new terminal."""
        group = cgroups.take() if cgroups is not None else None
        command = _entered(argv, group) if child_setup or group is not None else argv
        child_ends: list[int] = []
        ours: list[int] = []
        try:
            if terminal is None:
                stdin_read, stdin_fd = os.pipe2(os.O_CLOEXEC)
                stdout_fd, stdout_write = os.pipe2(os.O_CLOEXEC)
                stderr_fd, stderr_write = os.pipe2(os.O_CLOEXEC)
                child_ends += [stdin_read, stdout_write, stderr_write]
                ours += [stdin_fd, stdout_fd, stderr_fd]
                for fd in (stdout_fd, stderr_fd):
                    with contextlib.suppress(OSError):
                        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _PIPE_SIZE)
                process = subprocess.Popen(
                    command,
                    stdin=stdin_read,
                    stdout=stdout_write,
                    stderr=stderr_write,
                    cwd=cwd,
                    env=env,
                    start_new_session=True,
                )
                outputs = {stdout_fd: wire.STDOUT, stderr_fd: wire.STDERR}
                terminal_fd = None
            else:
                process, terminal_fd = _start_on_terminal(command, env, cwd, terminal)
                ours.append(terminal_fd)
                outputs = {terminal_fd: wire.STDOUT}
                stdin_fd = None
        except BaseException:
            for fd in ours:
                os.close(fd)
            if group is not None and cgroups is not None:
                cgroups.release(group)
            raise
        finally:
            for fd in child_ends:
                os.close(fd)
        return cls(process, argv, outputs, stdin_fd, terminal_fd, group, cgroups, max_output, send_frame, finished)

    # -- requests (handler and reader threads) ---------------------------------------------------

    def describe(self) -> dict[str, Any]:
        return {"pid": self.pid, "command": self.command, "exit_code": self.exit_code}

    def attach(self, request_id: int, client: str | None, window: int) -> None:
        with self._lock:
            if self._attachment is not None:
                self._replaced.append(self._attachment)
            self._attachment = _Attachment(request_id, client, window)
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
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_write, b"w")

    # -- the pump thread ---------------------------------------------------------------------------

    def _pump(self) -> None:
        exited_at = None
        try:
            while True:
                poller = select.poll()
                poller.register(self._wake_read, select.POLLIN)
                if self.exit_code is None:
                    poller.register(self._exit_fd, select.POLLIN)
                for fd in self._open:
                    poller.register(fd, select.POLLIN)
                wait = None
                if exited_at is not None and self._open:
                    wait = exited_at + OUTPUT_DRAIN_AFTER_EXIT - time.monotonic()
                    if wait <= 0:
                        self._give_up_outputs()
                        wait = None
                        continue
                for fd, _events in poller.poll(None if wait is None else max(wait * 1000, 1)):
                    if fd == self._wake_read:
                        with contextlib.suppress(BlockingIOError, OSError):
                            os.read(self._wake_read, 4096)
                    elif fd == self._exit_fd:
                        self.exit_code = self._process.wait()
                        exited_at = time.monotonic()
                    elif fd in self._open:
                        self._read(fd)
                if self._flush():
                    return
        except BaseException as exc:  # a broken pump must not leave the process unaccounted for
            log_to_stderr(f"the output pump of process {self.pid} failed: {exc!r}")
            raise
        finally:
            self._clean_up()

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
                for number, buffer in self._buffers.items():
                    while attachment.credit[number] > 0 and buffer.size:
                        chunk, skipped = buffer.take(min(attachment.credit[number], wire.OUTPUT_CHUNK_SIZE))
                        attachment.credit[number] -= len(chunk)
                        extra = {"skipped": skipped} if skipped else {}
                        frames.append(({"id": request_id, "more": True, "fd": number, **extra}, chunk))
                    if not buffer.size and number in self._closed_streams and number not in attachment.eof_sent:
                        attachment.eof_sent.add(number)
                        frames.append(({"id": request_id, "more": True, "fd": number, "eof": True}, b""))
                if self.exit_code is not None and not attachment.exit_sent:
                    attachment.exit_sent = True
                    frames.append(({"id": request_id, "more": True, **self._exit_fields()}, b""))
                if attachment.exit_sent and len(attachment.eof_sent) == 2:
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
        for fields, payload in frames:
            self._send_frame(fields, payload)
        return done

    def _exit_fields(self) -> dict[str, Any]:
        code = self.exit_code
        return {"exited": True, "exit_code": code, "signal": -code if code is not None and code < 0 else None}

    def _clean_up(self) -> None:
        self._finished(self)
        for fd in self._owned_fds | {self._exit_fd, self._wake_read, self._wake_write}:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._owned_fds.clear()
        if self.exit_code is None:  # the pump failed: do not leave an unreachable process behind
            with contextlib.suppress(OSError):
                os.killpg(self.pid, signal.SIGKILL)
            self._process.wait()
        if self._group is not None and self._cgroups is not None:
            self._cgroups.release(self._group)


class _Attachment:
    """The request a spawned process's output streams to, and the credit it has per stream."""

    __slots__ = ("client", "credit", "eof_sent", "exit_sent", "request_id")

    def __init__(self, request_id: int, client: str | None, window: int) -> None:
        self.request_id = request_id
        self.client = client
        self.credit = {wire.STDOUT: window, wire.STDERR: window}
        self.eof_sent: set[int] = set()
        self.exit_sent = False


class _LiveBuffer:
    """Output of a spawned process that no host took yet: at most ``limit`` bytes, head and tail.

    The first half of the limit keeps the oldest unread bytes, a ring the
    newest; what falls out of the ring between them is dropped and counted
    (``dropped``), and reported with the first bytes read after the gap.
    """

    __slots__ = ("dropped", "gap", "head", "head_limit", "head_size", "tail", "total")

    def __init__(self, limit: int) -> None:
        self.head_limit = limit - limit // 2
        self.head: collections.deque[bytes] = collections.deque()
        self.head_size = 0
        self.tail = _TailRing(limit // 2)
        self.gap = 0
        self.dropped = 0
        self.total = 0

    @property
    def size(self) -> int:
        return self.head_size + self.tail.size

    def add(self, data: bytes) -> None:
        self.total += len(data)
        if not self.tail.size and not self.gap:
            room = self.head_limit - self.head_size
            if room > 0:
                part = data[:room]
                self.head.append(part)
                self.head_size += len(part)
                data = data[room:]
        if data:
            dropped = self.tail.add(data)
            self.gap += dropped
            self.dropped += dropped

    def take(self, limit: int) -> tuple[bytes, int]:
        """Up to ``limit`` of the oldest bytes kept, and how many were dropped just before them."""
        if self.head_size:
            return _pop_front(self.head, limit, self), 0
        skipped, self.gap = self.gap, 0
        chunk = _pop_front(self.tail.chunks, limit, None)
        self.tail.size -= len(chunk)
        return chunk, skipped


def _pop_front(chunks: collections.deque[bytes], limit: int, head_of: _LiveBuffer | None) -> bytes:
    parts = []
    got = 0
    while chunks and got < limit:
        first = chunks[0]
        if len(first) <= limit - got:
            chunks.popleft()
            parts.append(first)
            got += len(first)
        else:
            parts.append(first[: limit - got])
            chunks[0] = first[limit - got :]
            got = limit
    if head_of is not None:
        head_of.head_size -= got
    return b"".join(parts)


def _read_or_eio(fd: int, size: int) -> bytes | None:
    """Read from a pipe or terminal: b"" at its end (EIO: a terminal nobody holds), None if nothing is there."""
    try:
        return os.read(fd, size)
    except BlockingIOError:
        return None
    except OSError as exc:
        if exc.errno == errno.EIO:
            return b""
        raise


def _terminal_size(fields: dict[str, Any]) -> tuple[int, int] | None:
    """``pty``: absent, false or null for pipes; true (24x80) or ``[rows, columns]`` for a terminal."""
    value = fields.get("pty")
    if value is None or value is False:
        return None
    if value is True:
        return (24, 80)
    if (
        isinstance(value, list)
        and len(value) == 2
        and all(type(number) is int and 0 < number < 65536 for number in value)
    ):
        return (value[0], value[1])
    raise RequestError("BadRequest", f"'pty' must be true or [rows, columns] between 1 and 65535, got {value!r}")


def _set_window_size(fd: int, size: tuple[int, int]) -> None:
    import struct
    import termios

    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", size[0], size[1], 0, 0))


def _take_terminal() -> None:
    """In the child, after setsid: make its stdin (the terminal) its controlling terminal."""
    import termios

    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _start_on_terminal(
    command: list[str], env: dict[str, str] | None, cwd: str | None, size: tuple[int, int]
) -> tuple[subprocess.Popen[bytes], int]:
    """Start ``command`` as a session leader on a new pseudo-terminal; return it and the terminal's master fd."""
    import termios  # noqa: F401 - imported here so that the child does not import after fork

    master, slave = os.openpty()
    try:
        _set_window_size(master, size)
        process = subprocess.Popen(
            command,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            cwd=cwd,
            env=env,
            start_new_session=True,
            preexec_fn=_take_terminal,
        )
    except BaseException:
        os.close(master)
        raise
    finally:
        os.close(slave)
    return process, master


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


# -- running commands ------------------------------------------------------------


class CommandCgroups:
    """Gives every running command its own cgroup v2 below ``ROOT/forkd``, so that it dies alone.

    The ``forkd`` group caps the memory of all commands together a little
    under what the guest has free, so the kernel's out-of-memory killer picks
    a command (with ``memory.oom.group``: all of it) instead of the agent;
    each command's group caps its number of processes, so a fork bomb stops
    there; a timeout kills the whole group through ``cgroup.kill``, background
    processes included. A group is reused once all its processes are gone
    (creating and removing one costs more than running ``true``); a group
    that background processes still occupy waits for a later sweep.
    """

    def __init__(self, base: str, log: Callable[[str], None]) -> None:
        self._base = base
        self._log = log
        self._counter = 0
        self._lock = threading.Lock()
        self._occupied: list[_CommandGroup] = []
        self._free: list[_CommandGroup] = []

    @classmethod
    def setup(cls, root: str = CGROUP_ROOT, log: Callable[[str], None] = log_to_stderr) -> CommandCgroups | None:
        """Prepare ``ROOT/forkd``; None (commands run without limits) when cgroup2 is not there."""
        if not os.path.exists(os.path.join(root, "cgroup.controllers")):
            log(f"no cgroup2 hierarchy at {root}: commands run without memory and process limits")
            return None
        base = os.path.join(root, "forkd")
        try:
            _enable_controllers(root, log)
            os.makedirs(base, exist_ok=True)
            _write_text(os.path.join(base, "memory.max"), str(_command_memory_limit()))
            _enable_controllers(base, log)
        except OSError as exc:
            log(f"cannot set up command cgroups under {root}: {exc}; commands run without limits")
            return None
        cgroups = cls(base, log)
        # Left by an agent that died: reuse or remove them as they empty.
        cgroups._occupied = [_CommandGroup(entry.path) for entry in os.scandir(base) if entry.is_dir()]
        cgroups.prepare()
        return cgroups

    def take(self) -> _CommandGroup:
        """An empty group for one command: a free one, else a new one."""
        with self._lock:
            group = self._free.pop() if self._free else None
        if group is None:
            group = self.create()
        group.start()
        return group

    def release(self, group: _CommandGroup) -> None:
        """Take back a finished command's group: free at once if empty, else swept later."""
        if group.is_empty():
            with self._lock:
                if len(self._free) < _FREE_GROUPS:
                    self._free.append(group)
                    return
            group.remove()
            return
        with self._lock:
            self._occupied.append(group)

    def prepare(self) -> None:
        """Sweep occupied groups and keep one free, off the commands' critical path."""
        with self._lock:
            occupied, self._occupied = self._occupied, []
        for group in occupied:
            if group.is_empty():
                self.release(group)
            else:
                with self._lock:
                    self._occupied.append(group)
        with self._lock:
            if self._free:
                return
        try:
            spare = self.create()
        except OSError as exc:
            self._log(f"cannot create a command cgroup: {exc}")
            return
        self.release(spare)

    def create(self) -> _CommandGroup:
        """A new, empty group for one command."""
        with self._lock:
            self._counter += 1
            path = os.path.join(self._base, f"cmd-{os.getpid()}-{self._counter}")
        os.mkdir(path)
        group = _CommandGroup(path)
        for name, value in (("pids.max", COMMAND_PIDS_MAX), ("memory.oom.group", 1)):
            try:
                _write_text(os.path.join(path, name), str(value))
            except OSError as exc:
                self._log(f"cannot set {name} of {path}: {exc}")
        return group


class _CommandGroup:
    __slots__ = ("_oom_kills_before", "path", "procs")

    def __init__(self, path: str) -> None:
        self.path = path
        self.procs = os.fsencode(os.path.join(path, "cgroup.procs"))
        self._oom_kills_before = 0

    def start(self) -> None:
        """A command is about to run in the group: its OOM kills are counted from here."""
        self._oom_kills_before = self._oom_kills()

    def kill(self) -> None:
        """SIGKILL every process of the group (cgroup.kill, Linux 5.14+; else one by one)."""
        try:
            _write_text(os.path.join(self.path, "cgroup.kill"), "1")
            return
        except OSError:
            pass
        for _ in range(10):
            try:
                with open(self.procs, "rb") as procs:
                    pids = [int(line) for line in procs.read().split()]
            except OSError:
                return
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)

    def is_empty(self) -> bool:
        try:
            return "populated 0" in _read_text(os.path.join(self.path, "cgroup.events"))
        except OSError:
            return False

    def wait_until_empty(self, timeout: float) -> bool:
        """Wait (boundedly) until every process of the group is gone, as after a kill."""
        deadline = time.monotonic() + timeout
        while not self.is_empty():
            if time.monotonic() >= deadline or not os.path.isdir(self.path):
                return False
            time.sleep(0.01)
        return True

    def oom_killed(self) -> bool:
        """Whether the out-of-memory killer killed a process of the group since :meth:`start`."""
        return self._oom_kills() > self._oom_kills_before

    def _oom_kills(self) -> int:
        try:
            with open(os.path.join(self.path, "memory.events")) as events:
                counts = dict(line.split() for line in events if line.strip())
            return int(counts.get("oom_kill", 0))
        except (OSError, ValueError):
            return 0

    def remove(self) -> bool:
        try:
            os.rmdir(self.path)
        except FileNotFoundError:
            return True
        except OSError:
            return False  # EBUSY: processes left in it
        return True


def _enable_controllers(group: str, log: Callable[[str], None]) -> None:
    available = set(_read_text(os.path.join(group, "cgroup.controllers")).split())
    for controller in ("memory", "pids", "cpu"):
        if controller not in available:
            log(f"cgroup controller {controller} is not available in {group}")
            continue
        try:
            _write_text(os.path.join(group, "cgroup.subtree_control"), f"+{controller}")
        except OSError as exc:
            log(f"cannot enable cgroup controller {controller} in {group}: {exc}")


def _command_memory_limit() -> int:
    """Bytes all commands together may use: what is free now, less a reserve for the agent."""
    meminfo = {}
    with open("/proc/meminfo") as source:
        for line in source:
            name, _, rest = line.partition(":")
            meminfo[name] = int(rest.split()[0]) * 1024
    available = meminfo.get("MemAvailable", meminfo.get("MemTotal", 0))
    reserve = max(AGENT_MEMORY_RESERVE, meminfo.get("MemTotal", 0) // 8)
    return max(available - reserve, MIN_COMMAND_MEMORY)


def _read_text(path: str) -> str:
    with open(path) as source:
        return source.read()


def _write_text(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def protect_from_oom_killer() -> None:
    """Make the out-of-memory killer never choose this process (needs CAP_SYS_RESOURCE)."""
    try:
        _write_text("/proc/self/oom_score_adj", "-1000")
    except OSError as exc:
        log_to_stderr(f"cannot protect the agent from the OOM killer: {exc}")


# Run in front of a command in the guest: join its cgroup and become a preferred OOM
# victim, then exec it. A shell from busybox costs a few ms; doing the same in
# Python between fork and exec (preexec_fn) rules out vfork and costs several times that.
_ENTER_SCRIPT = 'echo 0 > "$1" || exit 125; echo "$2" > /proc/self/oom_score_adj; shift 2; exec "$@"'


def _entered(argv: list[str], group: _CommandGroup | None) -> list[str]:
    """``argv`` prefixed so that it runs inside ``group`` with a raised OOM score.

    A shell command (``/bin/sh -c SCRIPT``) gets the two steps in front of its
    script, on the same line so that its line numbers stay right: that shell
    is started anyway, so it costs no extra program.
    """
    procs = os.fsdecode(group.procs) if group is not None else "/dev/null"
    if len(argv) == 3 and argv[:2] == ["/bin/sh", "-c"] and "'" not in procs:
        enter = f"echo 0 > '{procs}' || exit 125; echo {COMMAND_OOM_SCORE_ADJ} > /proc/self/oom_score_adj; "
        return ["/bin/sh", "-c", enter + argv[2]]
    return ["/bin/sh", "-c", _ENTER_SCRIPT, "forkd-exec", procs, str(COMMAND_OOM_SCORE_ADJ), *argv]


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
    child_setup: bool,
    running: dict[int, _CommandCollector],
    terminal: tuple[int, int] | None = None,
) -> _CommandRun:
    """Run ``argv`` in a new session (and its own cgroup), streaming its stdout and stderr.

    ``terminal`` (rows, columns): run it on a new pseudo-terminal instead of
    pipes; what it writes to the terminal is its stdout, and ``stdin`` is typed in.
    """
    started = time.monotonic()
    captures = [_StreamCapture(wire.STDOUT, max_output), _StreamCapture(wire.STDERR, max_output)]
    group = cgroups.take() if cgroups is not None else None
    outputs: list[IO[bytes]] | None = None
    stdin_file: IO[bytes] | None = None
    try:
        try:
            command = _entered(argv, group) if child_setup or group is not None else argv
            if terminal is None:
                process = subprocess.Popen(
                    command,
                    stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    cwd=cwd,
                    env=env,
                    start_new_session=True,
                )
            else:
                process, master = _start_on_terminal(command, env, cwd, terminal)
                outputs = [os.fdopen(master, "rb", buffering=0)]
                if stdin:
                    stdin_file = os.fdopen(os.dup(master), "wb", buffering=0)
        except OSError as exc:
            if exc.filename is None or exc.filename == cwd:
                raise  # could not fork or enter cwd: not the program's fault
            # Report it like a shell does, as the command's own failure.
            exit_code = 127 if isinstance(exc, FileNotFoundError) else 126
            message = captures[1].take(f"{argv[0]}: {exc.strerror}\n".encode())
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


# -- helpers -----------------------------------------------------------------------


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


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _unignore_terminal_signals() -> None:
    """Give the commands the agent runs the default reaction to Ctrl-C and Ctrl-\\.

    A signal ignored by a process stays ignored in every program it runs, and a
    shell cannot undo that; an agent started from the background of a script
    (SIGINT and SIGQUIT ignored) would run commands that a typed Ctrl-C does not
    stop. A handled signal is reset to its default by exec, so the agent handles
    them itself instead of ignoring them.
    """
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGQUIT) is signal.SIG_IGN:
        signal.signal(signal.SIGQUIT, lambda signum, frame: None)


def main(argv: list[str] | None = None) -> int:
    """``agent.py PORT_DEVICE`` in the guest; ``agent.py --stdio`` on a host, over stdin/stdout."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: agent.py PORT_DEVICE | --stdio", file=sys.stderr)
        return 2
    _unignore_terminal_signals()
    if args[0] == "--stdio":
        # Outside a guest: never move the machine's clock, even as root.
        agent = Agent(sys.stdin.fileno(), sys.stdout.fileno(), set_clock=_leave_clock_alone)
    else:
        try:
            port = os.open(args[0], os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            log_to_stderr(f"cannot open the agent port: {exc}")
            return 1
        protect_from_oom_killer()
        agent = Agent(port, port, wait_on_eof=True, cgroups=CommandCgroups.setup(), oom_target=True)
    log_to_stderr(f"serving on {args[0]} (pid {os.getpid()})")
    try:
        agent.serve_forever()
    except OSError as exc:
        log_to_stderr(f"cannot read requests any more: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
