"""The fake engine: forkd's real logic without a VMM, for tests that must run in seconds.

A fake machine is two real things and no emulation:

* its **guest** is the real agent (``guest/agent/`` package next to ``wire.py``, as
  in an image) run on the host as a process of its own in ``--stdio`` mode,
  with the agent channel a socketpair: every request goes through the real
  wire protocol and the real client. Agents are forked from a template
  process that imported the agent once (:mod:`~pytest_forkd.engine.fake_agents`),
  a millisecond where a fresh interpreter takes tens. The guest's "filesystem" is a private
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

import ctypes
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
from pytest_forkd.engine.fake_agents import ForkedAgent, descendants, start_agent
from pytest_forkd.engine.memory import PAGE_SIZE, pagemap_scan_problem
from pytest_forkd.engine.network import NetworkError, NetworkSpec
from pytest_forkd.engine.rundir import private_open
from pytest_forkd.errors import GuestCrashed, InvalidArgument
from pytest_forkd.guest import agent_files

#: Header of the guest directory's image in memory: magic, then the tar stream's length.
MEMORY_MAGIC = b"FORKDFAKEMEM\x00\x00\x00\x01"
_HEADER = struct.Struct("<16sQ")
STATE_FORMAT = "forkd-fake-device-state/1"
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
        self._process: ForkedAgent | None = None
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
            self._process = start_agent(self._python, self._guest_end, console, self.root, env)
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
        for pid in [self._process.pid, *descendants(self._process.pid)]:
            try:
                os.kill(pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    def _require_alive(self, what: str) -> None:
        if self._closed:
            raise EngineError(f"fake VM {self.name} is closed; it cannot {what}")


def guest_path(vm: Any, relative: str = "") -> str:
    """An absolute guest path inside a fake VM's guest directory (its agent's working directory)."""
    machine = vm.machine
    if not isinstance(machine, FakeMachine):
        raise InvalidArgument(f"VM {vm.name} does not run on the fake engine")
    return str(machine.root / relative) if relative else str(machine.root)


def _is_an_engine(engine: FakeEngine) -> Engine[FakeSpec, FakeImage]:
    """Never called: mypy checks here that FakeEngine has the engine interface (engine/base.py)."""
    return engine
