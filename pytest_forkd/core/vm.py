"""The VM handle: what tests and agents hold.

A :class:`VM` pairs one machine (a :class:`~pytest_forkd.engine.base.Machine`
of the factory's engine: a QEMU process, or the fake engine's agent process)
with the guest agent's connection. It turns channel failures into
:class:`GuestCrashed` errors that carry the console tail, records how long
every operation took, and keeps a :class:`~pytest_forkd.analysis.transcript.Transcript`
of every operation for failure reports, transcript files and replays. VMs are
created by a :class:`~pytest_forkd.core.factory.VMFactory`, which owns them and
kills them all on close.
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence, TypeVar

from pytest_forkd.analysis.changes import changes_since, record_manifest
from pytest_forkd.analysis.transcript import Transcript
from pytest_forkd.core import validate
from pytest_forkd.core.branching import _auto_tag, branch, freeze
from pytest_forkd.core.checkpoint import Checkpoint
from pytest_forkd.core.handles import VMOwner
from pytest_forkd.core.process import GuestProcess, output_bounds
from pytest_forkd.engine.network import (
    FORWARD_WAIT_S,
    NetworkChoice,
    NetworkError,
    NetworkSpec,
    check_card,
    listening_addresses,
    network_spec,
    port_number,
)
from pytest_forkd.errors import ChangesError, ExecTimeout, GuestProtocolError, NoSuchProcess, VMError, WaitTimeout
from pytest_forkd.guest.client import DEFAULT_MAX_OUTPUT, AgentClient, AgentTimeout, ChannelClosed, spawn_request
from pytest_forkd.guest.exec_result import ExecResult
from pytest_forkd.latency import timings
from pytest_forkd.paths import validate_tag
from pytest_forkd.waiting import poll_until

if TYPE_CHECKING:
    from pytest_forkd.analysis.changes import Changes
    from pytest_forkd.core.copy import CopyResult
    from pytest_forkd.engine.base import AnyMachine
    from pytest_forkd.image import Image
    from pytest_forkd.storage.snapshot import Snapshot

_T = TypeVar("_T")

# Output kept of forkd's own bookkeeping commands (file manifests of large trees).
UNTRACKED_MAX_OUTPUT = 256 << 20


class VM:
    """A running microVM. Use as a context manager or call :meth:`close`."""

    def __init__(
        self,
        machine: "AnyMachine",
        agent: AgentClient,
        *,
        factory: VMOwner,
        image: "Image",
        origin: "Snapshot | None" = None,
        memory_base: "Snapshot | None" = None,
    ) -> None:
        self._machine = machine
        self._agent = agent
        self._factory = factory
        self._forwards: dict[int, int] = {}  # guest port -> host port, in this VM's QEMU process
        self.image = image
        self.origin = origin
        """The snapshot this VM was forked or restored from (None for a booted root VM)."""
        self.memory_base = memory_base
        """The snapshot whose flat memory file this VM maps copy-on-write (diffs are taken against it)."""
        self.transcript = Transcript(machine.name, origin)
        """Every operation asked of this VM, in order (see :mod:`pytest_forkd.analysis.transcript`)."""
        self.generation = 0
        """Bumped by every operation that may change guest state (exec, write_file, restore)."""
        self._cold = True
        self._closed = False
        self._lock = threading.RLock()
        self.default_backend: str | None = None
        """Storage backend of this VM's branches and checkpoints that name none (None: its factory's)."""
        self.max_output = DEFAULT_MAX_OUTPUT
        """Bytes of each of stdout and stderr an exec keeps unless it says otherwise (head and tail)."""
        self.broken: str | None = None
        """Why this VM was cut off (its guest broke the agent protocol), or None."""
        self._start_error: VMError | None = None  # its agent never answered (set by fork_snapshot(wait_ready=False))
        self._env: dict[str, str] = {}
        self._cwd: str | None = None
        self.restore_phases: Any = None
        """For a child of a snapshot: where its restore's time went (``factory.RestorePhases``), else None."""
        self._inherit_defaults(origin)
        self._processes: dict[int, GuestProcess] = {}  # handles of spawned processes, by guest pid

    # -- identity -------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._machine.name

    @property
    def memory_mib(self) -> int:
        memory_mib: int = self._machine.spec.memory_mib
        return memory_mib

    @property
    def factory(self) -> VMOwner:
        return self._factory

    @property
    def machine(self) -> "AnyMachine":
        """The engine-level process (for storage backends and diagnostics)."""
        return self._machine

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def protocol_errors(self) -> dict[str, int]:
        """Malformed or unexpected frames its guest sent so far, by kind (see GuestProtocolError)."""
        return dict(self._agent.protocol_errors)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"pid {self._machine.pid}"
        return f"<VM {self.name} {self.memory_mib} MiB image={self.image.name} {state}>"

    # -- per-VM defaults ----------------------------------------------------------
    @property
    def env(self) -> dict[str, str]:
        """Environment variables every exec of this VM gets unless the call overrides them.

        A per-call ``env`` is merged over this one. Children forked from a
        snapshot of this VM (branch, checkpoint, fork) start with the same
        defaults: they are recorded in the snapshot. Assign a new dict to
        replace them, or change this dict in place.
        """
        return self._env

    @env.setter
    def env(self, value: Mapping[str, str] | None) -> None:
        validate.environment(value)
        self._env = dict(value or {})

    @property
    def cwd(self) -> str | None:
        """Working directory of every exec that does not pass ``cwd`` (None: the agent's own)."""
        return self._cwd

    @cwd.setter
    def cwd(self, value: str | None) -> None:
        if value is not None:
            validate.guest_path(value, "cwd")
        self._cwd = value

    def defaults(self) -> dict[str, Any]:
        """The per-VM defaults as recorded in a snapshot's ``extra`` (``env`` and ``cwd``)."""
        return {"env": dict(self._env), "cwd": self._cwd}

    def _inherit_defaults(self, snapshot: "Snapshot | None") -> None:
        """Take the defaults recorded in ``snapshot`` (none recorded: empty env, no cwd)."""
        extra = snapshot.extra if snapshot is not None else {}
        env = extra.get("env")
        cwd = extra.get("cwd")
        self._env = {str(key): str(value) for key, value in env.items()} if isinstance(env, Mapping) else {}
        self._cwd = cwd if isinstance(cwd, str) and cwd.startswith("/") else None

    def _with_defaults(
        self, env: Mapping[str, str] | None, cwd: str | None
    ) -> tuple[dict[str, str] | None, str | None]:
        """The env and cwd one call runs with: the call's own over the VM's defaults."""
        validate.environment(self._env)  # changed in place since it was set: check it again
        merged = {**self._env, **env} if env else dict(self._env)
        return (merged or None), (cwd if cwd is not None else self._cwd)

    # -- guest operations -------------------------------------------------------
    def exec(
        self,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | str | None = None,
        check: bool = False,
        max_output: int | None = None,
        timing: str = timings.TIMING_HARNESS,
        pty: bool | tuple[int, int] = False,
        user: str | None = None,
    ) -> ExecResult:
        """Run ``command`` in the guest: a str runs under ``/bin/sh -c``, a list is an argv.

        ``user`` runs it as another user, as ``docker exec --user`` does: a
        name from the guest's ``/etc/passwd``, a number, or either with
        ``:GROUP``; None: the image's own ``User`` (root in forkd's image).

        ``timing="workload"`` records the command's latency under row
        ``exec[workload]`` instead of ``exec``: a test's own workload (running
        the code under test) then stays out of budgets and baselines on the
        sandbox's ``exec`` round trip.

        ``env`` is merged over :attr:`env` and ``cwd`` defaults to :attr:`cwd`.
        Of each of stdout and stderr at most ``max_output`` bytes are kept
        (default :attr:`max_output`): the first and last halves, with
        ``truncated`` set on the result when the middle was dropped. Raises
        :class:`ExecTimeout` (with the partial output) when ``timeout``
        expires, :class:`GuestCrashed` if the guest dies meanwhile,
        :class:`GuestProtocolError` if its agent broke the protocol, and
        :class:`ExecError` for a non-zero exit when ``check`` is true.

        ``pty=True`` (or ``(rows, columns)``, default 24x80) runs the command
        on a new pseudo-terminal in the guest, as its controlling terminal:
        ``stdout`` is what it wrote to the terminal (lines end in ``\\r\\n``),
        ``stderr`` is empty, and ``stdin`` is typed in.
        """
        validate.command(command)
        validate.timeout(timeout)
        validate.environment(env)
        validate.user(user)
        timing_op = timings.tagged_op(timings.OP_EXEC, timing)
        if cwd is not None:
            validate.guest_path(cwd, "cwd")
        if max_output is not None:
            validate.max_output(max_output)
        env, cwd = self._with_defaults(env, cwd)
        self.generation += 1
        entry = self.transcript.begin_exec(command, cwd=cwd, env=env, stdin=stdin, timeout=timeout)
        started = time.perf_counter()
        try:
            result = self._call(
                f"running {command!r}",
                self._agent.exec,
                command,
                timeout=timeout,
                env=env,
                cwd=cwd,
                stdin=stdin,
                max_output=self.max_output if max_output is None else max_output,
                **({"pty": pty} if pty else {}),
                **({"user": user} if user is not None else {}),
            )
        except ExecTimeout as exc:
            Transcript.finish(entry, started, result=exc.result, error=exc)
            raise
        except BaseException as exc:
            Transcript.finish(entry, started, error=exc)
            raise
        finally:
            self._record_timing(timing_op, (time.perf_counter() - started) * 1000, extra={"timing": timing})
        Transcript.finish(entry, started, result=result)
        if check:
            result.check()
        return result

    def spawn(
        self,
        command: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        pty: bool | tuple[int, int] = False,
        max_output: int | None = None,
        user: str | None = None,
        stdin: bool = True,
    ) -> GuestProcess:
        """Start ``command`` in the guest and return at once with its :class:`~pytest_forkd.core.process.GuestProcess`.

        A str runs under ``/bin/sh -c``, a list is an argv; ``env`` is merged
        over :attr:`env` and ``cwd`` defaults to :attr:`cwd`, as for
        :meth:`exec`. The process runs in its own session and cgroup, like an
        exec, until it ends or is killed; it keeps running across other calls
        and in every VM started from a snapshot of this one (see
        :meth:`process`). ``user``: as for :meth:`exec`. Its stdout and stderr stream to the handle as lines;
        at most ``max_output`` bytes of each (default :attr:`max_output`) wait
        unread, on the host and in the guest together: past that the middle
        of what nobody read is dropped. ``pty``: run it on a terminal, as
        :meth:`exec` does. ``stdin=False``: it reads end-of-file at once (``write_stdin`` then fails).

        A program that does not exist raises
        :class:`~pytest_forkd.errors.CommandNotFound` naming it.
        """
        validate.command(command)
        validate.environment(env)
        validate.user(user)
        if cwd is not None:
            validate.guest_path(cwd, "cwd")
        if max_output is not None:
            validate.max_output(max_output)
        limit = self.max_output if max_output is None else max_output
        env, cwd = self._with_defaults(env, cwd)
        window, guest_limit = output_bounds(limit)
        request = spawn_request(command, env=env, cwd=cwd, max_output=guest_limit, pty=pty, user=user, stdin=stdin)
        self.generation += 1
        entry = self.transcript.record(
            "spawn",
            command=command if isinstance(command, str) else list(command),
            cwd=cwd,
            env_keys=sorted(env) if env else [],
            pty=bool(pty),
        )
        started = time.perf_counter()
        process = GuestProcess(self, command, pty=bool(pty), max_output=limit, window=window)
        try:
            self._call(f"spawning {command!r}", process._start, request)
        except BaseException as exc:
            Transcript.finish(entry, started, error=exc)
            raise
        Transcript.finish(entry, started)
        entry["pid"] = process.pid
        with self._lock:
            # Handles of processes that ended and were read to the end are the caller's alone now.
            self._processes = {pid: known for pid, known in self._processes.items() if not known._finished}
            self._processes[process.pid] = process
        return process

    def process(self, pid: int) -> GuestProcess:
        """The handle of process ``pid`` spawned in this guest, attaching one if this VM has none yet.

        That is how a VM forked from a snapshot gets at the processes its
        parent had spawned: they run in it too (its guest memory is a copy),
        and ``child.process(pid)`` follows one; its output from then on is
        the child's own. Raises :class:`~pytest_forkd.errors.NoSuchProcess`
        if the guest knows no such process (never spawned, or ended and its
        result was already taken).
        """
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise validate.InvalidArgument(f"pid must be a positive process id, got {pid!r}")
        with self._lock:
            known = self._processes.get(pid)
        if known is not None:
            return known
        listed = {item["pid"]: item for item in self._call("listing processes", self._agent.processes)}
        if pid not in listed:
            raise NoSuchProcess(
                f"VM {self.name} has no spawned process {pid} (spawned processes now: "
                f"{sorted(listed) or 'none'}); it may have ended and been waited for already"
            )
        command = listed[pid].get("command")
        process = GuestProcess(
            self,
            command if isinstance(command, list) and command else [str(pid)],
            pty=False,
            max_output=self.max_output,
        )
        self._call(f"attaching to process {pid}", process._attach, pid)
        with self._lock:
            return self._processes.setdefault(pid, process)

    def processes(self) -> list[GuestProcess]:
        """Handles of every spawned process the guest still tracks (running, or ended and not yet waited for)."""
        listed = self._call("listing processes", self._agent.processes)
        return [self.process(item["pid"]) for item in listed]

    def write_file(self, path: str, data: bytes | str, *, mode: int | None = None, user: str | None = None) -> None:
        """Write ``data`` to ``path`` in the guest (atomically, binary-safe).

        ``user`` (not root): write it in place as that user instead, as ``cat > path`` run as the user would
        (its permissions apply, a new file is its own), streamed straight into the file.
        """
        validate.guest_path(path)
        validate.user(user)
        if not isinstance(data, (bytes, bytearray, memoryview, str)):
            raise validate.InvalidArgument(f"data for {path} must be bytes or str, got {type(data).__name__}")
        if mode is not None and (isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o7777):
            raise validate.InvalidArgument(f"mode for {path} must be a permission number such as 0o644, got {mode!r}")
        self.generation += 1
        entry = self.transcript.write_file(path, data, mode)
        if user is not None:
            entry["user"] = user
        started = time.perf_counter()
        try:
            self._call(f"writing {path}", self._agent.write_file, path, data, mode=mode, user=user)
        except BaseException as exc:
            Transcript.finish(entry, started, error=exc)
            raise
        Transcript.finish(entry, started)

    def write_stream(self, path: str, chunks: Iterable[bytes], *, mode: int | None = None) -> int:
        """Write ``path`` from ``chunks`` as they come, atomically, as :meth:`write_file`; returns the bytes written.

        Nothing is held on the host but the chunk in flight; if ``chunks`` raises, ``path`` keeps its old
        contents (see :mod:`pytest_forkd.core.upload`).
        """
        from pytest_forkd.core.upload import write_stream

        self.generation += 1
        return write_stream(self, path, chunks, mode)

    def read_file(self, path: str, *, max_size: int | None = None) -> bytes:
        """Return the contents of ``path`` in the guest; larger than ``max_size`` (default 64 MiB) fails."""
        validate.guest_path(path)
        entry = self.transcript.record("read_file", path=path)
        started = time.perf_counter()
        try:
            data = self._call(
                f"reading {path}", self._agent.read_file, path, **({} if max_size is None else {"max_size": max_size})
            )
        except BaseException as exc:
            Transcript.finish(entry, started, error=exc)
            raise
        Transcript.finish(entry, started)
        entry["bytes"] = len(data)
        return data

    def _exec_untracked(
        self, command: str | Sequence[str], *, stdin: bytes | None = None, timeout: float | None = None
    ) -> ExecResult:
        """Run forkd's own bookkeeping command (manifests, hashes): not in the transcript, not timed."""
        return self._call(
            f"running {command!r}",
            self._agent.exec,
            command,
            stdin=stdin,
            timeout=timeout,
            max_output=UNTRACKED_MAX_OUTPUT,
        )

    def _read_file_untracked(self, path: str) -> bytes:
        """Read a file for forkd's own bookkeeping (manifests, old content): not in the transcript."""
        return self._call(f"reading {path}", self._agent.read_file, path)

    def copy_in(
        self, local_path: "str | os.PathLike[str]", guest_path: str, *, exclude: Iterable[str] = ()
    ) -> "CopyResult":
        """Copy a host file or directory tree to ``guest_path`` in the guest, streamed (tar over the channel).

        ``guest_path`` names the copy itself: a directory's contents land in
        that directory (made with its parents, or merged into one already
        there), a file at exactly that path. Modes, symbolic links and
        modification times are kept. ``exclude``: glob patterns of names
        (``*.pyc``, ``.git``) or relative paths (``build/*``) to leave out.
        A missing local path, a file where a directory is expected or no
        space left in the guest raises :class:`CopyError` naming the path;
        the VM stays usable. See :mod:`pytest_forkd.core.copy`.
        """
        from pytest_forkd.core import copy

        source = copy.local_path(local_path)
        validate.guest_path(guest_path, "guest_path")
        patterns = copy.patterns(exclude)
        self.generation += 1
        return self._copy(
            "copy_in",
            f"copying {source} into {guest_path}",
            copy.copy_in,
            source,
            guest_path,
            patterns,
            local=source,
            path=guest_path,
        )

    def copy_out(
        self,
        guest_path: str,
        local_path: "str | os.PathLike[str]",
        *,
        exclude: Iterable[str] = (),
        max_size: int | None = None,
        max_files: int | None = None,
    ) -> "CopyResult":
        """Copy a guest file or directory tree to ``local_path`` on the host, streamed; see :meth:`copy_in`.

        What the guest sends is checked as it is unpacked: a member that
        would land outside ``local_path`` or go through a link, a hard link
        or device file, or more than ``max_size`` bytes (default 8 GiB) or
        ``max_files`` members (default 1,000,000) raises :class:`UnsafeArchive`.
        Set-user-ID and set-group-ID bits are dropped.
        """
        from pytest_forkd.core import copy

        destination = copy.local_path(local_path)
        validate.guest_path(guest_path, "guest_path")
        patterns = copy.patterns(exclude)
        limits = {
            "max_size": copy.DEFAULT_MAX_SIZE if max_size is None else validate.max_output(max_size, "max_size"),
            "max_files": copy.DEFAULT_MAX_FILES if max_files is None else validate.max_output(max_files, "max_files"),
        }
        return self._copy(
            "copy_out",
            f"copying {guest_path} out to {destination}",
            copy.copy_out,
            guest_path,
            destination,
            patterns,
            limits=limits,
            local=destination,
            path=guest_path,
        )

    def _copy(
        self,
        kind: str,
        what: str,
        function: Any,
        source: str,
        destination: str,
        patterns: list[str],
        *,
        limits: Mapping[str, int] | None = None,
        **fields: Any,
    ) -> "CopyResult":
        from pytest_forkd.core.copy import describe

        entry = self.transcript.record(kind, **fields, exclude=patterns)
        started = time.perf_counter()
        try:
            result: CopyResult = self._call(
                what, function, self._agent, source, destination, exclude=patterns, **(limits or {})
            )
        except BaseException as exc:
            Transcript.finish(entry, started, error=exc)
            raise
        Transcript.finish(entry, started)
        entry.update(describe(result))
        self._record_timing(kind, result.seconds * 1000, extra={"bytes": result.bytes, "files": result.files})
        return result

    def changes(
        self,
        since: "Checkpoint[VM] | Snapshot | None" = None,
        *,
        include: Iterable[str] = (),
        exclude: Iterable[str] = (),
    ) -> "Changes":
        """What changed in the guest's filesystem since a checkpoint or snapshot (default: ``origin``).

        Returns :class:`~pytest_forkd.analysis.changes.Changes`: ``added``, ``modified``
        (content, mode, owner, symlink target) and ``deleted`` paths, ``diff()``
        and ``read()``. ``include``/``exclude`` are absolute guest paths or glob
        patterns; /proc, /sys, /dev and /run are never included. A point that is
        not in this VM's lineage, or a filter matching no path, is a ChangesError.
        """
        self._ensure_open("computing filesystem changes")
        started = time.perf_counter()
        result = changes_since(self, since, include=include, exclude=exclude)
        self._record_timing(timings.OP_CHANGES, (time.perf_counter() - started) * 1000)
        return result

    def ping(self, timeout: float = 10.0) -> dict[str, Any]:
        """Round trip to the agent; raises if the guest does not answer."""
        validate.timeout(timeout, optional=False)
        return self._call("answering a ping", self._agent.ping, timeout=timeout)

    def console_tail(self, lines: int = 40) -> str:
        return self._machine.console_tail(lines)

    # -- network ----------------------------------------------------------------
    @property
    def network(self) -> NetworkSpec:
        """This VM's network: its mode, the host ports it may reach and the guest ports forwarded now."""
        return self._machine.network.with_forward(self._forwards)

    @property
    def host_address(self) -> str:
        """The address at which the guest reaches the host's loopback services.

        ``host`` mode: 10.0.2.100, where only the allowed ports answer;
        ``outbound`` mode: 10.0.2.2 (slirp's gateway). A VM without network has none.
        """
        address = self._machine.network.host_address
        if address is None:
            raise NetworkError(
                f"VM {self.name} has no network (mode 'none'), so it has no host address; "
                "start it with network='host' (and the host ports it may reach) or 'outbound'"
            )
        return address

    @property
    def forwards(self) -> dict[int, int]:
        """The ports forwarded now: guest port -> host loopback port."""
        return dict(self._forwards)

    def forward(self, guest_port: int, *, check: bool = True, timeout: float = FORWARD_WAIT_S) -> int:
        """Make a server on ``guest_port`` in the guest reachable at 127.0.0.1:<returned port> on the host.

        The host port is picked free on the host's loopback. Forwarding the same
        guest port again returns the same host port. With ``check`` (the
        default) the guest is asked whether something listens on that port on
        an address the forward reaches, for up to ``timeout`` seconds (a server
        just started in the background may need a moment, more so under
        emulation), and NetworkError names the port if nothing does (nothing
        would answer). Forwards live in this VM's QEMU process: a child forked
        from a snapshot of this VM gets forwards of its own, for the same guest
        ports, on other host ports; :meth:`restore` keeps the host ports.
        """
        guest_port = port_number(guest_port, "guest_port")
        validate.timeout(timeout, "timeout", optional=False)
        self._ensure_open(f"forwarding guest port {guest_port}")
        with self._lock:
            existing = self._forwards.get(guest_port)
        if existing is not None:
            return existing
        if not self._machine.network.has_card:
            raise NetworkError(
                f"VM {self.name} has no network (mode 'none'), so guest port {guest_port} cannot be "
                "forwarded; start it with network='host' or 'outbound' (or `network:` in forkd.yaml)"
            )
        if check:
            self._check_listening(guest_port, timeout)
        host_port = self._machine.forward_port(guest_port)
        with self._lock:
            self._forwards[guest_port] = host_port
        return host_port

    def _check_listening(self, guest_port: int, timeout: float) -> None:
        def addresses_now() -> set[str]:
            result = self._call(
                f"checking guest port {guest_port}", self._agent.exec, ["cat", "/proc/net/tcp", "/proc/net/tcp6"]
            )
            return listening_addresses(result.stdout, guest_port)

        try:
            addresses = poll_until(
                addresses_now, timeout=timeout, interval=0.1, what=f"guest port {guest_port} to listen"
            )
        except WaitTimeout:
            addresses = set()
        if not addresses:
            raise NetworkError(
                f"nothing listens on guest port {guest_port} in VM {self.name} (waited {timeout:g} s), so a forward "
                "would not answer; start the server first (listening on 0.0.0.0), or pass check=False to forward "
                "it anyway"
            )
        if addresses <= {"127.0.0.1", "::1"}:
            raise NetworkError(
                f"guest port {guest_port} in VM {self.name} listens only on the guest's loopback "
                f"({', '.join(sorted(addresses))}), which forwarded connections do not reach; "
                "bind the server to 0.0.0.0"
            )

    def _restore_forwards(self) -> None:
        """Forward the guest ports the network spec lists (at start, and in children of a snapshot)."""
        for guest_port in self._machine.network.forward:
            self.forward(guest_port, check=False)

    def _network_record(self) -> dict[str, Any] | None:
        """What a snapshot of this VM records about its network (None without one)."""
        network = self.network
        return network.to_json() if network.has_card else None

    # -- snapshots --------------------------------------------------------------
    def branch(self, tag: str | None = None, *, backend: str | None = None) -> "Snapshot":
        """Snapshot this running VM (short pause, it keeps running) with a storage backend."""
        snapshot = branch(self, tag, backend=backend)
        self.transcript.branched(snapshot)
        return snapshot

    def fork(self, n: int = 1, *, backend: str | None = None, network: NetworkChoice = None) -> list["VM"]:
        """Branch this VM, then start ``n`` copy-on-write children of that snapshot.

        Children have this VM's network, and forwards of their own (new host
        ports) for the guest ports this VM forwards; ``network`` gives them
        another policy (see :meth:`Snapshot.fork`).
        """
        validate.count(n, "n")
        if network is not None:
            check_card(self.name, self._machine.network, network_spec(network))  # before anything is paused
        children: list[VM] = self.branch(backend=backend).fork(n, network=network)
        for child in children:
            child.default_backend = self.default_backend
        return children

    def restore(self, snapshot: "Snapshot") -> None:
        """Roll this VM back to ``snapshot`` in place: same handle, state as at the snapshot."""
        self._ensure_open("restoring a snapshot")
        self._factory.restore_into(self, snapshot)

    def checkpoint(
        self, tag: str | None = None, *, backend: str | None = None, manifest: bool = False
    ) -> "Checkpoint[VM]":
        """Snapshot this VM before something destructive; a context manager that rolls back on exit.

        A checkpoint costs a branch pause of a few milliseconds. With
        ``manifest=True`` the guest first records a manifest of its
        filesystem (about a second for 20,000 files under TCG, timed as
        operation ``manifest``), which makes a later ``checkpoint.changes()``
        cheaper; without it, ``changes()`` records the old manifest in a child
        of the checkpoint when asked, so only tests that ask pay for it.
        """
        tag = validate_tag(tag) if tag else _auto_tag(self)
        if manifest:
            started = time.perf_counter()
            try:
                record_manifest(self, tag)
            except ChangesError:  # no python3 in a custom image: changes() will say so if it is ever asked
                pass
            else:
                self._record_timing(timings.OP_MANIFEST, (time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        snapshot = self.branch(tag, backend=backend)
        self._record_timing("checkpoint", (time.perf_counter() - started) * 1000, backend=snapshot.backend)
        return Checkpoint(self, snapshot)

    def freeze(self, tag: str, *, store: Any = None, keep_running: bool = True) -> "Snapshot":
        """Turn this booted root VM into base snapshot ``tag`` (it continues as a child if asked)."""
        return freeze(self, tag, store=store or self._factory.session_store, keep_running=keep_running)

    # -- lifecycle --------------------------------------------------------------
    def close(self) -> None:
        """Kill the VM and remove everything it created. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._agent.close()
        self._machine.kill()
        self._factory._forget(self)

    def __enter__(self) -> "VM":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals used by the factory and storage backends -------------------
    @property
    def agent(self) -> AgentClient:
        return self._agent

    def _record_timing(self, op: str, ms: float, **fields: Any) -> None:
        """Record one timed operation on this VM (cold = the first since it started)."""
        self._factory.runtime.recorder.record(op, ms, memory_mib=self.memory_mib, cold=self._cold, **fields)
        self._cold = False

    def _recover_after_failed_pause(self) -> None:
        """After a failed snapshot: resume the VM and make sure it answers, or report it dead."""
        try:
            if self._machine.alive() and self._machine.status() != "running":
                self._machine.resume()
        except VMError:
            pass
        self.ping(timeout=30)

    def _take_over(self, other: "VM", origin: "Snapshot", memory_base: "Snapshot | None") -> None:
        """Become ``other`` (a fresh child of ``origin``): used by restore to keep this handle."""
        with self._lock:
            old_machine, old_agent = self._machine, self._agent
            old_forwards = self._forwards
            self._machine, self._agent = other._machine, other._agent
            self._forwards = dict(other._forwards)
            self.origin, self.memory_base = origin, memory_base
            self.transcript.restored(origin)
            self._env, self._cwd = other._env, other._cwd
            followed, self._processes = list(self._processes.values()), {}
            self._cold = True
            self.generation += 1
            other._closed = True
        self._factory._forget(other)
        for process in followed:
            process._detach(
                f"VM {self.name} was restored to snapshot {origin.tag}; "
                f"use vm.process({process.pid}) to follow the process as it was then"
            )
        old_agent.close()
        old_machine.kill()
        self._keep_host_ports(old_forwards)

    def _keep_host_ports(self, previous: Mapping[int, int]) -> None:
        """After a restore, move forwards back to the host ports the test already knows (when still free)."""
        for guest_port, new_port in list(self._forwards.items()):
            old_port = previous.get(guest_port)
            if old_port is None or old_port == new_port:
                continue
            if self._machine.move_forward(new_port, old_port, guest_port):
                self._forwards[guest_port] = old_port

    def _ensure_open(self, what: str) -> None:
        if self._start_error is not None:
            raise self._start_error.with_traceback(None)
        if self.broken is not None:
            raise GuestProtocolError(f"VM {self.name} was cut off and cannot be used for {what}: {self.broken}")
        if self._closed:
            raise VMError(f"VM {self.name} is closed; it cannot be used for {what}")

    def _call(self, what: str, function: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        self._ensure_open(what)
        try:
            return function(*args, **kwargs)
        except ChannelClosed:
            if self._start_error is not None:
                raise self._start_error.with_traceback(None) from None
            error = self._machine.crash_error(f"guest died while {what}")
            self.close()
            raise error from None
        except AgentTimeout as exc:
            error = self._machine.crash_error(f"guest agent stopped answering while {what} ({exc})")
            self.close()
            raise error from None
        except GuestProtocolError as exc:
            if self._agent.closed_reason is not None:  # the channel was cut off: this VM is done
                self.broken = str(exc)
                self.close()
            raise
