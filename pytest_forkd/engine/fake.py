"""The fake engine: forkd's real logic without a VMM, for tests that must run in seconds.

A fake machine is two real things and no emulation:

* its **guest** is the real agent (``guest/agent/`` package next to ``wire.py``, as
  in an image) run on the host as a child process in ``--stdio`` mode, with the
  agent channel a socketpair: every request goes through the real wire
  protocol and the real client. The guest's "filesystem" is a private
  directory, the agent's working directory (and ``HOME``/``TMPDIR``): guest
  commands that use relative paths, ``$HOME`` or ``$TMPDIR`` stay in it.
  Absolute paths elsewhere reach the host, as the agent does in unit tests.
* its **memory** is a RAM file of ``memory_mib`` mapped into *this* process,
  shared for a booted machine and copy-on-write for a restored one, exactly
  as QEMU maps it. Pausing the machine (``stop``) freezes the agent and
  every process below it (the agent is a child subreaper, so background
  commands stay below it) with SIGSTOP and writes the guest directory as a tar stream into that mapping,
  page by page, touching only the pages that changed. So the storage backends
  run for real on it: ``full`` copies the file, ``diff`` finds the changed
  pages of the private mapping with PAGEMAP_SCAN and copies them through
  /proc/PID/mem, and a restored child unpacks its directory from its memory.

What does not carry over a snapshot: processes (a restored child starts a
fresh agent; background commands are gone) and files outside the guest
directory. Closing the machine kills the agent and everything below it. The
fake has no network and no live snapshot (its capabilities say so, and the
``uffd`` backend refuses it). Use it through ``VMFactory(engine="fake")``.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import hashlib
import io
import json
import mmap
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tarfile
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from pytest_forkd import private
from pytest_forkd.engine.base import Capabilities, Engine, EngineError, MemoryLayout, ProbeBoot
from pytest_forkd.engine.memory import PAGE_SIZE, pagemap_scan_problem
from pytest_forkd.engine.network import NetworkError, NetworkSpec
from pytest_forkd.engine.rundir import private_open
from pytest_forkd.engine.spawner import SPAWN_TIMEOUT_S, SpawnTimeout, spawn
from pytest_forkd.errors import GuestCrashed, InvalidArgument
from pytest_forkd.guest import GUEST_DIR, agent_files

#: The agent package, run from beside the protocol module it imports, like in the guest.
AGENT_SCRIPT = GUEST_DIR / "agent"
#: Header of the guest directory's image in memory: magic, then the tar stream's length.
MEMORY_MAGIC = b"FORKDFAKEMEM\x00\x00\x00\x01"
_HEADER = struct.Struct("<16sQ")
STATE_FORMAT = "forkd-fake-device-state/1"
#: The template every fake machine's agent is forked from (see :class:`_Template`). It imports the
#: agent package once, then serves requests on its stdin (a SOCK_SEQPACKET socket): each is a JSON
#: record ``{"id", "cwd", "env", "umask", "args"}`` carrying the guest channel and the console as two
#: descriptors. It forks a child per request and answers ``{"id", "pid"}`` (or ``{"id", "error"}``),
#: then ``{"exited": PID, "status": CODE}`` when that child ends (it is the children's parent, so it
#: reaps them). The child becomes what ``python -c`` running the agent package as ``__main__`` would
#: be: its own session, the machine's directory, environment and umask, the channel on stdin and
#: stdout, the console on stderr, a child subreaper (commands it starts in their own sessions, and
#: what they leave running in the background, stay its descendants, so pausing and killing the
#: machine reach them, as a QEMU guest's processes die with QEMU). The agent returns when the host
#: hangs up, which closing a VM does before it kills the machine: the guest's processes are killed
#: then, before the agent exits, as they would be reparented out of the machine's reach. Death
#: signals chain: the template dies with the process that started it, each agent with the template.
TEMPLATE = """\
import ctypes, json, os, runpy, select, signal, socket, sys, traceback
libc = ctypes.CDLL(None)
libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: killed with the process that spawned it
script = sys.argv[1]
sys.path.insert(0, script.rpartition('/')[0])
import agent  # noqa: the agent's modules, once for every machine

template = os.getpid()
control = socket.socket(fileno=os.dup(0))
null = os.open(os.devnull, os.O_RDWR)
os.dup2(null, 0)
os.close(null)
wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
signal.signal(signal.SIGCHLD, lambda signum, frame: None)


