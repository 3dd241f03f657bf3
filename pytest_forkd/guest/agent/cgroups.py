"""One cgroup v2 per command, so that an out-of-memory kill, a fork bomb or a timeout ends the command only."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

from .common import (
    _FREE_GROUPS,
    AGENT_CGROUP,
    AGENT_CPU_WEIGHT,
    AGENT_MEMORY_RESERVE,
    CGROUP_ROOT,
    COMMAND_PIDS_MAX,
    MIN_COMMAND_MEMORY,
    log_to_stderr,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable


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

    def __init__(self, base: str, log: Callable[[str], None], agent_group: str | None = None) -> None:
        self._base = base
        self._log = log
        # The agent's own group's cgroup.procs: a command forks there until it is moved to its own (see
        # adopt). Opened once: it is read for every command started outside its group.
        self._agent_procs_fd: int | None = None
        if agent_group is not None:
            try:
                self._agent_procs_fd = os.open(os.path.join(agent_group, "cgroup.procs"), os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                log(f"cannot read {agent_group}/cgroup.procs: {exc}; what a command forks before its move stays out")
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
        cgroups = cls(base, log, _enter_own_group(os.path.join(root, AGENT_CGROUP), log))
        # Left by an agent that died: reuse or remove them as they empty.
        cgroups._occupied = [_CommandGroup(entry.path) for entry in os.scandir(base) if entry.is_dir()]
        cgroups.prepare()
        return cgroups

    def take(self) -> _CommandGroup:
        """An empty group for one command: a free one, else a new one.

        A caller that reports OOM kills calls :meth:`_CommandGroup.start` on
        it; a spawned process does not, and is spared reading the counts.
        """
        with self._lock:
            group = self._free.pop() if self._free else None
        if group is None:
            group = self.create()
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

    def adopt(self, group: _CommandGroup, pid: int, oom_score: int | None) -> None:
        """Move a command started outside its group (``pid``, a session leader) into it, with all it forked meanwhile.

        Until the move the command runs in the agent's group, so a process it
        forked before is there too; each is found by its session and moved
        after it. The search repeats until it finds none (a process may fork
        while the one before it is moved); what still escapes after
        :data:`ADOPT_ROUNDS` is killed. ``oom_score``: the score each gets.
        """
        group.move(pid)
        if oom_score is not None:
            set_oom_score(pid, oom_score)
        if self._agent_procs_fd is None:
            return
        for _ in range(ADOPT_ROUNDS):
            strays = _session_members(self._agent_procs_fd, pid)
            if not strays:
                return
            for stray in strays:
                group.move(stray)
                if oom_score is not None:
                    set_oom_score(stray, oom_score)
        for stray in _session_members(self._agent_procs_fd, pid):
            with contextlib.suppress(OSError):
                os.kill(stray, signal.SIGKILL)
        self._log(f"killed processes of command {pid} that forked faster than they could be moved into its cgroup")

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
    __slots__ = ("_oom_kills_before", "_procs_fd", "path", "procs")

    def __init__(self, path: str) -> None:
        self.path = path
        self.procs = os.fsencode(os.path.join(path, "cgroup.procs"))
        self._oom_kills_before = 0
        self._procs_fd = -1  # for moves: opened on the first and kept while the group is reused

    def move(self, pid: int) -> None:
        """Move process ``pid`` into the group; a process that already exited is no error."""
        if self._procs_fd < 0:
            self._procs_fd = os.open(self.procs, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(self._procs_fd, str(pid).encode())
        except ProcessLookupError:
            pass

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
        if self._procs_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._procs_fd)
            self._procs_fd = -1
        try:
            os.rmdir(self.path)
        except FileNotFoundError:
            return True
        except OSError:
            return False  # EBUSY: processes left in it
        return True


#: How many times :meth:`CommandCgroups.adopt` looks for processes a command forked before its move.
ADOPT_ROUNDS = 16


def _enter_own_group(path: str, log: Callable[[str], None]) -> str | None:
    """Move the agent into a group of its own (a leaf beside ``forkd``); its path, or None if it cannot.

    The group's CPU weight puts the agent ahead of the commands whenever it
    has work: on a guest's one CPU a command it has just started then waits
    until the agent has moved it into its cgroup and reported it, instead of
    running its whole start first, and no command, however busy, delays the
    agent's answers (a ping, a cancel, a timeout).
    """
    try:
        os.makedirs(path, exist_ok=True)
        _write_text(os.path.join(path, "cgroup.procs"), "0")
    except OSError as exc:
        log(f"cannot move the agent into {path}: {exc}; what a command forks before its cgroup takes it stays out")
        return None
    try:
        _write_text(os.path.join(path, "cpu.weight"), str(AGENT_CPU_WEIGHT))
    except OSError as exc:
        log(f"cannot give the agent precedence over its commands ({path}/cpu.weight): {exc}")
    return path


def _session_members(procs_fd: int, session: int) -> list[int]:
    """The processes a cgroup.procs file (open as ``procs_fd``) lists whose session is ``session``, the agent excepted.

    Runs for every command started outside its group, where most often the
    agent is alone in the list: a kept descriptor read from its start (the
    kernel lists the group anew), no file objects.
    """
    agent = os.getpid()
    members = []
    for pid in map(int, _read_from_start(procs_fd).split()):
        if pid == agent:
            continue
        try:
            # pid (comm) state ppid pgrp session ...: comm may hold spaces and parentheses.
            fields = _read_all(f"/proc/{pid}/stat").rpartition(b")")[2].split()
        except OSError:
            continue
        if len(fields) > 3 and int(fields[3]) == session:
            members.append(pid)
    return members


def _read_all(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _read_from_start(fd)
    finally:
        os.close(fd)


def _read_from_start(fd: int) -> bytes:
    """Everything in the file ``fd`` from its start (a cgroup or /proc file is generated anew at offset 0)."""
    chunks = []
    offset = 0
    while chunk := os.pread(fd, 65536, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


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
    return _read_all(path).decode()


def _write_text(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def set_oom_score(pid: int, score: int) -> None:
    """Set a process's ``oom_score_adj``; a process that already exited is no error."""
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        _write_text(f"/proc/{pid}/oom_score_adj", str(score))


def protect_from_oom_killer() -> None:
    """Make the out-of-memory killer never choose this process (needs CAP_SYS_RESOURCE)."""
    try:
        _write_text("/proc/self/oom_score_adj", "-1000")
    except OSError as exc:
        log_to_stderr(f"cannot protect the agent from the OOM killer: {exc}")
