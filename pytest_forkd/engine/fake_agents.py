"""The fake engine's agents: forked from a template process that imported the agent once.

A fake machine's guest is the real agent run on the host (see
:mod:`pytest_forkd.engine.fake`). Started as a fresh interpreter, an agent
costs tens of milliseconds of CPU before it serves (the interpreter, then the
agent's imports), and test runs start hundreds; forked from a process that has
done both, it costs one. Each agent is still a process of its own: its own
session, its machine's directory as working directory, the environment and
umask of the process that starts the machine at that moment, the guest
channel on stdin and stdout and the console on stderr.

The template (:data:`TEMPLATE`) is started on first use, one per interpreter,
and lives until this process exits. Death signals chain: the template dies
with this process, each agent with the template, even paused (SIGSTOP).
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import signal
import socket
import subprocess
import threading
from pathlib import Path
from typing import Any

from pytest_forkd.engine.base import EngineError
from pytest_forkd.engine.spawner import SPAWN_TIMEOUT_S, SpawnTimeout, spawn
from pytest_forkd.guest import GUEST_DIR

#: The agent package, run from beside the protocol module it imports, like in the guest.
AGENT_SCRIPT = GUEST_DIR / "agent"

#: The template's program. It imports the agent package, then serves requests on its stdin (a
#: SOCK_SEQPACKET socket): each is a JSON record ``{"id", "cwd", "env", "umask", "args"}`` carrying
#: the guest channel and the console as two descriptors. It forks a child per request and answers
#: ``{"id", "pid"}`` (or ``{"id", "error"}``), then ``{"exited": PID, "status": CODE}`` when that
#: child ends (it is the children's parent, so it reaps them). The child becomes what ``python -c``
#: running the agent package as ``__main__`` would be, and a child subreaper: commands it starts in
#: their own sessions, and what they leave running in the background, stay its descendants, so
#: pausing and killing the machine reach them (a QEMU guest's processes die with QEMU). The agent
#: returns when the host hangs up, which closing a VM does before it kills the machine: the guest's
#: processes are killed then, before the agent exits, as they would be reparented out of the
#: machine's reach.
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
THREAD_CHILDREN = os.path.exists(f'/proc/{template}/task/{template}/children')

def children_of(pid):
    found = []
    try:
        for thread in os.listdir(f'/proc/{pid}/task'):
            with open(f'/proc/{pid}/task/{thread}/children', 'rb') as listing:
                found += [int(child) for child in listing.read().split()]
    except (OSError, ValueError):
        pass
    return found

def below():
    children = children_of
    if not THREAD_CHILDREN:  # the kernel keeps no lists of children: every process's parent, then
        parents = {}
        for entry in os.listdir('/proc'):
            try:
                with open(f'/proc/{int(entry)}/stat', 'rb') as stat:
                    parents.setdefault(int(stat.read().rsplit(b')', 1)[1].split()[1]), []).append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
        children = lambda pid: parents.get(pid, [])
    found, stack = [], [os.getpid()]
    while stack:
        for child in children(stack.pop()):
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
    for fd, target in ((channel, 0), (channel, 1), (console, 2)):
        os.dup2(fd, target)
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


def start_agent(python: str, channel: socket.socket, console: int, cwd: Path, env: dict[str, str]) -> ForkedAgent:
    """Fork an agent serving ``channel`` (its stdin and stdout), ``console`` its stderr, from ``python``'s template."""
    with _templates_lock:
        template = _templates.get(python)
        if template is None or not template.alive:
            template = _templates[python] = AgentTemplate(python)
    return template.start(channel, console, cwd, env)


