"""What E2B's API costs over forkd's own: the official Python SDK against a server on loopback, in one run.

The server (:class:`pytest_forkd.e2b.E2BServer`) runs in this process over a
session of its own on ``base``, with no pool on either side, so every
sandbox and every VM below is a restore of the same template snapshot. Each
pair of figures is sampled alternately (one E2B sample, one forkd sample) so
that a change of the host's load hits both alike:

- ``Sandbox.create()`` plus its first ``commands.run("true")`` against the
  template's ``fork(1)`` plus its first ``vm.exec("true")`` (and plus a first
  ``bash -l -c true``, what envd runs);
- ``commands.run("true")`` against ``vm.exec("true")`` on a warm sandbox and
  VM, the two alone in turn (so both VMs serve as many calls); then, each in
  turn with a ``commands.run`` (``command_beside_same_work_ms``),
  ``vm.exec("true")`` and ``vm.exec(BASH_TRUE)`` as root and as E2B's
  ``user``: envd runs a command as ``bash -l -c`` as ``user``, so the last is
  the same work; ``vm.spawn(BASH_TRUE)`` as ``user`` without stdin, its output
  read to the end (a process with a pid first, its output and end after, as
  envd's ``Start`` has to be and the server runs it) is the same work done
  the same way, and what is left over it is the server's own cost;
- ``sandbox.fork(count=10)`` against ``sandbox.fork(count=1)``: the call's
  wall time (the server answers once the branch is taken and the children
  are committed; each is restored in the background and its calls wait for
  that, see :mod:`pytest_forkd.e2b.forks`) and the time until every child
  has answered a ``commands.run("true")`` (sent to all at once), with
  forkd's ``vm.fork(10)`` and ``vm.fork(1)`` of a running VM (which wait for
  every child's restore and agent) beside them;
- ``pause()`` and ``Sandbox.connect()`` (resume), the bytes the paused
  sandbox keeps in the snapshot store, and whether its QEMU process is gone,
  set beside E2B's and CubeSandbox's published figures.

The ratios the issue sets targets for are in ``e2b_ratios`` with the targets;
``e2b_same_work_ratios`` compares the SDK's calls with forkd doing the same
work (a login bash, a branch and n children), which leaves the server's own
share.
"""

from __future__ import annotations

import dataclasses
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from pytest_forkd.errors import ConfigError
from pytest_forkd.processes import is_alive

from .common import figure

if TYPE_CHECKING:
    from pytest_forkd.core.vm import VM
    from pytest_forkd.e2b.server import E2BServer

#: What envd runs for ``commands.run(cmd)``: a login bash (``e2b/sandbox_sync/commands/command.py``).
BASH_TRUE = ["/bin/bash", "-l", "-c", "true"]
#: How envd runs it: as E2B's user, in its home, with its USER and LOGNAME (the agent sets HOME).
AS_USER: dict[str, Any] = {"user": "user", "cwd": "/home/user", "env": {"USER": "user", "LOGNAME": "user"}}
#: Untimed calls of each kind before a figure is sampled (a new VM translates the code its first calls run).
WARM_UP_ROUNDS = 5
#: Children of the fork part; the issue's target compares them with one.
FORK_COUNT = 10
#: The issue's targets (at most this ratio).
TARGETS = {"create_first_command_over_fork_first_exec": 1.5, "command_over_exec": 1.5, "fork10_over_fork1": 2.0}
#: Figures published by others, set beside ours (E2B's docs; CubeSandbox's README, measured on a PVM host).
E2B_PAUSE_S_PER_GIB = 4.0
PUBLISHED: dict[str, dict[str, Any]] = {
    "e2b": {"pause_s_per_gib": E2B_PAUSE_S_PER_GIB, "resume_s": 1.0},
    "cubesandbox": {"pause_ms": 371, "resume_ms": 19, "clone_ms": 271, "host": "PVM"},
}
#: Seconds the SDK waits for one API call (its default, 60, is short for a loaded TCG host).
REQUEST_TIMEOUT_S = 600


def missing_sdk() -> str | None:
    """Why the part cannot run here (the e2b extra is not installed), or None."""
    try:
        import e2b  # noqa: F401
        import python_multipart  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        return f"the e2b bench part needs the e2b extra ({exc.name} is missing): pip install 'pytest-forkd[e2b]'"
    return None