def below():
    children = {}
    for entry in os.listdir('/proc'):
        if not entry.isdigit():
            continue
        try:
            with open(f'/proc/{entry}/stat', 'rb') as stat:
                children.setdefault(int(stat.read().rsplit(b')', 1)[1].split()[1]), []).append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    found, stack = [], [os.getpid()]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def become_agent(fds, request):
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in (wake_r, wake_w):
        os.close(fd)
    control.close()
    os.setsid()
    channel, console = fds
    os.dup2(channel, 0)
    os.dup2(channel, 1)
    os.dup2(console, 2)
    os.close(channel)
    os.close(console)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # killed with the template, which is killed with its owner
    if os.getppid() != template:
        return 1  # the template died before the death signal was set
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    os.chdir(request['cwd'])
    os.umask(request['umask'])
    os.environ.clear()
    os.environ.update(request['env'])
    sys.argv = [script, *request['args']]
    try:
        runpy.run_path(script, run_name='__main__')
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    finally:
        for _ in range(2):  # a process forked during the first pass is below the second
            pids = below()
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            if not pids:
                break


def reap():
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return
        control.send(json.dumps({'exited': pid, 'status': os.waitstatus_to_exitcode(status)}).encode())


poller = select.poll()
poller.register(control, select.POLLIN)
poller.register(wake_r, select.POLLIN)
while True:
    for fd, _ in poller.poll():
        if fd == wake_r:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
            reap()
            continue
        data, fds, flags, _ = socket.recv_fds(control, 1 << 20, 2)
        if not data:
            sys.exit(0)  # the owner hung up, or died: the agents go with this process
        request = {}
        try:
            request = json.loads(data)
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(fds) != 2:
                raise ValueError('a request too large, or without its two descriptors')
            pid = os.fork()
        except Exception as exc:
            for each in fds:
                os.close(each)
            control.send(json.dumps({'id': request.get('id'), 'error': f'{type(exc).__name__}: {exc}'}).encode())
            continue
        if pid == 0:
            code = 1
            try:
                code = become_agent(fds, request)
            except BaseException:
                traceback.print_exc()
            finally:
                for stream in (sys.stdout, sys.stderr):
                    try:
                        stream.flush()
                    except Exception:
                        pass
                os._exit(code)
        for each in fds:
            os.close(each)
        control.send(json.dumps({'id': request['id'], 'pid': pid}).encode())
"""
NO_LIVE_SNAPSHOT = "the fake engine has no live snapshot (use the full or diff backend, or the qemu engine)"
NO_NETWORK = "the fake engine has no network card; use the qemu engine for networked VMs"


def _guest_key() -> str:
    digest = hashlib.sha256()
    for name, path in agent_files().items():
        digest.update(name.encode() + b"\0" + path.read_bytes())
    return "fake-" + digest.hexdigest()[:16]


@dataclass(frozen=True)
class FakeImage:
    """A "guest image" of the fake engine: the host's Python running this package's agent."""

    name: str
    key: str = field(default_factory=_guest_key)
    initrd: None = None
    kernel_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class FakeSpec:
    """What a fake snapshot's children must match: its memory size and vCPU count."""

    memory_mib: int = 256
    vcpus: int = 1
    network_card: bool = False

    def fingerprint(self) -> str:
        return hashlib.sha256(f"fake\0{self.memory_mib}\0{self.vcpus}".encode()).hexdigest()[:16]

    def with_memory(self, memory_mib: int) -> FakeSpec:
        return replace(self, memory_mib=memory_mib)


