"""The parent VM of ``pytest --forkd-isolate``: the project in it, its pytest collected and waiting, children per test.

One per pytest process (so one per xdist worker). It starts on the first
isolated test: a child of the session's snapshot (``--forkd-snapshot``,
forkd.yaml) gets the project copied in (see :mod:`~pytest_forkd.isolate.plan`)
and the in-guest runner (:mod:`pytest_forkd.guest.isolate_runner`), which
imports pytest and the suite and collects it. Then the parent is branched
(the *bare* state, for tests that ask for a fresh set-up), and, for each test
file in turn, told to set up that file's module and the session- and
module-scoped fixtures, and branched again: every test of the file runs in
a copy-on-write child of that branch, where the runner, already warm, runs
that one test and streams its reports back. After the file's last test the
parent tears the module down (its teardown report joins that test's), and
after the run's last test, the session.

A child that dies (a kernel panic, a test that killed the agent) is reported
as :class:`~pytest_forkd.errors.GuestCrashed` with its console tail; one that
runs past its timeout is killed. Either way the parent and the other tests
are untouched.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from pytest_forkd.errors import ForkdError, GuestCrashed, ProcessTimeout, VMError
from pytest_forkd.guest import GUEST_DIR
from pytest_forkd.isolate.plan import RUNNER_DIR, RUNNER_PATH, SPEC_PATH, GuestPlan

if TYPE_CHECKING:
    from pytest_forkd.core.process import GuestProcess
    from pytest_forkd.core.vm import VM
    from pytest_forkd.project.session import ForkdSession
    from pytest_forkd.storage.snapshot import Snapshot

#: The in-guest runner's source, copied into the parent VM at start.
RUNNER_SOURCE: Final = GUEST_DIR / "isolate_runner.py"
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


class RunnerFailed(ForkdError):
    """The guest's pytest could not start, collect or answer (the message has its output)."""

    def __init__(self, message: str, status: int | str | None = None) -> None:
        super().__init__(message)
        self.status = status
        """Its exit status when it exited (``-9``: killed), else None."""


class TestTimedOut(ForkdError):
    """A test ran past its timeout; its VM was killed."""

    __test__ = False


@dataclass
class ChildRun:
    """What one test's child VM sent back: the reports it finished, and how it ended."""

    reports: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[dict[str, Any]] = field(default_factory=list)
    error: ForkdError | None = None
    """Why the child did not finish: GuestCrashed, TestTimedOut, RunnerFailed; None if it did."""
    output: str = ""
    """What the test wrote outside pytest's capture (``-s``), relayed to the host's terminal."""