def _spawn_to_the_end(vm: VM) -> int:
    """``BASH_TRUE`` as envd's ``Start`` runs ``commands.run("true")`` here: a process (its pid first) as ``user``
    without stdin (the SDK's default), its output read to the end, then its exit."""
    process = vm.spawn(BASH_TRUE, stdin=False, **AS_USER)
    process.stdout.read()
    process.stderr.read()
    return process.wait()


def _filesystem_of(path: Path) -> str:
    """The type of the filesystem ``path`` is on (tmpfs means the bytes are host memory after all)."""
    best, kind = "", "unknown"
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) > 2 and str(path).startswith(fields[1]) and len(fields[1]) > len(best):
            best, kind = fields[1], fields[2]
    return kind


async def _paused_state(server: E2BServer, sandbox_id: str, template_tag: str) -> tuple[int, str | None]:
    """Bytes the paused sandbox alone keeps in the store (its snapshot and the bases it needs above the
    template's, which every sandbox of the template shares), and where they are."""
    paused = server.registry.sandboxes[sandbox_id].paused
    if paused is None:
        return 0, None
    store = server.session.store
    total, snapshot = 0, paused
    while snapshot.tag != template_tag:
        total += store.disk_usage(snapshot.tag).allocated_bytes
        if not snapshot.base or not store.exists(snapshot.base):
            break
        snapshot = store.get(snapshot.base)
    return total, str(paused.path)