class FakeEngine:
    """The :class:`~pytest_forkd.engine.base.Engine` of fake machines (see the module docstring)."""

    name = "fake"

    def __init__(self, *, accel: str = "auto", python: str | None = None) -> None:
        self.accel = accel  # nothing to accelerate: accepted so that any factory can make one
        self.python = python or sys.executable

    @staticmethod
    def host_capabilities() -> Capabilities:
        dirty = pagemap_scan_problem()
        reasons = {"live_snapshot": NO_LIVE_SNAPSHOT, "uffd_write_protect": NO_LIVE_SNAPSHOT, "network": NO_NETWORK}
        if dirty:
            reasons["dirty_page_tracking"] = dirty
        return Capabilities(
            live_snapshot=False,
            dirty_page_tracking=dirty is None,
            uffd_write_protect=False,
            incoming_restore=True,
            network=False,
            memory_file_layout="file",
            reasons=reasons,
            engine="fake",
        )

    def capabilities(self) -> Capabilities:
        return self.host_capabilities()

    def unavailable_reason(self) -> str | None:
        return None

    def image(self, name: str, *, progress: Callable[[str], None] | None = None) -> FakeImage:
        return FakeImage(name)

    def image_for(self, name: str, key: str | None) -> FakeImage:
        return FakeImage(name)

    def machine_spec(
        self, image: Any, *, memory_mib: int, vcpus: int, network_card: bool = False, probe: ProbeBoot | None = None
    ) -> FakeSpec:
        if network_card:
            raise NetworkError(NO_NETWORK)
        return FakeSpec(memory_mib=memory_mib, vcpus=vcpus)

    def fingerprint(self, image: Any, spec: FakeSpec) -> dict[str, str]:
        return {"engine": self.name, "machine": spec.fingerprint(), "image": image.key}

    def machine_record(self, spec: FakeSpec) -> dict[str, Any]:
        return {"engine": self.name, "memory_mib": spec.memory_mib, "vcpus": spec.vcpus}

    def boot(
        self,
        spec: FakeSpec,
        image: Any,
        *,
        directory: Path,
        name: str,
        ram_path: Path,
        network: NetworkSpec | None = None,
    ) -> FakeMachine:
        _no_card(network)
        return FakeMachine.launch(spec, directory, name, ram_path=ram_path, owns_ram=True, python=self.python)

    def restore(
        self,
        spec: FakeSpec,
        image: Any,
        *,
        directory: Path,
        name: str,
        memory_file: Path,
        network: NetworkSpec | None = None,
    ) -> FakeMachine:
        _no_card(network)
        return FakeMachine.launch(spec, directory, name, ram_path=memory_file, owns_ram=False, python=self.python)

    def describe(self) -> dict[str, Any]:
        return {"engine": self.name, "version": _guest_key(), "python": self.python}


