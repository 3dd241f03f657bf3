"""The parent VM of ``pytest --forkd-isolate``: the project in it, its pytest collected and waiting, children per test.

One per pytest process (so one per xdist worker). It starts on the first
isolated test: a child of the session's snapshot (``--forkd-snapshot``,
forkd.yaml) gets the project copied in (see :mod:`~pytest_forkd.isolate.plan`)
and the in-guest runner (:mod:`pytest_forkd.guest.isolate_runner`), which
imports pytest and the suite and collects it. Then the parent is branched
(the *bare* state, for tests that ask for a fresh set-up), and, for each scope
in turn (a test class, else a test file), told to set up its collectors
(module and class set-up: ``setup_module``, ``setup_class``,
``setUpClass``) and the session- to class-scoped fixtures of its tests,
and branched again: every test of that scope runs in a copy-on-write child
of that branch, where the runner, already warm, runs that one test and
streams its reports back. After the scope's last test the parent tears it
down (its teardown report joins that test's), and after the run's last
test, the session. The pool (``--forkd-pool``, 1 by default) restores the
next child while a test runs, on a core the test leaves idle.

A child that dies (a kernel panic, a test that killed the agent) is reported
as :class:`~pytest_forkd.errors.GuestCrashed` with its console tail; one that
runs past its timeout is killed. Either way the parent and the other tests
are untouched.
"""

from __future__ import annotations

import collections
import functools
import json
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from pytest_forkd.errors import ForkdError, GuestCrashed, ProcessTimeout, VMError
from pytest_forkd.guest import GUEST_DIR
from pytest_forkd.isolate.plan import RUNNER_DIR, RUNNER_FILES, SPEC_PATH, GuestPlan

if TYPE_CHECKING:
    from pytest_forkd.core.process import GuestProcess
    from pytest_forkd.core.vm import VM
    from pytest_forkd.project.session import ForkdSession
    from pytest_forkd.storage.snapshot import Snapshot

#: The in-guest runner's sources, copied into the parent VM at start.
RUNNER_SOURCES: Final = tuple(GUEST_DIR / name for name in RUNNER_FILES)
#: Bytes of the runner's output kept unread in the guest (its replies carry whole reports).
RUNNER_MAX_OUTPUT: Final = 64 << 20
#: Shortest wait for the parent's pytest to collect the suite (importing pytest alone takes seconds under TCG).
COLLECT_TIMEOUT_S: Final = 900.0
#: How long a command to the parent (set-up, teardown) may take at least.
PARENT_COMMAND_TIMEOUT_S: Final = 900.0
#: Said when the guest has no pytest (the default image has none).
NO_PYTEST_HINT: Final = (
    "the guest has no pytest: put the suite's test dependencies into its image in forkd.yaml, e.g.\n"
    "  images: {tests: {packages: [python3-pytest]}}\n  snapshots: {base: {from: 'image:tests'}}\n"
)
#: Characters of the runner's own output kept for error messages.
OUTPUT_TAIL_CHARS: Final = 8000
#: Seconds a pooled child's warm-up may take (a restore under a loaded host's TCG included).
WARM_TIMEOUT_S: Final = 120.0
#: Seconds the output a test wrote may trail its last reply (the runner marks its end on stderr).
OUTPUT_MARKER_WAIT_S: Final = 5.0
#: Seconds the parent's pytest gets to tear down after an interrupted run (Ctrl-C) before its VM is killed: well
#: inside the 8 s after which forkd's signal watchdog ends a process that has not stopped (engine/cancel.py).
INTERRUPTED_TEARDOWN_S: Final = 3.0


class RunnerFailed(ForkdError):
    """The guest's pytest could not start, collect or answer (the message has its output)."""

    def __init__(self, message: str, status: int | str | None = None) -> None:
        super().__init__(message)
        self.status = status
        """Its exit status when it exited (``-9``: killed), else None."""