class _Samples:
    """The samples of one run: the server, its template, the SDK's connection, a list per figure."""

    def __init__(self, server: E2BServer, template: Any, connection: Any, progress: Callable[[str], None]) -> None:
        from e2b import Sandbox

        self.sandbox_class = Sandbox
        self.server = server
        self.template = template
        self.connection = connection
        self.progress = progress
        self.rows: dict[str, list[float]] = {}
        self.pause_facts: dict[str, Any] = {}

    def add(self, row: str, since: float, until: float | None = None) -> None:
        self.rows.setdefault(row, []).append(((time.perf_counter() if until is None else until) - since) * 1000)

    def p50(self, row: str) -> float:
        return figure(self.rows[row])["p50"]

    def creates(self, repeats: int) -> None:
        """Sandbox.create() + first command, against the template's fork(1) + first exec (sh, then bash -l)."""
        self.progress(f"e2b: {repeats} x Sandbox.create() + first commands.run('true'), against fork(1) + exec('true')")
        for _ in range(repeats):
            started = time.perf_counter()
            sandbox = self.sandbox_class.create(**self.connection)
            created = time.perf_counter()
            sandbox.commands.run("true")
            self._two_phases(("create_ms", "first_command_ms", "create_first_command_ms"), started, created)
            sandbox.kill()
            started = time.perf_counter()
            vm = self.template.fork(1)[0]
            forked = time.perf_counter()
            vm.exec("true")
            self._two_phases(("fork_ms", "first_exec_ms", "fork_first_exec_ms"), started, forked)
            vm.close()
            started = time.perf_counter()
            vm = self.template.fork(1)[0]
            vm.exec(BASH_TRUE, **AS_USER)  # what envd runs for commands.run("true")
            self.add("fork_first_bash_exec_ms", started)
            vm.close()

    def commands(self, sandbox: Any, vm: VM, rounds: int) -> None:
        """commands.run("true") on a warm sandbox against vm.exec("true") (2 x rounds); then forkd doing envd's work.

        The target's pair is sampled on its own, one call of each in turn, so that the sandbox's VM and the
        other one are used alike (a VM that serves four calls for the other's one runs them faster: the
        host's caches stay warm for it). forkd doing envd's work (a login bash, as root and as ``user``,
        through ``exec`` and ``spawn``) is sampled after it, each call in turn with a ``commands.run``.
        """
        self.progress(f"e2b: {2 * rounds} x commands.run('true') against vm.exec('true'), then bash -l -c true")
        for _ in range(WARM_UP_ROUNDS):  # both VMs are new: their first calls translate code the later ones reuse
            sandbox.commands.run("true")
            vm.exec("true")
        for _ in range(2 * rounds):
            started = time.perf_counter()
            sandbox.commands.run("true")
            self.add("command_ms", started)
            started = time.perf_counter()
            vm.exec("true")
            self.add("exec_ms", started)
        same_work: list[tuple[str, Callable[[], object]]] = [
            ("exec_beside_same_work_ms", lambda: vm.exec("true")),
            ("bash_login_exec_ms", lambda: vm.exec(BASH_TRUE)),
            ("bash_login_exec_as_user_ms", lambda: vm.exec(BASH_TRUE, **AS_USER)),
            ("bash_login_spawn_as_user_ms", lambda: _spawn_to_the_end(vm)),
        ]
        for _, call in same_work:
            call()
        for _ in range(rounds):
            for row, call in same_work:
                started = time.perf_counter()
                sandbox.commands.run("true")
                self.add("command_beside_same_work_ms", started)
                started = time.perf_counter()
                call()
                self.add(row, started)

    def forks(self, sandbox: Any, vm: VM, repeats: int) -> None:
        """sandbox.fork(count=1) and fork(count=10), against forkd's vm.fork(1) and vm.fork(10).

        For each: the call's wall time, and the time from its start until every child has answered a first
        command, sent to all of them at once (what a user who forks in order to work in the children sees).
        """
        self.progress(f"e2b: {repeats} x sandbox.fork(count=1) and fork(count={FORK_COUNT}), and vm.fork(n)")
        with ThreadPoolExecutor(max_workers=FORK_COUNT, thread_name_prefix="bench-e2b-fork") as pool:
            for _ in range(repeats):
                for count in (1, FORK_COUNT):
                    started = time.perf_counter()
                    children = sandbox.fork(count=count)
                    returned = time.perf_counter()
                    failed = [child for child in children if isinstance(child, Exception)]
                    answered = [] if failed else list(pool.map(lambda child: child.commands.run("true"), children))
                    self.add(f"fork{count}_ms", started, returned)
                    self.add(f"fork{count}_answered_ms", started)
                    for child in children:
                        if not isinstance(child, Exception):
                            child.kill()
                    if failed:
                        raise failed[0]
                    assert len(answered) == count
                    started = time.perf_counter()
                    vms = vm.fork(count)  # a branch of the running VM, then its children: what E2B's fork is
                    returned = time.perf_counter()
                    list(pool.map(lambda child_vm: child_vm.exec(BASH_TRUE, **AS_USER), vms))
                    self.add(f"vm_fork{count}_ms", started, returned)
                    self.add(f"vm_fork{count}_answered_ms", started)
                    for child_vm in vms:
                        child_vm.close()

    def pauses(self, sandbox: Any, repeats: int) -> Any:
        """pause() and Sandbox.connect(); what the paused sandbox keeps, and whether its QEMU is gone."""
        self.progress(f"e2b: {repeats} x pause() and Sandbox.connect() (resume)")
        left, filesystem = [], None
        memory_mib = self.server.vm(sandbox.sandbox_id).memory_mib
        for _ in range(repeats):
            pid = self.server.vm(sandbox.sandbox_id).machine.pid
            started = time.perf_counter()
            sandbox.pause()
            self.add("pause_ms", started)
            left.append(is_alive(pid))
            stored, where = self.server.call(_paused_state(self.server, sandbox.sandbox_id, self.template.snapshot.tag))
            if where is not None:
                self.rows.setdefault("paused_store_mib", []).append(stored / (1 << 20))
                filesystem = _filesystem_of(Path(where))
            started = time.perf_counter()
            sandbox = self.sandbox_class.connect(sandbox.sandbox_id, **self.connection)
            self.add("resume_ms", started)
            started = time.perf_counter()
            sandbox.commands.run("true")
            self.add("resumed_first_command_ms", started)
        self.pause_facts = {
            "guest_mib": memory_mib,
            "qemu_process_left_after_pause": any(left),
            "store_filesystem": filesystem,
            "e2b_published_pause_ms_for_this_memory": round(E2B_PAUSE_S_PER_GIB * memory_mib / 1024 * 1000),
            "published": PUBLISHED,
        }
        return sandbox

    def _two_phases(self, names: tuple[str, str, str], start: float, middle: float) -> None:
        end = time.perf_counter()
        self.add(names[0], start, middle)
        self.add(names[1], middle, end)
        self.add(names[2], start, end)

    def ratios(self) -> tuple[dict[str, float], dict[str, float]]:
        """The issue's ratios, and the same with forkd doing the work the SDK asks for (what is left is the
        server's own cost): a login bash for a command, a branch and n children for a fork."""

        def ratio(over: str, under: str) -> float:
            return round(self.p50(over) / self.p50(under), 2)

        beside = "command_beside_same_work_ms"  # commands.run, sampled in turn with forkd doing the same work

        targets = {
            "create_first_command_over_fork_first_exec": ratio("create_first_command_ms", "fork_first_exec_ms"),
            "command_over_exec": ratio("command_ms", "exec_ms"),
            "fork10_over_fork1": ratio("fork10_ms", "fork1_ms"),
        }
        same_work = {
            "create_first_command_over_fork_first_bash_exec_as_user": ratio(
                "create_first_command_ms", "fork_first_bash_exec_ms"
            ),
            "command_over_bash_login_exec_as_user": ratio(beside, "bash_login_exec_as_user_ms"),
            "command_over_bash_login_spawn_as_user": ratio(beside, "bash_login_spawn_as_user_ms"),
            "bash_login_exec_as_user_over_exec": ratio("bash_login_exec_as_user_ms", "exec_beside_same_work_ms"),
            "bash_login_exec_over_exec": ratio("bash_login_exec_ms", "exec_beside_same_work_ms"),
            "fork10_answered_over_fork1_answered": ratio("fork10_answered_ms", "fork1_answered_ms"),
            "fork10_answered_over_vm_fork10_answered": ratio("fork10_answered_ms", "vm_fork10_answered_ms"),
            "vm_fork10_over_vm_fork1": ratio("vm_fork10_ms", "vm_fork1_ms"),
            "vm_fork10_answered_over_vm_fork1_answered": ratio("vm_fork10_answered_ms", "vm_fork1_answered_ms"),
        }
        return targets, same_work


