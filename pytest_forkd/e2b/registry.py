"""The sandboxes of one server and their life: create, fork, pause, resume, snapshot, time out, kill.

Every sandbox is a forkd VM (see :mod:`pytest_forkd.e2b.sandbox`); what E2B
calls its operations maps onto forkd's:

- create: a copy-on-write child of the template's snapshot (from the pool
  when one is ready);
- fork(count): one branch of the running sandbox (it keeps running, under the
  same id and expiry), then ``count`` children of that branch, committed when
  the call answers and restored in the background, each call to a child
  waiting for its restore (see :mod:`pytest_forkd.e2b.forks`);
- pause: the sandbox's whole state branched into the session's snapshot store
  on disk, then its VM ended: no QEMU process and no guest memory of its own
  stays on the host (its template's snapshot, shared with every sandbox of the
  template, stays); connect/resume: a child of that snapshot under the same
  id, with its files and processes (reattached by pid);
- create_snapshot: a branch into the store that ``Sandbox.create(id)`` forks;
- the timeout: a timer that kills or pauses as the sandbox's lifecycle says;
  ``auto_resume`` resumes a paused sandbox on its next in-sandbox call.

Snapshots are removed when nothing uses them any more (:class:`SnapshotLease`),
and all of them, like every VM, when the server closes. Their tags carry the
server's pid, so what a server killed with SIGKILL left in the store is
removed by the next one.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import datetime
import functools
import itertools
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pytest_forkd.aio import AsyncVM
from pytest_forkd.core.branching import branch
from pytest_forkd.core.pool import fork_memory_problem
from pytest_forkd.e2b.api_errors import ApiError, as_api_error, sandbox_gone
from pytest_forkd.e2b.auth import new_id, new_token
from pytest_forkd.e2b.config import DEFAULT_TEMPLATE, ServerConfig
from pytest_forkd.e2b.forks import ForkRestores, started
from pytest_forkd.e2b.guest_helper import FilesHelper
from pytest_forkd.e2b.processes import ProcessConfig, ProcessTable
from pytest_forkd.e2b.sandbox import Lifecycle, Sandbox, State, utc_now
from pytest_forkd.e2b.templates import Template, TemplateCatalog
from pytest_forkd.errors import ForkdError
from pytest_forkd.processes import is_alive

if TYPE_CHECKING:
    from pytest_forkd.core.vm import VM
    from pytest_forkd.project.session import ForkdSession
    from pytest_forkd.storage.snapshot import Snapshot

log = logging.getLogger("pytest_forkd.e2b")

MAX_FORK_COUNT = 20
DEBUG_SANDBOX_ID = "debug_sandbox_id"
_SNAPSHOT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,99}")
_TAG_PREFIX = "e2b-p"
#: Start errors of fork children kept for the calls that come after the child was removed.
START_FAILURES_KEPT = 256


class SnapshotLease:
    """A snapshot of this server's, removed from its store once nothing holds it (see :class:`Leases`)."""

    def __init__(self, snapshot: Snapshot, store: Any, base: str | None) -> None:
        self.snapshot = snapshot
        self.store = store
        self.base = base
        """The path of the leased snapshot this one's memory is a diff against, held while this one exists."""
        self.holders: set[str] = set()