class _Tail:
    """The last characters of a stream, read on a background thread (so the guest never holds them)."""

    def __init__(self, process: GuestProcess, name: str) -> None:
        self._chunks: collections.deque[str] = collections.deque()
        self._size = 0
        self._lock = threading.Lock()
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
    ) -> None:
        self._session = session
        self._plan = plan
        self._progress = progress
        self._python = python
        self._vm: VM | None = None
        self._process: GuestProcess | None = None
        self._stderr: _Tail | None = None
        self.collected: set[str] = set()
        self.collection_errors: dict[str, str] = {}
        self.guest_versions: dict[str, str] = {}
        self._bare: Snapshot | None = None
        self._prepared: Snapshot | None = None
        self.prepared_file: str | None = None
        """The test file whose module the parent has set up (its branch is what children fork from)."""
        self.set_up = False
        """Whether the parent holds set-up (session fixtures at least) that a teardown must still undo."""
        self.start_seconds = 0.0
        self._remaining = [0]
        """How many more children of the current branch the tests to come will take (the pool's demand)."""

    # -- starting --------------------------------------------------------------------------------
    def start(self) -> None:
        """Boot the parent, copy the project in, start the runner and wait until the suite is collected."""
        started = time.perf_counter()
        session = self._session
        with session.timings.running_test(None):
            snapshot = session.selected
            self._vm = vm = session.factory.fork_snapshot(snapshot, 1)[0]
            for copy in self._plan.copies:
                self._progress(f"forkd: copying {copy.path} into the isolation parent VM")
                vm.copy_in(copy.path, str(copy.path), exclude=copy.exclude)
            vm.exec(["mkdir", "-p", RUNNER_DIR], check=True)
            vm.write_file(RUNNER_PATH, RUNNER_SOURCE.read_bytes())
            vm.write_file(SPEC_PATH, self._plan.spec_json())
            self._progress("forkd: collecting the suite with pytest in the isolation parent VM")
            self._process = vm.spawn(
                self._plan.command(self._python),
                cwd=self._plan.cwd,
                env=dict(self._plan.env),
                max_output=RUNNER_MAX_OUTPUT,
            )
            self._stderr = _Tail(self._process, "forkd-isolate-stderr")
            ready = self._command(None, "collecting the suite", COLLECT_TIMEOUT_S)
            if ready.get("op") != "ready":
                raise RunnerFailed(f"the guest's pytest answered {ready.get('op')!r} instead of collecting")
            self.collected = set(ready.get("collected", ()))
            self.collection_errors = dict(ready.get("errors", {}))
            self.guest_versions = {key: str(ready.get(key)) for key in ("python", "pytest")}
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
            if self._stderr is not None:
                self._stderr.wait(5.0)  # it exits after an error: let its last words arrive
            raise RunnerFailed(
                f"the guest's pytest failed while {what}:\n{reply.get('message', '')}\n{self.output_tail()}"
            )
        return reply

    def output_tail(self) -> str:
        """The last lines the parent's pytest wrote outside its replies (its own errors, collection warnings)."""
        if self._stderr is not None:
            self._stderr.wait(2.0 if self._process is not None and self._process.poll() is not None else 0.0)
        tail = self._stderr.text() if self._stderr is not None else ""
        if not tail.strip():
            return ""
        hint = NO_PYTEST_HINT if "No module named 'pytest'" in tail else ""
        return f"{hint}--- last output of the guest's pytest ---\n{tail}"

    # -- the state children fork from ------------------------------------------------------------
    def snapshot_for(self, nodeid: str, file: str, group: list[str], *, fresh: bool, timeout: float) -> Snapshot:
        """The snapshot the test's child forks from: the bare one, or the branch with its file set up."""
        if fresh:
            assert self._bare is not None
            return self._bare
        if self._prepared is not None and self.prepared_file == file:
            return self._prepared
        assert self._vm is not None
        with self._session.timings.running_test(None):
            self._command(
                {"op": "prepare", "nodeid": nodeid, "group": group},
                f"setting up {file} in the parent VM",
                max(timeout, PARENT_COMMAND_TIMEOUT_S),
            )
            self.set_up = True
            previous, self._prepared = self._prepared, self._vm.branch()
            self.prepared_file = file
            if previous is not None:
                self._forget(previous)
            if self._session.settings.pool > 0:
                remaining = self._remaining = [len(group) + 1]
                self._session.factory.pool(self._prepared, self._session.settings.pool, demand=lambda: remaining[0])
        return self._prepared

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

    def teardown(self, nodeid: str, next_nodeid: str | None, *, timeout: float) -> dict[str, Any]:
        """Tear down in the parent what the next test does not share (everything after the last test).

        Returns the runner's answer: the serialized teardown report and its warnings.
        """
        with self._session.timings.running_test(None):
            reply = self._command(
                {"op": "teardown", "nodeid": nodeid, "next": next_nodeid},
                "tearing down in the parent VM",
                max(timeout, PARENT_COMMAND_TIMEOUT_S),
            )
        if self._prepared is not None:
            self._forget(self._prepared)
        self._prepared = None
        self.prepared_file = None
        self.set_up = next_nodeid is not None
        return reply

    # -- a test in its child ---------------------------------------------------------------------
    def run(self, snapshot: Snapshot, nodeid: str, *, fresh: bool, timeout: float) -> ChildRun:
        """Run one test in a fresh child of ``snapshot``; the child is killed afterwards, whatever happened."""
        assert self._process is not None
        factory = self._session.factory
        outcome = ChildRun()
        child: VM | None = None
        process: GuestProcess | None = None
        if not fresh and snapshot is self._prepared:
            self._remaining[0] = max(0, self._remaining[0] - 1)
        try:
            child = factory.fork_snapshot(snapshot, 1)[0]
            deadline = time.monotonic() + timeout  # the test's own time, from when its VM is there
            process = child.process(self._process.pid)
            process.write_stdin(json.dumps({"op": "run", "nodeid": nodeid, "fresh": fresh}) + "\n")
            while True:
                message = read_reply(process, deadline, f"running {nodeid} in VM {child.name}")
                op = message.get("op")
                if op == "report":
                    outcome.reports.append(message["report"])
                elif op == "done":
                    outcome.warnings = list(message.get("warnings", ()))
                    break
                else:
                    raise RunnerFailed(f"the guest's pytest failed while running {nodeid}:\n{message.get('message')}")
            outcome.output = _drain(process)
        except TestTimedOut:
            console = child.console_tail() if child is not None and not child.closed else ""
            outcome.error = TestTimedOut(
                f"{nodeid} ran past its timeout of {timeout:g} s in VM {child.name if child else '?'}; "
                "the VM was killed (set another with @pytest.mark.forkd_isolate(timeout=SECONDS) or "
                "--forkd-isolate-timeout)"
                + (f"\n--- last lines of the guest console ---\n{console}" if console else "")
            )
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
    def close(self) -> None:
        """End the runner (its pytest tears down what is still set up) and kill the parent."""
        vm, self._vm = self._vm, None
        process, self._process = self._process, None
        if vm is None:
            return
        try:
            if process is not None and not vm.closed:
                process.write_stdin(json.dumps({"op": "exit"}) + "\n")
                process.wait(timeout=PARENT_COMMAND_TIMEOUT_S if self.set_up else 30)
        except ForkdError:
            pass
        finally:
            vm.close()


def _drain(process: GuestProcess) -> str:
    """What the test wrote to the runner's stderr (``-s``), as far as it already arrived."""
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
