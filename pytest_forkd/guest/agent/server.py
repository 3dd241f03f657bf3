"""The protocol loop: reads requests, answers pings, hands every other request to a thread of its own."""

from __future__ import annotations

import functools
import os
import sys
import threading
import time

from .cgroups import CommandCgroups, protect_from_oom_killer
from .commands import _check_program, _CommandCollector, _run_command
from .common import (
    CANCEL_WAIT,
    MAX_OUTPUT_WINDOW,
    RECONNECT_POLL_INTERVAL,
    RequestError,
    _command_argv,
    _current,
    _leave_clock_alone,
    _optional,
    _os_error_fields,
    _request_env,
    _required,
    _tarstream,
    _write_frame,
    _write_frames,
    log_to_stderr,
    mix_into_urandom,
    set_wall_clock,
)
from .files import _ArchiveSink, _InPlaceUpload, _MemorySink, _RefusedPayload, _UploadSink, _WithdrawnPayload
from .processes import _ProcessPump, _Spawned
from .streams import _OutputStream, _send_within_credit, _StreamCapture, _StreamStopper
from .terminal import _terminal_size, _unignore_terminal_signals
from .users import ROOT, Credentials, ImageRoot, acting_as, enter_image, prepare_user_switch, resolve_user

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
    from typing import Any, TypeAlias

    #: What a request's payload goes into (see ``Agent._sink_for``).
    _Sink: TypeAlias = "_MemorySink | _UploadSink | _InPlaceUpload | _ArchiveSink | _RefusedPayload"


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
        image: ImageRoot | None = None,
    ) -> None:
        self._fd_in = fd_in
        self._image = image
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
        self._pump = _ProcessPump()
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
        try:
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
        finally:
            self._pump.close()  # its thread ends with the last process it follows

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

    def _sink_for(self, fields: dict[str, Any]) -> _Sink:
        if fields["op"] == "write_file" and isinstance(fields.get("path"), str):
            return self._upload_sink(fields)
        if fields["op"] == "copy_in" and isinstance(fields.get("path"), str):
            return _ArchiveSink(fields["path"])
        return _MemorySink()

    def _upload_sink(self, fields: dict[str, Any]) -> _Sink:
        """A ``write_file`` as root replaces the file atomically; as another user it writes in place, as that user."""
        user = fields.get("user")
        if user is None:
            return _UploadSink(fields["path"], fields["id"])
        try:
            if not isinstance(user, str):
                raise RequestError("BadRequest", "'user' must be a string (NAME, UID, NAME:GROUP or UID:GID)")
            credentials = self._image.credentials(user) if self._image is not None else resolve_user(user)
        except RequestError as exc:
            return _RefusedPayload(exc)
        if credentials.is_root:
            return _UploadSink(fields["path"], fields["id"])
        return _InPlaceUpload(fields["path"], lambda: acting_as(credentials))

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
        if incoming.fields["op"] == "spawn":  # short (a vfork and an exec): on the thread that follows processes
            self._pump.run(functools.partial(self._handle, incoming.fields, incoming.sink))
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

    def _handle(self, fields: dict[str, Any], sink: _Sink) -> None:
        try:
            error = self._perform(fields, sink)
        finally:
            # Before any error reply: the host must never see a stale upload file.
            sink.discard()
        if error is not None:
            self._send_error(fields["id"], error)

    def _perform(self, fields: dict[str, Any], sink: _Sink) -> dict[str, Any] | None:
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

    def _credentials(
        self, fields: dict[str, Any], env: dict[str, str] | None
    ) -> tuple[Credentials, dict[str, str] | None]:
        """Who a command runs as (the request's ``user``, else the image's), and its env with that user's HOME."""
        user = _optional(fields, "user", str)
        if self._image is not None:
            credentials = self._image.credentials(user)
        else:
            credentials = resolve_user(user) if user else ROOT
        if user and "HOME" not in (fields.get("env") or {}):
            env = {**(env if env is not None else os.environ), "HOME": credentials.home}
        return credentials, env

    def _exec(self, fields: dict[str, Any], sink: _MemorySink) -> None:
        argv = _command_argv(fields)
        env = _request_env(fields)
        cwd = _optional(fields, "cwd", str)
        credentials, env = self._credentials(fields, env)
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
                oom_target=self._oom_target,
                running=self._running,
                terminal=terminal,
                credentials=credentials,
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

    def _write_file(self, fields: dict[str, Any], sink: _UploadSink | _InPlaceUpload | _RefusedPayload) -> None:
        _required(fields, "path", str)  # the sink opened its file (beside it, or as the user) at the first frame
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
        env = _request_env(fields)
        cwd = _optional(fields, "cwd", str)
        max_output = _optional(fields, "max_output", int)
        if max_output is None or max_output < 0:
            raise RequestError("BadRequest", f"'max_output' must be a number of bytes >= 0, got {max_output}")
        terminal = _terminal_size(fields)
        stdin = fields.get("stdin", True)
        if not isinstance(stdin, bool):
            raise RequestError("BadRequest", f"'stdin' must be true or false, got {stdin!r}")
        credentials, env = self._credentials(fields, env)
        _check_program(argv, env if env is not None else os.environ, cwd)
        spawned = _Spawned.start(
            argv,
            env=env,
            cwd=cwd,
            terminal=terminal,
            max_output=max_output,
            cgroups=self._cgroups,
            oom_target=self._oom_target,
            send_frames=self._send_frames,
            finished=self._forget_process,
            pump=self._pump,
            credentials=credentials,
            stdin=stdin,
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
        """Stream the process's output to the request, whose first frame names the process.

        Under the client lock, which every attachment takes: a host may attach
        another request as soon as it reads the first frame, and that
        attachment must come after this one, not be replaced by it.
        """
        window = _optional(fields, "window", int) or wire.OUTPUT_WINDOW
        window = min(max(window, 1), MAX_OUTPUT_WINDOW)
        client = fields.get("client") if isinstance(fields.get("client"), str) else None
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

    def _copy_in(self, fields: dict[str, Any], sink: _Sink) -> None:
        """The archive was unpacked as it arrived (see _ArchiveSink): report how it went."""
        _required(fields, "path", str)
        if not isinstance(sink, _ArchiveSink):
            raise RequestError("BadRequest", "'copy_in' needs 'path', a string")
        stats = sink.finish()
        self._send({"id": fields["id"], **stats.to_json()})

    def _copy_out(self, fields: dict[str, Any], sink: _Sink) -> None:
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

    def _handle_cancellable(self, fields: dict[str, Any], sink: _Sink) -> None:
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

    def _send_frames(self, frames: Sequence[tuple[dict[str, Any], bytes | memoryview]]) -> None:
        """Send frames together, in one write where the channel takes it (each write costs under emulation)."""
        parts: list[bytes | memoryview] = []
        for fields, payload in frames:
            parts += [wire.encode_header(fields, len(payload)), payload]
        try:
            with self._write_lock:
                _write_frames(self._fd_out, parts)
        except OSError as exc:
            self._log(f"cannot send the reply to request {frames[0][0]['id']}: {exc}")


class _IncomingRequest:
    __slots__ = ("fields", "sink")

    def __init__(self, fields: dict[str, Any], sink: _Sink) -> None:
        self.fields = fields
        self.sink: _Sink | _WithdrawnPayload = sink


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


def main(argv: list[str] | None = None) -> int:
    """``agent PORT_DEVICE`` in the guest; ``agent --stdio`` on a host, over stdin/stdout."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: agent PORT_DEVICE | --stdio", file=sys.stderr)
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
        prepare_user_switch()
        image = enter_image()
        agent = Agent(port, port, wait_on_eof=True, cgroups=CommandCgroups.setup(), oom_target=True, image=image)
    log_to_stderr(f"serving on {args[0]} (pid {os.getpid()})")
    try:
        agent.serve_forever()
    except OSError as exc:
        log_to_stderr(f"cannot read requests any more: {exc}")
        return 1
    return 0