class Leases:
    """Which of the server's snapshots are in use, and by whom; each is removed when its last holder lets go.

    A running sandbox holds the snapshots its VM was started from and maps
    (``vm.origin``, ``vm.memory_base``: a branch may re-base a VM onto the
    snapshot it just took, so that is read again after every branch); a paused
    one holds its pause snapshot; a snapshot holds the one its memory is a
    diff against; a snapshot id holds its snapshot until it is deleted.
    """

    def __init__(self) -> None:
        self._by_path: dict[str, SnapshotLease] = {}
        self._waiting: list[SnapshotLease] = []

    def add(self, snapshot: Snapshot, store: Any) -> SnapshotLease:
        base = self._base_path(snapshot, store)
        lease = SnapshotLease(snapshot, store, base if base in self._by_path else None)
        self._by_path[str(snapshot.path)] = lease
        if lease.base is not None:
            self._by_path[lease.base].holders.add(f"base-of:{snapshot.path}")
        return lease

    @staticmethod
    def _base_path(snapshot: Snapshot, store: Any) -> str | None:
        base_dir = snapshot.extra.get("base_dir")
        if isinstance(base_dir, str):
            return base_dir
        return str(store.root / snapshot.base) if snapshot.base else None

    def paths_of(self, vm: VM | None) -> set[str]:
        """The leased snapshots ``vm`` depends on."""
        if vm is None:
            return set()
        found = {str(point.path) for point in (vm.origin, vm.memory_base) if point is not None}
        return found & set(self._by_path)

    def rehold(self, holder: str, before: set[str], after: set[str]) -> set[str]:
        """Move ``holder`` from the snapshots in ``before`` to those in ``after``; returns ``after``."""
        for path in after - before:
            lease = self._by_path.get(path)
            if lease is not None:
                lease.holders.add(holder)
        for path in before - after:
            self.release(path, holder)
        return {path for path in after if path in self._by_path}

    def release(self, path: str, holder: str) -> None:
        lease = self._by_path.get(path)
        if lease is None:
            return
        lease.holders.discard(holder)
        if lease.holders:
            return
        del self._by_path[path]
        self._remove(lease)
        if lease.base is not None:
            self.release(lease.base, f"base-of:{path}")

    def _remove(self, lease: SnapshotLease) -> None:
        """Remove the snapshot; one the store still counts others descending from waits until they are gone."""
        try:
            lease.store.remove(lease.snapshot.tag)
        except ForkdError:
            self._waiting.append(lease)  # a later pause of the same sandbox descends from it
            return
        while self._waiting:
            removed = False
            for waiting in list(self._waiting):
                try:
                    waiting.store.remove(waiting.snapshot.tag)
                except ForkdError:
                    continue
                self._waiting.remove(waiting)
                removed = True
            if not removed:
                break

    def release_unheld(self) -> None:
        """Remove the snapshots nothing holds (one taken for a fork whose children all failed to start)."""
        for path, lease in list(self._by_path.items()):
            if not lease.holders:
                lease.holders.add("sweep")
                self.release(path, "sweep")
        for lease in list(self._waiting):
            try:
                lease.store.remove(lease.snapshot.tag, cascade=True)
            except ForkdError as exc:
                log.warning("removing snapshot %s failed: %s", lease.snapshot.tag, exc)
            self._waiting.remove(lease)


@dataclass
class UserSnapshot:
    """What ``create_snapshot`` made: a template of its own, named by its id."""

    snapshot_id: str
    source: str
    template: Template
    processes: dict[int, ProcessConfig]
    path: str
    names: list[str] = field(default_factory=list)