class AgentTemplate:
    """The template process of one interpreter (:data:`TEMPLATE`), and what it said of its agents."""

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
        self.ended = ""
        self._reader = threading.Thread(target=self._read, name="forkd-fake-template", daemon=True)
        self._reader.start()

    def start(self, channel: socket.socket, console: int, cwd: Path, env: dict[str, str]) -> ForkedAgent:
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
            raise EngineError(f"the fake engine's agent template is gone ({exc}): {self.close()}") from exc
        with self._changed:
            if not self._changed.wait_for(lambda: ident in self._replies or not self.alive, timeout=SPAWN_TIMEOUT_S):
                self._abandoned.add(ident)  # a late answer's agent is killed: nobody owns it
                raise SpawnTimeout(
                    f"the fake engine's agent template did not fork an agent within {SPAWN_TIMEOUT_S:.0f} s"
                )
            reply = self._replies.pop(ident, None)
        if reply is None:
            raise EngineError(f"the fake engine's agent template exited: {self.close()}")
        if "error" in reply:
            raise EngineError(f"the fake engine's agent template could not start an agent: {reply['error']}")
        return ForkedAgent(self, int(reply["pid"]))

    def status(self, pid: int, timeout: float | None = 0) -> int | None:
        """The exit status of agent ``pid`` once it ended (waiting up to ``timeout`` seconds), else None."""
        with self._changed:
            self._changed.wait_for(lambda: pid in self._statuses or not self.alive, timeout=timeout)
            if pid in self._statuses:
                return self._statuses[pid]
            return None if self.alive else -signal.SIGKILL  # its agents die with it

    def close(self) -> str:
        """Hang up and wait until the template ended (the agents it still has die with it); say how it ended."""
        try:
            self._socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._reader.join(timeout=5)
        if self._reader.is_alive():
            self._process.kill()
            self._reader.join()
        return self.ended

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
        assert self._process.stderr is not None
        with self._process.stderr as stderr:  # it writes nothing while it serves
            text = stderr.read().decode(errors="replace").strip()
        last = f": {text.splitlines()[-1]}" if text else ""
        self.ended = f"it exited with status {self._process.returncode}{last}"


class ForkedAgent:
    """A fake machine's agent forked by its template: the part of ``subprocess.Popen`` a machine uses."""

    def __init__(self, template: AgentTemplate, pid: int) -> None:
        self._template = template
        self.pid = pid

    def poll(self) -> int | None:
        return self._template.status(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        status = self._template.status(self.pid, timeout)
        if status is None:
            raise subprocess.TimeoutExpired(f"fake agent {self.pid}", timeout or 0)
        return status


def descendants(root: int) -> list[int]:
    """Every process below ``root``, parents before children.

    Read from each thread's list of children in /proc (a command is the child
    of the agent thread that started it; what it leaves is reparented to the
    agent), not from every process of the host; from every process's parent
    where the kernel keeps no such lists.
    """
    parents = None if _THREAD_CHILDREN else _parents()
    found: list[int] = []
    stack = [root]
    while stack:
        pid = stack.pop()
        below = _children_of(pid) if parents is None else parents.get(pid, [])
        found += below
        stack += below
    return found


def _children_of(pid: int) -> list[int]:
    found: list[int] = []
    try:
        for thread in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{thread}/children", "rb") as listing:
                found += [int(child) for child in listing.read().split()]
    except (OSError, ValueError):  # it ended meanwhile
        pass
    return found


def _parents() -> dict[int, list[int]]:
    """The children of every process, from each one's parent."""
    parents: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        try:
            with open(f"/proc/{int(entry.name)}/stat", "rb") as stat:
                parents.setdefault(int(stat.read().rsplit(b")", 1)[1].split()[1]), []).append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return parents


#: Whether the kernel lists each thread's children (CONFIG_PROC_CHILDREN, as Debian and Ubuntu build it).
_THREAD_CHILDREN = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` would, for every thread, meanwhile)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


_templates: dict[str, AgentTemplate] = {}
_templates_lock = threading.Lock()


def _forget_templates() -> None:
    """In a forked child: the templates (and the threads reading them) are the parent's."""
    global _templates_lock
    _templates.clear()
    _templates_lock = threading.Lock()


def _close_templates() -> None:
    """At exit, so that no process of this one outlives it, even for a moment."""
    for template in list(_templates.values()):
        template.close()


os.register_at_fork(after_in_child=_forget_templates)
atexit.register(_close_templates)