def measure_e2b(
    repeats: int, progress: Callable[[str], None], *, accel: str = "auto", required: bool = True
) -> dict[str, Any]:
    """``e2b_*`` figures: the SDK through the server against forkd's own calls on the same template.

    Without the e2b extra: ConfigError when the part was asked for by name (``required``), else a note
    in ``e2b_skipped`` (a run of every part on a host without the extra).
    """
    problem = missing_sdk()
    if problem is not None:
        if required:
            raise ConfigError(problem)
        progress(f"skipping the e2b part: {problem}")
        return {"e2b_skipped": problem}
    from e2b.connection_config import ApiParams

    from pytest_forkd.e2b.config import DEFAULT_TEMPLATE
    from pytest_forkd.e2b.server import E2BServer
    from pytest_forkd.project.session import ForkdSession

    repeats = max(repeats, 3)
    load_before = os.getloadavg()
    session = ForkdSession.open(pool=0, progress=progress)
    if accel != "auto":  # --accel, as the other parts' VMs take it (the session boots nothing before)
        session.settings = dataclasses.replace(session.settings, accel=accel)
    try:
        with E2BServer(session, progress=progress) as server:
            server.warm(DEFAULT_TEMPLATE)
            template = server.call(server.registry.catalog.get(DEFAULT_TEMPLATE))
            connection: ApiParams = {
                "api_key": server.api_key,
                "api_url": server.url,
                "sandbox_url": server.url,
                "debug": False,
                "request_timeout": REQUEST_TIMEOUT_S,
            }
            samples = _Samples(server, template, connection, progress)
            samples.creates(repeats)
            sandbox = samples.sandbox_class.create(**connection)
            vm = template.fork(1)[0]
            samples.commands(sandbox, vm, 4 * repeats)
            samples.forks(sandbox, vm, repeats)
            vm.close()
            samples.pauses(sandbox, repeats).kill()
            machine = _machine(session)
    finally:
        session.close()
    targets, same_work = samples.ratios()
    return {
        "e2b": {name: figure(values) for name, values in samples.rows.items()},
        "e2b_ratios": targets,
        "e2b_same_work_ratios": same_work,
        "e2b_targets": {name: {"at_most": TARGETS[name], "met": targets[name] <= TARGETS[name]} for name in TARGETS},
        "e2b_pause": samples.pause_facts,
        "e2b_conditions": {
            "sdk": "e2b (Python, sync) " + _version("e2b"),
            "server": "in-process, loopback, no pool on either side",
            **machine,
            "load_average_before": [round(value, 2) for value in load_before],
            "load_average_after": [round(value, 2) for value in os.getloadavg()],
            "samples": repeats,
        },
    }


def _machine(session: Any) -> dict[str, Any]:
    """The host the figures were measured on: CPUs, QEMU, the accelerator (TCG or KVM) and why."""
    from pytest_forkd.image import ensure_image

    factory = session.factory
    verdict = factory.accel_verdict(ensure_image("default"))
    return {
        "cpus": os.cpu_count(),
        "qemu": factory.engine.describe()["version"],
        "accel": verdict.accel,
        "accel_reason": verdict.reason,
    }


def _version(distribution: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "?"