def _no_card(network: NetworkSpec | None) -> None:
    if network is not None and network.has_card:
        raise NetworkError(NO_NETWORK)


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` would, for every thread, meanwhile)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


class _Template:
    """A process with the agent's modules imported that forks each fake machine's agent (:data:`TEMPLATE`).

    Starting the agent as a fresh interpreter costs tens of milliseconds of
    CPU (the interpreter, then the agent's imports), and test runs start
    hundreds; a fork of this process costs one. Each agent is still a process
    of its own, in a session of its own, in its machine's directory, with the
    environment and umask this process has when the machine starts. One
    template per interpreter, started on first use; it lives as long as this
    process (it dies with it, as its agents die with it) or until it is lost.
    """

    def __init__(self, python: str) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._process = spawn(
                [python, "-E", "-s", "-S", "-c", TEMPLATE, str(AGENT_SCRIPT)],
                stdin=theirs,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
                die_with_parent=False,  # the template sets its death signal itself: see TEMPLATE
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._socket = ours
        self._changed = threading.Condition()
        self._next_id = 0
        self._replies: dict[int, dict[str, Any]] = {}
        self._abandoned: set[int] = set()
        self._statuses: dict[int, int] = {}
        self.alive = True
        threading.Thread(target=self._read, name="forkd-fake-template", daemon=True).start()

    def start(self, channel: socket.socket, console: int, cwd: Path, env: dict[str, str]) -> _Agent:
        """Fork an agent serving ``channel`` (its stdin and stdout) with ``console`` as its stderr."""
        with self._changed:
            self._next_id += 1
            ident = self._next_id
        request = {"id": ident, "cwd": str(cwd), "env": env, "umask": _umask(), "args": ["--stdio"]}
        try:
            socket.send_fds(self._socket, [json.dumps(request).encode()], [channel.fileno(), console])
        except OSError as exc:
            if exc.errno == errno.EMSGSIZE:
                raise EngineError(
                    f"a fake machine's environment ({len(json.dumps(env))} bytes as JSON) is too large to "
                    "hand to its agent; start it with fewer or shorter environment variables"
                ) from exc
            raise EngineError(f"the fake engine's agent template is gone ({exc}): {self._stderr()}") from exc
        deadline = SPAWN_TIMEOUT_S
        with self._changed:
            if not self._changed.wait_for(lambda: ident in self._replies or not self.alive, timeout=deadline):
                self._abandoned.add(ident)  # a late answer's agent is killed: nobody owns it
                raise SpawnTimeout(f"the fake engine's agent template did not fork an agent within {deadline:.0f} s")
            reply = self._replies.pop(ident, None)
        if reply is None:
            raise EngineError(f"the fake engine's agent template exited: {self._stderr()}")
        if "error" in reply:
            raise EngineError(f"the fake engine's agent template could not start an agent: {reply['error']}")
        return _Agent(self, int(reply["pid"]))

    def status(self, pid: int, timeout: float | None = 0) -> int | None:
        """The exit status of agent ``pid`` once it ended (waiting up to ``timeout`` seconds), else None."""
        with self._changed:
            self._changed.wait_for(lambda: pid in self._statuses or not self.alive, timeout=timeout)
            if pid in self._statuses:
                return self._statuses[pid]
            return None if self.alive else -signal.SIGKILL  # its agents die with it

    def close(self) -> None:
        """Hang up: the template exits (the agents it still has die with it); wait for it."""
        try:
            self._socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def _read(self) -> None:
        while True:
            try:
                data = self._socket.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                break
            message = json.loads(data)
            with self._changed:
                if "exited" in message:
                    self._statuses[message["exited"]] = message["status"]
                elif message.get("id") in self._abandoned:
                    self._abandoned.discard(message["id"])
                    if "pid" in message:
                        os.kill(message["pid"], signal.SIGKILL)
                else:
                    if "pid" in message:  # a pid of an agent that ended before is this one's now
                        self._statuses.pop(message["pid"], None)
                    self._replies[message.get("id")] = message
                self._changed.notify_all()
        with self._changed:
            self.alive = False
            self._changed.notify_all()
        self._socket.close()
        self._process.wait()

    def _stderr(self) -> str:
        """What the template wrote before it ended (it writes nothing while it serves)."""
        self.alive = False
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            return "it stopped answering and was killed"
        assert self._process.stderr is not None
        text = self._process.stderr.read().decode(errors="replace").strip()
        return f"status {self._process.returncode}" + (f": {text.splitlines()[-1]}" if text else "")


class _Agent:
    """A fake machine's agent forked by the template: the part of ``subprocess.Popen`` a machine uses."""

    def __init__(self, template: _Template, pid: int) -> None:
        self._template = template
        self.pid = pid

    def poll(self) -> int | None:
        return self._template.status(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        status = self._template.status(self.pid, timeout)
        if status is None:
            raise subprocess.TimeoutExpired(f"fake agent {self.pid}", timeout or 0)
        return status


_templates: dict[str, _Template] = {}
_templates_lock = threading.Lock()


def _template(python: str) -> _Template:
    with _templates_lock:
        template = _templates.get(python)
        if template is None or not template.alive:
            template = _templates[python] = _Template(python)
        return template


def _forget_templates() -> None:
    """In a forked child: the templates and the thread reading them belong to the parent."""
    global _templates_lock
    _templates.clear()
    _templates_lock = threading.Lock()


def _close_templates() -> None:
    """At exit, so that no process of this one outlives it, even for a moment."""
    for template in list(_templates.values()):
        template.close()


os.register_at_fork(after_in_child=_forget_templates)
atexit.register(_close_templates)


class FakeMachine:
    """One fake machine: the agent as a host process, guest RAM as a file mapped into this process."""

    def __init__(
        self, spec: FakeSpec, directory: Path, name: str, *, ram_path: Path, owns_ram: bool, python: str
    ) -> None:
        self.name = name
        self.spec = spec
        self.directory = directory
        self.ram_path = ram_path
        self.owns_ram = owns_ram
        self.network = NetworkSpec()
        self.root = directory / f"{name}.root"
        self.console_path = directory / f"{name}.console"
        self._python = python
        self._lock = threading.RLock()
        self._process: _Agent | None = None
        self._paused = True
        self._closed = False
        self._fd = -1
        self._map: mmap.mmap | None = None
        self._start = 0
        self.agent_sock, self._guest_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

    # -- launching --------------------------------------------------------------------
    @classmethod
    def launch(
        cls, spec: FakeSpec, directory: Path, name: str, *, ram_path: Path, owns_ram: bool, python: str
    ) -> FakeMachine:
        """Map the RAM file; a booted machine (``owns_ram``) starts its agent at once, a restored one on resume."""
        machine = cls(spec, directory, name, ram_path=ram_path, owns_ram=owns_ram, python=python)
        try:
            machine._map_memory()
            private.make_dir(machine.root)
            if owns_ram:
                machine._start_agent()
        except BaseException:
            machine.kill()
            raise
        return machine

    def _map_memory(self) -> None:
        length = self.spec.memory_mib << 20
        if self.owns_ram:  # a fresh RAM file, mapped shared: its writes reach the file (it may become a snapshot)
            self._fd = os.open(self.ram_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            os.ftruncate(self._fd, length)
            self._map = mmap.mmap(self._fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        else:  # a snapshot's memory, mapped copy-on-write: never written, siblings share it
            self._fd = os.open(self.ram_path, os.O_RDONLY | os.O_CLOEXEC)
            size = os.fstat(self._fd).st_size
            if size != length:
                raise EngineError(
                    f"memory file {self.ram_path} holds {size} bytes, not the {length} of a "
                    f"{self.spec.memory_mib} MiB machine; take the snapshot again"
                )
            self._map = mmap.mmap(self._fd, length, access=mmap.ACCESS_COPY)
        view = (ctypes.c_char * length).from_buffer(self._map)
        self._start = ctypes.addressof(view)
        del view  # an exported buffer would keep the mapping from closing

    def _start_agent(self) -> None:
        (self.root / "tmp").mkdir(mode=0o700, exist_ok=True)
        env = {**os.environ, "HOME": str(self.root), "TMPDIR": str(self.root / "tmp"), "PYTHONDONTWRITEBYTECODE": "1"}
        console = private_open(self.console_path)
        try:
            self._process = _template(self._python).start(self._guest_end, console, self.root, env)
        finally:
            os.close(console)
            self._guest_end.close()
        self._paused = False

    # -- the Machine protocol ---------------------------------------------------------
    @property
    def pid(self) -> int:
        """This process: guest RAM is mapped here (the agent is :attr:`agent_pid`)."""
        return os.getpid()

    @property
    def agent_pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def alive(self) -> bool:
        if self._closed:
            return False
        return self._process is None or self._process.poll() is None

    def status(self) -> str:
        if not self.alive():
            return "shutdown"
        return "paused" if self._paused else "running"

    def stop(self) -> None:
        """Freeze the agent (SIGSTOP) and write the guest directory into memory."""
        with self._lock:
            self._require_alive("pause")
            if self._process is not None:
                self._signal(signal.SIGSTOP)
            self._paused = True
            self._write_memory()

    def resume(self) -> None:
        with self._lock:
            self._require_alive("resume")
            if self._process is None:
                self._start_agent()  # a restored machine: its guest starts now
            else:
                self._signal(signal.SIGCONT)
            self._paused = False

    def save_device_state(self, path: Path) -> None:
        if not self._paused:
            raise EngineError(f"fake VM {self.name} must be stopped before its device state is saved")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump({"format": STATE_FORMAT, "machine": self.name, "memory_mib": self.spec.memory_mib}, out)

    def load_device_state(self, path: Path, *, timeout: float = 30.0) -> None:
        """Check the state file and unpack the guest directory from memory; the machine stays paused."""
        try:
            state = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise EngineError(f"cannot read device state {path}: {exc}") from exc
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise EngineError(
                f"{path} is not a device state written by the fake engine; restore it with the "
                "engine that took the snapshot"
            )
        with self._lock:
            self._require_alive("load a device state")
            self._read_memory()

    def memory_layout(self) -> MemoryLayout:
        self._require_alive("report its memory")
        return MemoryLayout(
            path=self.ram_path, pid=self.pid, start=self._start, length=self.spec.memory_mib << 20, shared=self.owns_ram
        )

    def start_live_snapshot(self, stream: Path, armed: Callable[[], bool]) -> None:
        raise EngineError(NO_LIVE_SNAPSHOT)

    def finish_live_snapshot(self, timeout: float) -> None:
        raise EngineError(NO_LIVE_SNAPSHOT)

    def materialise(self, stream: Path, image: Any, memory_file: Path, state_file: Path) -> None:
        raise EngineError(NO_LIVE_SNAPSHOT)

    def forward_port(self, guest_port: int) -> int:
        raise NetworkError(NO_NETWORK)

    def move_forward(self, from_port: int, to_port: int, guest_port: int) -> bool:
        raise NetworkError(NO_NETWORK)

    def translation_stats(self) -> dict[str, int]:
        """The fake machine translates nothing."""
        return {}

    def console_tail(self, lines: int = 40) -> str:
        try:
            text = self.console_path.read_bytes()[-16384:].decode("utf-8", "replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stderr_tail(self, lines: int = 10) -> str:
        return self.console_tail(lines)

    def crash_error(self, what: str) -> GuestCrashed:
        how = "the agent stopped answering"
        if self._process is not None:
            try:
                how = f"the agent exited with status {self._process.wait(timeout=2)}"
            except subprocess.TimeoutExpired:
                pass
        return GuestCrashed(f"VM {self.name}: {what}: {how}", self.console_tail())

    def kill(self, *, remove_files: bool = True) -> None:
        """Kill the agent (and its process group), unmap memory, remove the guest directory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._process is not None:
                self._signal(signal.SIGKILL)
                try:
                    self._process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            for end in (self.agent_sock, self._guest_end):
                try:
                    end.close()
                except OSError:
                    pass
            if self._map is not None:
                self._map.close()
                self._map = None
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
        if remove_files:
            shutil.rmtree(self.root, ignore_errors=True)
            self.console_path.unlink(missing_ok=True)
            if self.owns_ram:
                self.ram_path.unlink(missing_ok=True)

    # -- guest directory <-> memory -----------------------------------------------------
    def _write_memory(self) -> None:
        """The guest directory as a tar stream at the start of memory; only changed pages are written."""
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
            archive.add(str(self.root), arcname=".")
        payload = buffer.getvalue()
        data = _HEADER.pack(MEMORY_MAGIC, len(payload)) + payload
        assert self._map is not None
        if len(data) > len(self._map):
            raise EngineError(
                f"the guest directory of fake VM {self.name} ({len(data)} bytes as tar) does not fit "
                f"its {self.spec.memory_mib} MiB of memory; give the VM more memory"
            )
        for offset in range(0, len(data), PAGE_SIZE):
            chunk = data[offset : offset + PAGE_SIZE]
            if self._map[offset : offset + len(chunk)] != chunk:
                self._map[offset : offset + len(chunk)] = chunk

    def _read_memory(self) -> None:
        assert self._map is not None
        magic, length = _HEADER.unpack(self._map[: _HEADER.size])
        if magic != MEMORY_MAGIC:
            raise EngineError(
                f"memory file {self.ram_path} holds no fake guest (it was not written by the fake "
                "engine, or is damaged)"
            )
        payload = self._map[_HEADER.size : _HEADER.size + length]
        shutil.rmtree(self.root, ignore_errors=True)
        private.make_dir(self.root)
        with tarfile.open(fileobj=io.BytesIO(payload), mode="r") as archive:
            if hasattr(tarfile, "tar_filter"):
                archive.extractall(self.root, filter="tar")
            else:  # pragma: no cover - Pythons before the extraction filters; the tar is our own
                archive.extractall(self.root)

    # -- helpers --------------------------------------------------------------------
    def _signal(self, signum: int) -> None:
        """Send ``signum`` to the agent and every process below it (commands run in sessions of their own)."""
        assert self._process is not None
        for pid in [self._process.pid, *_descendants(self._process.pid)]:
            try:
                os.kill(pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    def _require_alive(self, what: str) -> None:
        if self._closed:
            raise EngineError(f"fake VM {self.name} is closed; it cannot {what}")


def _descendants(root: int) -> list[int]:
    """Every process below ``root``, from /proc (parents before children)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: list[int] = []
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def guest_path(vm: Any, relative: str = "") -> str:
    """An absolute guest path inside a fake VM's guest directory (its agent's working directory)."""
    machine = vm.machine
    if not isinstance(machine, FakeMachine):
        raise InvalidArgument(f"VM {vm.name} does not run on the fake engine")
    return str(machine.root / relative) if relative else str(machine.root)


def _is_an_engine(engine: FakeEngine) -> Engine[FakeSpec, FakeImage]:
    """Never called: mypy checks here that FakeEngine has the engine interface (engine/base.py)."""
    return engine