class SandboxRegistry:
    """The sandboxes and snapshots of one server (used from its event loop)."""

    def __init__(
        self,
        catalog: TemplateCatalog,
        config: ServerConfig,
        *,
        interpreter_factory: Callable[[AsyncVM], Any] | None = None,
    ) -> None:
        self.catalog = catalog
        self.config = config
        self.sandboxes: dict[str, Sandbox] = {}
        self.snapshots: dict[str, UserSnapshot] = {}
        self.interpreter_factory = interpreter_factory
        self.leases = Leases()
        self._tags = itertools.count(1)
        self._background: set[asyncio.Task[Any]] = set()
        self._closing = False
        self._prefix = f"{_TAG_PREFIX}{os.getpid()}"
        self._debug_lock = asyncio.Lock()
        self._restores = ForkRestores()
        self._start_failures: collections.OrderedDict[str, ApiError] = collections.OrderedDict()

    @property
    def session(self) -> ForkdSession:
        return self.catalog.session

    # -- looking up -----------------------------------------------------------------------------------
    def get(self, sandbox_id: str) -> Sandbox:
        """The sandbox ``sandbox_id`` (running or paused); 404 (NotFoundException) otherwise."""
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None:
            raise self._not_found(sandbox_id)
        return sandbox

    def _not_found(self, sandbox_id: str) -> ApiError:
        failure = self._start_failures.get(sandbox_id)
        return ApiError(404, f"sandbox {sandbox_id} not found" + (f" ({failure.message})" if failure else ""))

    async def started(self, sandbox: Sandbox) -> None:
        """Wait until ``sandbox`` has its VM if it is a fork's child still being restored; its start error if
        the restore failed."""
        await started(sandbox)

    async def running(self, sandbox_id: str) -> Sandbox:
        """The sandbox an in-sandbox call goes to, resumed first if it is paused with auto-resume."""
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None:
            if sandbox_id == DEBUG_SANDBOX_ID and self.config.debug_ports:
                return await self._debug_sandbox()
            failure = self._start_failures.get(sandbox_id)
            raise ApiError(failure.status, failure.message) if failure else sandbox_gone(sandbox_id)
        await started(sandbox)
        if sandbox.state == State.PAUSED:
            if not sandbox.lifecycle.auto_resume:
                raise sandbox_gone(sandbox_id, "it is paused: resume it with Sandbox.connect()")
            async with sandbox.lock:
                if sandbox.state == State.PAUSED:
                    await self._resume(sandbox, sandbox.timeout_s)
        if sandbox.state != State.RUNNING or sandbox.vm is None:
            raise sandbox_gone(sandbox_id)
        return sandbox

    # -- creating ---------------------------------------------------------------------------------------
    async def create(
        self,
        template: str,
        *,
        timeout: int | None = None,
        metadata: dict[str, str] | None = None,
        envs: dict[str, str] | None = None,
        lifecycle: Lifecycle | None = None,
        internet: bool | None = None,
        sandbox_id: str | None = None,
    ) -> Sandbox:
        """A new sandbox of ``template`` (a template name or a snapshot id)."""
        self._check_room(1)
        timeout_s = self._timeout(timeout)
        user_snapshot = self.snapshots.get(template)
        origin = user_snapshot.template if user_snapshot is not None else await self.catalog.get(template)
        if internet and not (origin.snapshot.network or {}).get("mode") == "outbound":
            # E2B's default is internet access on, and e2b <= 2.31 (the OpenAI Agents SDK's pin) sends
            # allow_internet_access=true on every create whether asked or not: refusing would fail them all.
            # The sandbox gets less than asked (the template's network, none), which its info reports.
            log.warning(
                "allow_internet_access=True: template %r has no outbound network, so the sandbox has none; give "
                "the template one in forkd.yaml (network: outbound) to let sandboxes reach out",
                template,
            )
        try:
            vm = (await asyncio.to_thread(origin.fork, 1))[0]
        except ForkdError as exc:
            raise ApiError(500, f"starting a sandbox of template {template!r} failed: {exc}") from None
        sandbox = Sandbox(
            id=sandbox_id or new_id(),
            template=origin,
            envd_token=new_token(),
            traffic_token=new_token(),
            timeout_s=timeout_s,
            lifecycle=lifecycle or Lifecycle(),
            metadata=dict(metadata or {}),
            envs=dict(envs or {}),
        )
        try:
            if envs:
                vm.env = {**vm.env, **envs}
        except ForkdError as exc:
            vm.close()
            raise ApiError(400, f"envs: {exc}") from None
        self._adopt(sandbox, vm, dict(user_snapshot.processes) if user_snapshot else {}, origin.helper_pid)
        self.sandboxes[sandbox.id] = sandbox
        sandbox.extend(timeout_s)
        self._arm(sandbox)
        return sandbox

    def _adopt(self, sandbox: Sandbox, vm: VM, processes: dict[int, ProcessConfig], helper_pid: int | None) -> None:
        """Make ``vm`` the sandbox's running VM (after create, fork or resume)."""
        loop = asyncio.get_running_loop()
        sandbox.vm = AsyncVM(vm, loop=loop)
        sandbox.memory_mib = vm.memory_mib
        sandbox.vcpus = int(vm.machine.spec.vcpus)
        sandbox.state = State.RUNNING
        sandbox.processes = ProcessTable(processes)
        sandbox.processes.bind(vm, loop)
        sandbox.helper_pid = helper_pid
        sandbox.files = FilesHelper(vm, helper_pid, loop)
        sandbox.interpreter = None
        self._rehold(sandbox)
        if processes:
            self._in_background(sandbox.processes.attach_all())

    def _rehold(self, sandbox: Sandbox) -> None:
        """Hold what the sandbox uses now: its VM's snapshots (read again after each branch), its pause snapshot."""
        wanted = self.leases.paths_of(sandbox.sync_vm)
        if sandbox.paused is not None:
            wanted.add(str(sandbox.paused.path))
        sandbox.held = self.leases.rehold(sandbox.id, sandbox.held, wanted)

    # -- ending -----------------------------------------------------------------------------------------
    async def kill(self, sandbox_id: str) -> None:
        """End the sandbox: its VM killed, its snapshots released; 404 when there is no such sandbox."""
        sandbox = self.get(sandbox_id)
        async with sandbox.lock:  # a fork's child being restored: once it is (see e2b.forks)
            if self.sandboxes.get(sandbox_id) is not sandbox:
                raise self._not_found(sandbox_id)
            del self.sandboxes[sandbox_id]
            if sandbox.timer is not None:
                sandbox.timer.cancel()
            await self._end_vm(sandbox, sandbox_gone(sandbox_id, "it was killed"))
            sandbox.state = State.KILLED
            sandbox.paused = None
            self._rehold(sandbox)

    async def _end_vm(self, sandbox: Sandbox, error: ApiError) -> None:
        sandbox.processes.close(error)
        if sandbox.files is not None:
            sandbox.files.close(error.message)
        interpreter, sandbox.interpreter = sandbox.interpreter, None
        if interpreter is not None:
            try:
                await interpreter.close()
            except Exception as exc:  # noqa: BLE001 - the VM ends anyway
                log.warning("closing the code interpreter of sandbox %s failed: %s", sandbox.id, exc)
        vm, sandbox.vm = sandbox.vm, None
        if vm is not None:
            await vm.close()

    # -- pause and resume -------------------------------------------------------------------------------
    async def pause(self, sandbox_id: str) -> bool:
        """Write the sandbox's state to the store and end its VM; False when it was paused already."""
        sandbox = self.get(sandbox_id)
        async with sandbox.lock:
            if sandbox.state == State.PAUSED:
                return False
            vm = self._vm_of(sandbox)
            tag = f"{self._prefix}-{sandbox.id}-pause{next(self._tags)}"
            try:
                snapshot = await asyncio.to_thread(branch, vm, tag, store=self.session.store)
            except ForkdError as exc:
                raise ApiError(500, f"pausing sandbox {sandbox_id} failed: {exc}; it keeps running") from None
            self.leases.add(snapshot, self.session.store)
            if sandbox.timer is not None:
                sandbox.timer.cancel()
            sandbox.helper_pid = _helper_pid(sandbox)
            await self._end_vm(sandbox, ApiError(499, f"sandbox {sandbox_id} was paused"))
            sandbox.paused = snapshot
            sandbox.state = State.PAUSED
            self._rehold(sandbox)  # lets go of the previous pause snapshot and of what the VM mapped
            return True

    async def connect(self, sandbox_id: str, timeout: int | None) -> tuple[Sandbox, bool]:
        """``connect``: a running sandbox (its timeout raised when ``timeout`` ends later), a paused one resumed.

        Returns the sandbox and whether it was resumed.
        """
        sandbox = self.get(sandbox_id)
        async with sandbox.lock:
            if self.sandboxes.get(sandbox_id) is not sandbox:  # a fork's child that failed to start
                raise self._not_found(sandbox_id)
            if sandbox.state == State.PAUSED:
                await self._resume(sandbox, self._timeout(timeout) if timeout else sandbox.timeout_s)
                return sandbox, True
            if timeout:
                wanted = self._timeout(timeout)
                if utc_now() + datetime.timedelta(seconds=wanted) > sandbox.end_at:
                    sandbox.extend(wanted)
                    self._arm(sandbox)
            return sandbox, False

    async def _resume(self, sandbox: Sandbox, timeout_s: int) -> None:
        assert sandbox.paused is not None
        try:
            vm = (await asyncio.to_thread(sandbox.paused.fork, 1))[0]
        except ForkdError as exc:
            raise ApiError(500, f"resuming sandbox {sandbox.id} failed: {exc}; it stays paused") from None
        self._adopt(sandbox, vm, sandbox.processes.copy(), sandbox.helper_pid)
        sandbox.extend(timeout_s)
        self._arm(sandbox)

    # -- fork and snapshots -----------------------------------------------------------------------------
    async def fork(self, sandbox_id: str, count: int | None, timeout: int | None) -> list[Sandbox]:
        """``count`` children of one branch of the running sandbox, which keeps running (same id, same end).

        The children answer once the branch is taken: each is restored in the
        background and its calls wait for that (see :mod:`pytest_forkd.e2b.forks`).
        """
        count = 1 if count is None else count
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_FORK_COUNT:
            raise ApiError(400, f"count must be an integer between 1 and {MAX_FORK_COUNT}, got {count!r}")
        source = self.get(sandbox_id)
        self._check_room(count)
        timeout_s = self._timeout(timeout) if timeout else source.timeout_s
        problem = fork_memory_problem(count) if count > 1 else None
        if problem is not None:
            raise ApiError(500, f"forking sandbox {sandbox_id} failed: {problem}")
        async with source.lock:
            vm = self._vm_of(source)
            try:
                snapshot = await asyncio.to_thread(vm.branch)
            except ForkdError as exc:
                raise ApiError(500, f"forking sandbox {sandbox_id} failed: {exc}") from None
            self.leases.add(snapshot, self.session.factory.session_store)
            self._rehold(source)  # the branch may have re-based the source onto the new snapshot
            processes = source.processes.copy()
            helper_pid = _helper_pid(source)
        factory = source.template.session.factory
        forked = []
        for _ in range(count):
            child = Sandbox(
                id=new_id(),
                template=source.template,
                envd_token=new_token(),
                traffic_token=new_token(),
                timeout_s=timeout_s,
                lifecycle=source.lifecycle,
                metadata=dict(source.metadata),
                envs=dict(source.envs),
                memory_mib=source.memory_mib,
                vcpus=source.vcpus,
                internet=source.internet,
            )
            # Held by the child from now on: released if it is killed or fails before its VM holds it.
            child.held = self.leases.rehold(child.id, set(), {str(snapshot.path)})
            self.sandboxes[child.id] = child
            child.extend(timeout_s)
            self._arm(child)
            task = await self._restores.start(
                child,
                snapshot,
                factory,
                adopt=functools.partial(self._adopt_child, processes=processes, helper_pid=helper_pid),
                fail=self._failed_start,
                what=f"starting sandbox {child.id} (a fork of {sandbox_id})",
            )
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            forked.append(child)
        return forked

    def _adopt_child(
        self, child: Sandbox, vm: VM, *, processes: dict[int, ProcessConfig], helper_pid: int | None
    ) -> None:
        if self.sandboxes.get(child.id) is not child or self._closing:
            raise ApiError(503, "the server is stopping")
        self._adopt(child, vm, dict(processes), helper_pid)

    def _failed_start(self, child: Sandbox, error: ApiError) -> None:
        """A fork's child never came up: it is removed, and its calls get ``error`` (see e2b.forks)."""
        if self.sandboxes.get(child.id) is child:
            del self.sandboxes[child.id]
        if child.timer is not None:
            child.timer.cancel()
        child.state = State.KILLED
        self._rehold(child)  # lets go of the branch it was to be restored from
        self._start_failures[child.id] = error
        while len(self._start_failures) > START_FAILURES_KEPT:
            self._start_failures.popitem(last=False)

    async def snapshot(self, sandbox_id: str, name: str | None) -> UserSnapshot:
        """A snapshot of the running sandbox (it keeps running) that ``create`` takes as a template."""
        if name is not None and not _SNAPSHOT_NAME.fullmatch(name):
            raise ApiError(400, f"snapshot name {name!r}: letters, digits, '.', '_', '-', ':' (at most 100)")
        snapshot_id = name or f"snapshot-{new_id(12)}"
        if snapshot_id in self.snapshots:
            raise ApiError(409, f"a snapshot named {snapshot_id!r} exists already; delete it or pick another name")
        sandbox = self.get(sandbox_id)
        async with sandbox.lock:
            vm = self._vm_of(sandbox)
            tag = f"{self._prefix}-{sandbox.id}-snap{next(self._tags)}"
            try:
                record = await asyncio.to_thread(branch, vm, tag, store=self.session.store)
            except ForkdError as exc:
                raise ApiError(500, f"snapshotting sandbox {sandbox_id} failed: {exc}") from None
            self.leases.add(record, self.session.store).holders.add(f"snapshot:{snapshot_id}")
            self._rehold(sandbox)
            processes = sandbox.processes.copy()
        entry = UserSnapshot(
            snapshot_id=snapshot_id,
            source=sandbox.id,
            template=Template(snapshot_id, record, self.session, _helper_pid(sandbox), sandbox.template.user),
            processes=processes,
            path=str(record.path),
            names=[snapshot_id],
        )
        self.snapshots[snapshot_id] = entry
        return entry

    def delete_snapshot(self, snapshot_id: str) -> bool:
        entry = self.snapshots.pop(snapshot_id, None)
        if entry is None:
            return False
        self.leases.release(entry.path, f"snapshot:{snapshot_id}")  # removed once no sandbox started from it runs
        return True

    # -- timeouts ---------------------------------------------------------------------------------------
    def set_timeout(self, sandbox_id: str, timeout: int) -> None:
        sandbox = self.get(sandbox_id)
        sandbox.extend(self._timeout(timeout))
        if sandbox.state == State.RUNNING:
            self._arm(sandbox)

    def _arm(self, sandbox: Sandbox) -> None:
        if sandbox.timer is not None:
            sandbox.timer.cancel()
        delay = max(0.0, (sandbox.end_at - utc_now()).total_seconds())
        loop = asyncio.get_running_loop()
        sandbox.timer = loop.call_later(delay, lambda: self._in_background(self._expired(sandbox)))

    async def _expired(self, sandbox: Sandbox) -> None:
        if self.sandboxes.get(sandbox.id) is not sandbox or sandbox.state != State.RUNNING:
            return
        if sandbox.end_at > utc_now():
            self._arm(sandbox)
            return
        try:
            if sandbox.lifecycle.on_timeout == "pause":
                await self.pause(sandbox.id)
            else:
                await self.kill(sandbox.id)
        except ApiError as exc:
            log.warning("sandbox %s timed out and could not be ended: %s", sandbox.id, exc.message)
            if sandbox.lifecycle.on_timeout == "pause":
                await self.kill(sandbox.id)

    def _timeout(self, timeout: int | None) -> int:
        if timeout is None:
            return self.config.default_timeout_s
        limit = self.config.limits.max_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int) or not 0 < timeout <= limit:
            raise ApiError(400, f"timeout must be a whole number of seconds from 1 to {limit}, got {timeout!r}")
        return timeout

    # -- listing ----------------------------------------------------------------------------------------
    def listed(
        self,
        *,
        states: set[str] | None = None,
        metadata: dict[str, str] | None = None,
        started_after: datetime.datetime | None = None,
        template: str | None = None,
        order: str = "asc",
    ) -> list[Sandbox]:
        found = [
            sandbox
            for sandbox in self.sandboxes.values()
            if (not states or sandbox.state.value in states)
            and all(sandbox.metadata.get(key) == value for key, value in (metadata or {}).items())
            and (started_after is None or sandbox.started_at >= started_after)
            and (template is None or sandbox.template.name == template)
        ]
        found.sort(key=lambda sandbox: (sandbox.started_at, sandbox.id), reverse=order == "desc")
        return found

    @staticmethod
    def page(items: list[Sandbox], limit: int, token: str | None) -> tuple[list[Sandbox], str | None]:
        """One page of ``items`` after ``token`` (the last id of the previous page), and the next token."""
        start = 0
        if token:
            try:
                after = base64.urlsafe_b64decode(token.encode() + b"==").decode()
            except (ValueError, UnicodeDecodeError):
                raise ApiError(400, "nextToken is malformed: pass the x-next-token of the previous page") from None
            ids = [sandbox.id for sandbox in items]
            start = ids.index(after) + 1 if after in ids else len(items)
        chosen = items[start : start + limit]
        more = start + limit < len(items)
        next_token = base64.urlsafe_b64encode(chosen[-1].id.encode()).decode().rstrip("=") if more and chosen else None
        return chosen, next_token

    # -- the server's life ------------------------------------------------------------------------------
    def clean_leftovers(self) -> list[str]:
        """Remove the snapshots servers that died without closing left in the store (blocking)."""
        removed = []
        store = self.session.store
        pattern = re.compile(rf"{_TAG_PREFIX}(\d+)-")
        for snapshot in store.list():
            match = pattern.match(snapshot.tag)
            if match is None or is_alive(int(match.group(1))):
                continue
            try:
                removed += store.remove(snapshot.tag, cascade=True)
            except ForkdError as exc:
                log.warning("removing leftover snapshot %s failed: %s", snapshot.tag, exc)
        return removed

    async def close(self) -> None:
        """Kill every sandbox and remove every snapshot of this server."""
        self._closing = True
        for sandbox_id in list(self.sandboxes):
            try:
                await self.kill(sandbox_id)
            except ApiError:
                pass
            except Exception as exc:  # noqa: BLE001 - closing goes on with the others
                log.warning("killing sandbox %s failed: %s", sandbox_id, as_api_error(exc, "kill").message)
        for snapshot_id in list(self.snapshots):
            self.delete_snapshot(snapshot_id)
        for task in list(self._background):
            task.cancel()
        self._restores.close()
        self.leases.release_unheld()
        self.catalog.close()

    # -- internals --------------------------------------------------------------------------------------
    def _vm_of(self, sandbox: Sandbox) -> VM:
        if sandbox.state == State.KILLED:  # a fork's child that failed to start (this runs under its lock)
            raise self._not_found(sandbox.id)
        if sandbox.state != State.RUNNING or sandbox.vm is None:
            raise ApiError(409, f"sandbox {sandbox.id} is {sandbox.state.value}: connect() it first")
        return sandbox.vm.sync

    def _check_room(self, count: int) -> None:
        if self._closing:
            raise ApiError(503, "the server is stopping")
        limit = self.config.limits.max_sandboxes
        if len(self.sandboxes) + count > limit:
            raise ApiError(
                429,
                f"at most {limit} sandboxes (running and paused) at once, and {len(self.sandboxes)} exist: "
                "kill some first",
            )

    def _in_background(self, coroutine: Any) -> None:
        task = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _debug_sandbox(self) -> Sandbox:
        """The one sandbox the SDKs' debug mode talks to (created on its first call)."""
        async with self._debug_lock:
            sandbox = self.sandboxes.get(DEBUG_SANDBOX_ID)
            if sandbox is None:
                sandbox = await self.create(
                    DEFAULT_TEMPLATE, timeout=self.config.limits.max_timeout_s, sandbox_id=DEBUG_SANDBOX_ID
                )
        return sandbox


def _helper_pid(sandbox: Sandbox) -> int | None:
    """The pid of the sandbox's filesystem helper now (it may have started one of its own)."""
    files = sandbox.files
    return files.pid if files is not None and files.pid is not None else sandbox.helper_pid