class TestTimedOut(ForkdError):
    """A test ran past its timeout; its VM was killed."""

    __test__ = False


class GuestRefused(ForkdError):
    """The guest cannot run the suite as the host would (an option or plugin missing, the project's code found
    elsewhere, pytest's internals moved): the run stops with this one line."""

    def __init__(self, message: str, kind: str, names: list[str]) -> None:
        super().__init__(message)
        self.kind = kind
        self.names = names
        """The options (``options``), plugins (``plugins``) or lines (``imports``) it is about."""


@dataclass
class ChildRun:
    """What one test's child VM sent back: the reports it finished, and how it ended."""

    reports: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[dict[str, Any]] = field(default_factory=list)
    error: ForkdError | None = None
    """Why the child did not finish: GuestCrashed, TestTimedOut, RunnerFailed; None if it did."""
    output: str = ""
    """What the test wrote outside pytest's capture (``-s``), relayed to the host's terminal."""
    recorded: dict[str, list[list[str]]] = field(default_factory=dict)
    """What the test wrote for junitxml (``xml_attributes``, ``testsuite_properties``)."""


class _Tail:
    """The last characters of a stream, read on a background thread (so the guest never holds them)."""

    def __init__(self, process: GuestProcess, name: str, *, relay: bool = False) -> None:
        self._chunks: collections.deque[str] = collections.deque()
        self._size = 0
        self._lock = threading.Lock()
        self._relay = relay
        self._pending: list[str] = []
        """With ``relay``: what arrived since :meth:`take_pending` (the host prints it, ``-s``)."""
        self._thread = threading.Thread(target=self._read, args=(process,), name=name, daemon=True)
        self._thread.start()

    def _read(self, process: GuestProcess) -> None:
        try:
            for line in process.stderr:
                self.add(line.decode(errors="replace"))
        except ForkdError:  # the VM went away: nothing more to read
            pass

    def add(self, text: str) -> None:
        with self._lock:
            if self._relay:
                self._pending.append(text)
            self._chunks.append(text)
            self._size += len(text)
            while self._size > OUTPUT_TAIL_CHARS and len(self._chunks) > 1:
                self._size -= len(self._chunks.popleft())

    def wait(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until the stream ended."""
        self._thread.join(timeout)

    def text(self) -> str:
        with self._lock:
            return "".join(self._chunks)[-OUTPUT_TAIL_CHARS:]

    def take_pending(self) -> str:
        with self._lock:
            pending, self._pending = self._pending, []
        return "".join(pending)


def read_reply(process: GuestProcess, deadline: float, what: str) -> dict[str, Any]:
    """The runner's next message (a JSON line, which may come in pieces); TestTimedOut past ``deadline``.

    GuestCrashed when the guest died meanwhile, RunnerFailed when the runner's
    output ended (it exited).
    """
    line = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TestTimedOut(f"{what} did not finish in time")
        try:
            piece = process.stdout.readline(timeout=left)
        except ProcessTimeout:
            raise TestTimedOut(f"{what} did not finish in time") from None
        if not piece:
            try:  # a guest that died says so here (GuestCrashed), even if its output ended first
                status: int | str = process.wait(timeout=10)
            except ProcessTimeout:
                status = "unknown: it still runs"
            raise RunnerFailed(f"the guest's pytest exited (status {status}) while {what}", status)
        line += piece
        if line.endswith(b"\n"):
            message = json.loads(line)
            if not isinstance(message, dict):
                raise RunnerFailed(f"the guest's pytest sent {line[:200]!r} while {what}")
            return message


class IsolationParent:
    """The warm parent VM of an isolated run and the branches its tests' children fork from."""

    def __init__(
        self,
        session: ForkdSession,
        plan: GuestPlan,
        *,
        progress: Callable[[str], None],
        python: str = "python3",
        relay_output: bool = False,
    ) -> None:
        self._session = session
        self._plan = plan
        self._progress = progress
        self._python = python
        self._relay_output = relay_output
        self._vm: VM | None = None
        self._process: GuestProcess | None = None
        self._stderr: _Tail | None = None
        self.collected: set[str] = set()
        self.collection_errors: dict[str, str] = {}
        self.guest_versions: dict[str, str] = {}
        self.guest_plugins: set[str] = set()
        """The plugins the guest's pytest registered, by name (``timeout`` for pytest-timeout)."""
        self.recorded: dict[str, list[list[str]]] = {}
        """What the parent's own set-up wrote for junitxml (the next test's report carries it)."""
        self._bare: Snapshot | None = None
        self._prepared: Snapshot | None = None
        self.prepared_scope: str | None = None
        """The node id of the scope (a module, or a class in it) the parent has set up: children fork from its
        branch."""
        self.set_up = False
        """Whether the parent holds set-up (session fixtures at least) that a teardown must still undo."""
        self.start_seconds = 0.0
        self._remaining: list[int | None] = [0]
        """How many more children of the current branch the tests to come will take (the pool's demand; None:
        not known, as under an xdist schedule that hands tests out one by one)."""

    # -- starting --------------------------------------------------------------------------------
    def start(self) -> None:
        """Boot the parent, copy the project in, start the runner and wait until the suite is collected.

        :class:`GuestRefused` when the guest cannot run the suite as the host
        would (the runner's one line says why).
        """
        started = time.perf_counter()
        session = self._session
        with session.timings.running_test(None):
            snapshot = session.selected
            self._vm = vm = session.factory.fork_snapshot(snapshot, 1)[0]
            for copy in self._plan.copies:
                self._progress(f"forkd: copying {copy.path} into the isolation parent VM")
                vm.copy_in(copy.path, str(copy.path), exclude=copy.exclude)
            vm.exec(["mkdir", "-p", RUNNER_DIR], check=True)
            for source in RUNNER_SOURCES:
                vm.write_file(f"{RUNNER_DIR}/{source.name}", source.read_bytes())
            vm.write_file(SPEC_PATH, self._plan.spec_json())
            self._progress("forkd: collecting the suite with pytest in the isolation parent VM")
            self._process = vm.spawn(
                self._plan.command(self._python),
                cwd=self._plan.cwd,
                env=dict(self._plan.env),
                max_output=RUNNER_MAX_OUTPUT,
            )
            self._stderr = _Tail(self._process, "forkd-isolate-stderr", relay=self._relay_output)
            ready = self._command(None, "collecting the suite", COLLECT_TIMEOUT_S)
            if ready.get("op") != "ready":
                raise RunnerFailed(f"the guest's pytest answered {ready.get('op')!r} instead of collecting")
            self.collected = set(ready.get("collected", ()))
            self.collection_errors = dict(ready.get("errors", {}))
            self.guest_versions = {key: str(ready.get(key)) for key in ("python", "pytest")}
            self.guest_plugins = {str(name) for name in ready.get("plugins", ())}
            self._bare = vm.branch()
        self.start_seconds = time.perf_counter() - started

    def _command(self, command: dict[str, Any] | None, what: str, timeout: float) -> dict[str, Any]:
        """Send ``command`` to the parent's runner (None: only read) and return its answer."""
        assert self._process is not None
        try:
            if command is not None:
                self._process.write_stdin(json.dumps(command) + "\n")
            reply = read_reply(self._process, time.monotonic() + timeout, what)
        except (RunnerFailed, TestTimedOut) as exc:
            raise RunnerFailed(f"{exc}\n{self.output_tail()}") from None
        if reply.get("op") == "error":
            kind = reply.get("kind")
            if kind in REFUSALS:
                names = [str(name) for name in reply.get(REFUSALS[kind], ())]
                raise GuestRefused(str(reply.get("message", "")), str(kind), names)
            if self._stderr is not None:
                self._stderr.wait(5.0)  # it exits after an error: let its last words arrive
            message = str(reply.get("message", ""))
            raise RunnerFailed(f"the guest's pytest failed while {what}:\n{message}\n{self.output_tail(message)}")
        return reply

    def output_tail(self, also_seen: str = "") -> str:
        """The last lines the parent's pytest wrote outside its replies (its own errors, collection warnings)."""
        if self._stderr is not None:
            self._stderr.wait(2.0 if self._process is not None and self._process.poll() is not None else 0.0)
        tail = self._stderr.text() if self._stderr is not None else ""
        hint = NO_PYTEST_HINT if "No module named 'pytest'" in tail + also_seen else ""
        if not tail.strip():
            return hint
        return f"{hint}--- last output of the guest's pytest ---\n{tail}"

    def parent_output(self) -> str:
        """What the parent's pytest printed since the last call, when it is relayed (``-s``): session and
        module fixtures' output."""
        return self._stderr.take_pending() if self._stderr is not None else ""

    # -- the state children fork from ------------------------------------------------------------
    def snapshot_for(
        self, nodeid: str, scope: str, group: list[str], *, fresh: bool, timeout: float, demand: int | None
    ) -> Snapshot:
        """The snapshot the test's child forks from: the bare one, or the branch with its scope set up.

        ``group``: the tests of the same scope to come whose fixtures the
        parent sets up too; ``demand``: how many children of the branch the
        tests to come will take (None: not known).
        """
        if fresh:
            assert self._bare is not None
            return self._bare
        if self._prepared is not None and self.prepared_scope == scope:
            return self._prepared
        assert self._vm is not None
        with self._session.timings.running_test(None):
            reply = self._command(
                {"op": "prepare", "nodeid": nodeid, "group": group, "scope": scope},
                f"setting up {scope} in the parent VM",
                max(timeout, PARENT_COMMAND_TIMEOUT_S),
            )
            self._keep_recorded(reply)
            self.set_up = True
            previous, self._prepared = self._prepared, self._vm.branch()
            self.prepared_scope = scope
            if previous is not None:
                self._forget(previous)
            if self._session.settings.pool > 0 and self._process is not None:
                self._keep_children_ready(self._prepared, demand, self._process.pid)
        return self._prepared

    def _keep_children_ready(self, snapshot: Snapshot, demand: int | None, pid: int) -> None:
        """Restore the branch's children ahead of its tests, each warmed on the pool's core.

        The pool holds at least ``--forkd-pool`` children and grows, as the
        session's own does, when tests take children faster than one core
        restores them (bounded by memory and by the tests still to come).
        """
        from pytest_forkd.core.pool import DEFAULT_CHILD_MIB, available_memory_mib, memory_bound, vm_memory_bound

        size = self._session.settings.pool
        remaining = self._remaining = [demand]
        self._session.factory.pool(
            snapshot,
            size,
            maximum=max(size, memory_bound(DEFAULT_CHILD_MIB, available_memory_mib())),
            demand=lambda: remaining[0],
            resize=vm_memory_bound,
            warm=functools.partial(warm_child, pid=pid),
        )

    def _keep_recorded(self, reply: dict[str, Any]) -> None:
        for key in ("xml_attributes", "testsuite_properties"):
            self.recorded.setdefault(key, []).extend(reply.get(key, ()))

    def take_recorded(self) -> dict[str, list[list[str]]]:
        recorded, self.recorded = self.recorded, {}
        return recorded

    def _forget(self, snapshot: Snapshot) -> None:
        """Drop a branch no child will fork from again (its pool, and its files in the run's store).

        Its files stay while the parent maps them: a backend may have made the
        branch the parent's new memory base (the diff backend flattens a diff
        grown large into one).
        """
        from pytest_forkd.storage.store import SnapshotStore

        self._session.factory.drop_pool(snapshot)
        base = self._vm.memory_base if self._vm is not None else None
        if base is not None and base.path == snapshot.path:
            return
        try:
            SnapshotStore(snapshot.path.parent).remove(snapshot.tag, cascade=True)
        except (ForkdError, OSError):  # removed with the run directory at the end anyway
            pass

    def teardown(
        self, nodeid: str, next_nodeid: str | None, *, timeout: float, next_scope: str | None = None
    ) -> dict[str, Any]:
        """Tear down in the parent what the next test does not share (everything after the last test).

        Returns the runner's answer: the serialized teardown report, its
        warnings and what it wrote for junitxml.
        """
        with self._session.timings.running_test(None):
            reply = self._command(
                {"op": "teardown", "nodeid": nodeid, "next": next_nodeid, "next_scope": next_scope},
                "tearing down in the parent VM",
                max(timeout, PARENT_COMMAND_TIMEOUT_S),
            )
        if self._prepared is not None:
            self._forget(self._prepared)
        self._prepared = None
        self.prepared_scope = None
        self.set_up = next_nodeid is not None
        return reply

    # -- a test in its child ---------------------------------------------------------------------
    def run(self, snapshot: Snapshot, nodeid: str, *, fresh: bool, timeout: float, scope: str = "") -> ChildRun:
        """Run one test in a fresh child of ``snapshot``; the child is killed afterwards, whatever happened."""
        assert self._process is not None
        factory = self._session.factory
        outcome = ChildRun()
        child: VM | None = None
        process: GuestProcess | None = None
        remaining = self._remaining[0]
        if not fresh and snapshot is self._prepared and remaining is not None:
            self._remaining[0] = max(0, remaining - 1)
        marker = f"forkd-isolate-output-end-{secrets.token_hex(8)}"
        try:
            child = factory.fork_snapshot(snapshot, 1)[0]
            deadline = time.monotonic() + timeout  # the test's own time, from when its VM is there
            process = child.process(self._process.pid)
            command = {"op": "run", "nodeid": nodeid, "fresh": fresh, "marker": marker, "scope": scope}
            process.write_stdin(json.dumps(command) + "\n")
            while True:
                message = read_reply(process, deadline, f"running {nodeid} in VM {child.name}")
                op = message.get("op")
                if op == "report":
                    outcome.reports.append(message["report"])
                elif op == "done":
                    outcome.warnings = list(message.get("warnings", ()))
                    outcome.recorded = {
                        key: list(message.get(key, ())) for key in ("xml_attributes", "testsuite_properties")
                    }
                    break
                else:
                    raise RunnerFailed(f"the guest's pytest failed while running {nodeid}:\n{message.get('message')}")
            outcome.output = _output_until(process, marker, OUTPUT_MARKER_WAIT_S)
        except TestTimedOut:
            console = child.console_tail() if child is not None and not child.closed else ""
            outcome.error = timed_out(nodeid, timeout, child.name if child is not None else "?", console)
        except GuestCrashed as exc:
            outcome.error = exc
        except RunnerFailed as exc:
            outcome.error = RunnerFailed(self._explain(exc, child, process), exc.status)
        except VMError as exc:
            outcome.error = GuestCrashed(f"the test's VM failed: {exc}") if child is not None else exc
        finally:
            if child is not None:
                factory.close_soon(child)
        return outcome

    @staticmethod
    def _explain(error: RunnerFailed, child: VM | None, process: GuestProcess | None) -> str:
        """``error`` with what the child's pytest and console said last, and the likely cause of a kill."""
        message = str(error)
        if error.status == -9:
            message += (
                " (SIGKILL: most likely the out-of-memory killer; the guest's files live in its memory, "
                "so a test that fills the disk fills it)"
            )
        if child is None or child.closed:
            return message
        output = _drain(process) if process is not None else ""
        console = child.console_tail(20)
        if output.strip():
            message += f"\n--- last output of the test's pytest ---\n{output[-OUTPUT_TAIL_CHARS:]}"
        if console.strip():
            message += f"\n--- last lines of the guest console ---\n{console}"
        return message

    # -- the end ---------------------------------------------------------------------------------
    def close(self, *, interrupted: bool = False) -> None:
        """End the runner (its pytest tears down what is still set up) and kill the parent.

        After an interrupted run (Ctrl-C) a parent that holds set-up gets
        :data:`INTERRUPTED_TEARDOWN_S` for its teardown, not the 15 minutes
        a slow one may have, and one that holds none is killed at once; a
        second Ctrl-C cuts the wait short. The VM is killed either way.
        """
        vm, self._vm = self._vm, None
        process, self._process = self._process, None
        if vm is None:
            return
        if interrupted:
            wait = INTERRUPTED_TEARDOWN_S if self.set_up else 0.0
        else:
            wait = PARENT_COMMAND_TIMEOUT_S if self.set_up else 30.0
        try:
            if process is not None and not vm.closed and wait > 0:
                process.write_stdin(json.dumps({"op": "exit"}) + "\n")
                process.wait(timeout=wait)
                if self._stderr is not None:
                    self._stderr.wait(1.0)
        except ForkdError:
            pass
        finally:
            vm.close()


def warm_child(child: VM, *, pid: int) -> None:
    """What a pooled child does first, on the pool's core: attach to the waiting pytest and have it answer.

    Under TCG every code path a child runs for the first time costs it
    translation; this is the path its test's request takes (the agent's
    attach and stdio, the runner's JSON loop, a report serialized), instead
    of the pool's usual ``true`` command, which an isolated test never runs.
    The handle stays with the child (``child.process`` returns it).
    """
    process = child.process(pid)
    process.write_stdin(json.dumps({"op": "warm"}) + "\n")
    reply = read_reply(process, time.monotonic() + WARM_TIMEOUT_S, f"warming VM {child.name}")
    if reply.get("op") != "warm":
        raise RunnerFailed(f"the guest's pytest answered {reply.get('op')!r} to a warm-up in VM {child.name}")


def timed_out(nodeid: str, timeout: float, vm_name: str, console: str) -> TestTimedOut:
    """The failure of a test whose VM was killed at its timeout: the cause and the figure first, for ``-rf``."""
    return TestTimedOut(
        f"past its timeout of {timeout:g} s: VM {vm_name} killed, running {nodeid} (set another with "
        "@pytest.mark.forkd_isolate(timeout=SECONDS) or --forkd-isolate-timeout)"
        + (f"\n--- last lines of the guest console ---\n{console}" if console else "")
    )


#: Error kinds of the runner that stop the run, and the field naming what each is about.
REFUSALS: Final = {"options": "options", "plugins": "plugins", "imports": "lines", "internals": "lines"}


def _output_until(process: GuestProcess, marker: str, timeout: float) -> str:
    """What the test wrote to the runner's stderr (``-s``), up to the ``marker`` line the runner writes after it.

    The marker follows the test's output on the same stream, so this returns
    as soon as that output is here, without a fixed wait; it stops at
    ``timeout`` when the test took its stderr away.
    """
    chunks: list[str] = []
    ending = marker + "\n"
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            line = process.stderr.readline(timeout=left)
        except (ProcessTimeout, ForkdError):
            break
        if not line:
            break
        text = line.decode(errors="replace")
        if text.endswith(ending):
            chunks.append(text[: -len(ending)])
            break
        chunks.append(text)
    return "".join(chunks)


def _drain(process: GuestProcess) -> str:
    """What the test's pytest wrote to stderr as far as it already arrived (after a failure: no marker)."""
    chunks = []
    while True:
        try:
            chunk = process.stderr.read_chunk(timeout=0.05)
        except (ProcessTimeout, ForkdError):
            break
        if not chunk:
            break
        chunks.append(chunk.decode(errors="replace"))
    return "".join(chunks)
