"""The VM factory: starts VMs and owns them.

Every VM of a process is started by a factory and registered with it; closing
the factory kills them all and removes the run directory. This is what keeps
a failed test, an exception or Ctrl-C from leaking VMM processes or /dev/shm
files (a ``kill -9`` is covered by PDEATHSIG and the stale-run cleanup).

The factory starts machines through its :class:`~pytest_forkd.engine.base.Engine`
(QEMU unless told otherwise): it knows the life of a VM (boot, restore a
child of a snapshot, pools), never the VMM's command line or control protocol.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pytest_forkd import private
from pytest_forkd.core import defaults, validate
from pytest_forkd.core.cores import IdleCores, usable_cores
from pytest_forkd.core.pool import (
    ChildPool,
    fork_memory_problem,
    memory_room,
    park_vm,
    unpark_vm,
    vm_usable,
)
from pytest_forkd.core.runtime import Runtime
from pytest_forkd.core.vm import VM
from pytest_forkd.engine import cancel, space
from pytest_forkd.engine.base import (
    AcceleratedEngine,
    AnyEngine,
    AnyMachine,
    EngineError,
    ImageLike,
    SpecLike,
    make_engine,
)
from pytest_forkd.engine.network import NetworkChoice, NetworkSpec, network_spec
from pytest_forkd.engine.rundir import RunDir, open_run_dir
from pytest_forkd.errors import ConfigError, HostNotReady, VMError, VMStartError
from pytest_forkd.guest.client import DEFAULT_MAX_OUTPUT, AgentClient, AgentTimeout, ChannelClosed
from pytest_forkd.storage.child_plan import ChildPlan, plan_child
from pytest_forkd.storage.local_copy import LocalCopies
from pytest_forkd.storage.snapshot import Snapshot
from pytest_forkd.storage.store import SnapshotStore

BOOT_TIMEOUT_S = 90.0
#: Longest a single fork waits for a child its pool is restoring before restoring one itself.
POOL_WAIT_S = 30.0
#: Restores one fork(n) runs at once: each is a QEMU process, one per core plus one that keeps
#: the cores busy while another waits on a socket. Under TCG a restore is CPU-bound; four per
#: core cost 7% more CPU per child than two in back-to-back runs of fork(20) (more TCG buffers
#: and page faults in flight at once), for no more throughput. The cores are those this process
#: may use: its affinity mask, within its cgroup's CPU quota (see pytest_forkd.core.cores).
FORK_THREADS = max(2, usable_cores() + 1)
#: Restores one fork(n) that does not wait for the children's agents runs at once: without the agent's
#: first answer (TCG translating its code), a restore is mostly starting a QEMU process, which waits as
#: much as it computes. fork(10) of a running child on 2 cores (load 3-4): 3 at once 886 ms, 6 687 ms,
#: 10 622 ms (p50 of 4).
UNREADY_FORK_THREADS = max(FORK_THREADS, 5 * usable_cores())


@dataclass
class RestorePhases:
    """Where the wall time and the QEMU CPU of one child's restore went, in ms (``VM.restore_phases``).

    ``qemu_start_ms``: QEMU process start until QMP answers and the agent
    channel is connected; ``memory_ms``: the backend's preparation of guest
    memory (diff pages written in, uffd server attached); ``device_state_ms``:
    the device-state load and ``cont``; ``first_reply_ms``: the guest agent's
    first answer (TCG translating the guest code it runs for the first time);
    ``forwards_ms``: port forwards restored; ``warm_ms``: a pool's first
    guest command (same reason); ``qemu_cpu_ms``: CPU time the QEMU process
    used up to the first reply (None when unreadable). ``cpu_ms`` holds the
    QEMU process's CPU (user + system) per phase, under the same names: under
    TCG a child costs CPU rather than waiting, so that is what bounds how many
    children a second a host can make (one read of /proc per phase boundary).
    """

    qemu_start_ms: float = 0.0
    memory_ms: float = 0.0
    device_state_ms: float = 0.0
    first_reply_ms: float = 0.0
    forwards_ms: float = 0.0
    warm_ms: float = 0.0
    qemu_cpu_ms: float | None = None
    cpu_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    pid: int | None = dataclasses.field(default=None, repr=False, compare=False)
    """The QEMU process whose CPU :meth:`phase` counts (set once it runs)."""
    _cpu_mark: float = dataclasses.field(default=0.0, init=False, repr=False)

    def lap(self, name: str, since: float, pid: int | None = None) -> float:
        """Add the wall time since ``since`` to phase ``name``; given ``pid``, its CPU since the last lap too."""
        now = time.perf_counter()
        setattr(self, name, getattr(self, name) + (now - since) * 1000)
        if pid is not None:
            cpu = process_cpu_ms(pid)
            if cpu is not None:  # a thread that ended leaves the per-thread sum: never count less than 0
                self.cpu_ms[name] = round(self.cpu_ms.get(name, 0.0) + max(0.0, cpu - self._cpu_mark), 3)
                self._cpu_mark = cpu
        return now

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase ``name``, with the CPU of process :attr:`pid` when it is known by the end."""
        started = time.perf_counter()
        yield
        self.lap(name, started, self.pid)

    def to_dict(self) -> dict[str, Any]:
        fields = dataclasses.asdict(self)
        fields.pop("_cpu_mark")
        fields.pop("pid")
        return fields


def process_cpu_ms(pid: int) -> float | None:
    """User + system CPU time of process ``pid`` so far, in ms (None when it cannot be read).

    Summed over its threads' scheduler statistics (nanoseconds) where the
    kernel has them: ``/proc/PID/stat`` counts in clock ticks (10 ms), too
    coarse for a restore phase (a thread that has ended is no longer in the
    sum; QEMU keeps its threads while a child restores). Falls back to
    ``/proc/PID/stat``.
    """
    try:
        total_ns = 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat", encoding="ascii") as schedstat:
                    total_ns += int(schedstat.read().split()[0])
            except FileNotFoundError:  # a thread that just ended
                continue
        if total_ns > 0:
            return total_ns / 1e6
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class VMFactory:
    """Starts and owns VMs; ``close()`` kills every VM it started."""

    def __init__(
        self,
        *,
        accel: str = "auto",
        progress: Callable[[str], None] | None = None,
        default_backend: str = "diff",
        max_output: int = DEFAULT_MAX_OUTPUT,
        engine: str | AnyEngine | None = None,
        runtime: Runtime | None = None,
    ) -> None:
        self.runtime: Runtime = runtime if runtime is not None else Runtime()
        """The storage backends this factory's VMs use and the recorder their timings go to (a fresh one by
        default; a pytest session hands its own)."""
        self.engine: AnyEngine = make_engine(engine, accel=accel)
        """What starts this factory's machines: an engine name (``qemu``, ``fake``...), an instance,
        or None for the default, QEMU."""
        self.requested_accel = accel
        self.max_output = max_output
        """The ``max_output`` of every VM this factory starts (bytes kept per output stream of an exec)."""
        self.progress = progress
        self.default_backend = default_backend
        self._pools: dict[tuple[Path, str], ChildPool[VM]] = {}
        """Pre-restored children by snapshot (directory and creation time of the record they map)."""
        self._session_store: SnapshotStore | None = None
        self._local_copies = LocalCopies()
        """Copies of the snapshots the VMM cannot map where they are (read-only stores), one per snapshot."""
        self._lock = threading.RLock()
        self._vms: set[VM] = set()
        self._run_dir: RunDir | None = None
        self._closed = False
        self._closer: ThreadPoolExecutor | None = None
        """Finishes the cleanup of VMs closed with :meth:`close_soon`."""
        cancel.install()  # SIGTERM/SIGHUP/SIGINT stop the run cleanly and within seconds (from the main thread)

    # -- host facts, resolved lazily and once -------------------------------
    def _accelerated_engine(self) -> AcceleratedEngine[SpecLike, ImageLike]:
        if not isinstance(self.engine, AcceleratedEngine):
            raise ConfigError(
                f"this VM factory runs the {self.engine.name} engine, which has no accelerator choice; "
                "use VMFactory(engine='qemu') (the default)"
            )
        return self.engine

    @property
    def run_dir(self) -> RunDir:
        with self._lock:
            if self._run_dir is None:
                self._ensure_open()  # a directory made now would outlive the factory
                self._run_dir = open_run_dir()
            return self._run_dir

    def _ensure_open(self) -> None:
        if self._closed:
            raise VMStartError("this VM factory is closed: it starts no more VMs; make a new VMFactory")

    def accel_verdict(self, image: Any) -> Any:
        """The accelerator the engine chose (KVM or TCG for QEMU), probing it once with a throwaway VM."""
        return self._accelerated_engine().accel_verdict(image, functools.partial(self._probe_boot, image))

    def machine_spec(self, image: Any, *, memory_mib: int, vcpus: int, network_card: bool = False) -> Any:
        """The machine for ``image`` at this size; checks the size first (no VM has started yet)."""
        validate.memory_mib(memory_mib, initrd=getattr(image, "initrd", None), image=image.name)
        validate.vcpus(vcpus)
        return self.engine.machine_spec(
            image,
            memory_mib=memory_mib,
            vcpus=vcpus,
            network_card=network_card,
            probe=functools.partial(self._probe_boot, image),
        )

    def fingerprint(self, image: Any, spec: Any) -> dict[str, str]:
        """What a snapshot's children must match: VMM, machine arguments, image (and the CPU under KVM)."""
        return self.engine.fingerprint(image, spec)

    @property
    def session_store(self) -> SnapshotStore:
        """Snapshot store for this process's own snapshots, inside the run directory (RAM)."""
        with self._lock:
            if self._session_store is None:
                self._session_store = SnapshotStore(self.run_dir.path / "snapshots", clean=False)
            return self._session_store

    # -- starting VMs ---------------------------------------------------------
    def boot(
        self,
        image: Any = "default",
        *,
        memory_mib: int = 256,
        vcpus: int = 1,
        timeout: float = BOOT_TIMEOUT_S,
        network: NetworkChoice = None,
    ) -> VM:
        """Cold-boot a root VM from ``image``; returns once its agent answers.

        ``network`` is ``None``/``"none"`` (no network card), ``"outbound"``,
        ``"host"``, a list of host ports the guest may reach, a mapping
        ``{"mode", "allow", "forward"}`` or a NetworkSpec (see
        :func:`~pytest_forkd.engine.network.network_spec`); snapshots of the VM
        and their children keep it.

        Arguments are checked before anything is built or started: InvalidArgument
        (a ConfigError and ValueError) for a bad memory size, vCPU count, timeout or network.
        """
        validate.memory_mib(memory_mib)
        validate.vcpus(vcpus)
        validate.timeout(timeout, "timeout", optional=False)
        net = network_spec(network)
        if isinstance(image, str):
            validate.image_name(image)
            problem = self.engine.unavailable_reason()
            if problem is not None:  # say so now, not after minutes spent building an image it cannot boot
                raise HostNotReady(problem)
            with private.private_umask():  # a first use builds the image: its files are created 0600
                image = self.engine.image(image, progress=self.progress)
        spec = self.machine_spec(image, memory_mib=memory_mib, vcpus=vcpus, network_card=net.has_card)
        started = time.perf_counter()
        vm = self._boot_spec(image, spec, timeout, net)
        self.runtime.recorder.record("boot", (time.perf_counter() - started) * 1000, memory_mib=memory_mib, cold=True)
        return vm

    def _boot_spec(self, image: Any, spec: Any, timeout: float, network: NetworkSpec | None = None) -> VM:
        run_dir = self.run_dir
        memory_mib = getattr(spec, "memory_mib", None)
        if memory_mib:  # a shared RAM file: every page the guest touches needs room there, or QEMU dies of SIGBUS
            space.check_room(run_dir.path, memory_mib * space.MIB, f"a VM with {memory_mib} MiB of RAM")
        name = run_dir.new_name("vm")
        # The RAM file becomes a stored snapshot's memory when the VM is frozen: create it 0600
        # (a VMM may create a missing one 0644 minus the umask; it sizes an existing empty one).
        private.touch(run_dir.path / f"{name}.ram")
        try:
            machine = self.engine.boot(
                spec, image, directory=run_dir.path, name=name, ram_path=run_dir.path / f"{name}.ram", network=network
            )
        except OSError as exc:
            raise _launch_error(name, exc) from exc
        vm = self.adopt(machine, image, ready_timeout=timeout)
        vm._restore_forwards()
        return vm

    def adopt(
        self,
        machine: AnyMachine,
        image: Any,
        *,
        ready_timeout: float,
        origin: Snapshot | None = None,
        memory_base: Snapshot | None = None,
        new_epoch: bool = False,
        wait_ready: bool = True,
    ) -> VM:
        """Wrap a launched machine into a VM once its agent answers; kill it if it never does.

        ``wait_ready=False``: wrap it at once, its agent not asked yet (see :meth:`fork_snapshot`).
        """
        agent = AgentClient(machine.agent_sock)
        if new_epoch:
            agent.new_epoch()
            agent.expect_stale_replies()
        if wait_ready:
            try:
                agent.ping(timeout=ready_timeout)
            except BaseException as exc:
                agent.close()
                machine.kill()
                if isinstance(exc, (ChannelClosed, AgentTimeout)):
                    raise _not_ready_error(machine, exc, ready_timeout) from None
                raise
        vm = VM(machine, agent, factory=self, image=image, origin=origin, memory_base=memory_base)
        vm.max_output = self.max_output
        with self._lock:
            if self._closed:
                vm.close()
                raise VMStartError("the VM factory was closed while a VM was starting")
            self._vms.add(vm)
        return vm

    # -- snapshots ----------------------------------------------------------------
    def export_snapshot(self, snapshot: Snapshot, destination: Path | str) -> Path:
        """Write ``snapshot`` and its image into the archive ``destination`` (see :meth:`Snapshot.export`)."""
        from pytest_forkd.archives.archive import export_snapshot

        return export_snapshot(snapshot, destination).path

    # -- children of snapshots ----------------------------------------------------
    def fork_snapshot(
        self, snapshot: Snapshot, n: int = 1, *, network: NetworkChoice = None, wait_ready: bool = True
    ) -> list[VM]:
        """Start ``n`` copy-on-write children of ``snapshot`` concurrently (pooled ones first).

        Children have the snapshot's network unless ``network`` (same forms as
        :meth:`boot`) gives them another policy (the guest ports the snapshot
        forwarded are forwarded unless it lists its own); the network card itself is a
        device of the snapshot, so a snapshot taken without network cannot have
        children with one, nor the other way round (NetworkError says so).

        ``wait_ready=False`` returns once every child is restored and running
        (its state loaded, its QEMU resumed) without waiting for each guest
        agent's first answer, which under TCG is most of a child's restore
        (translating the agent's code: ~100-200 ms of CPU each). The first
        request to such a child waits in its channel until its agent answers;
        one whose agent does not answer within the usual readiness timeout is
        closed, and its calls raise the error a waiting fork would have.
        """
        started = time.perf_counter()
        plan = self._plan(snapshot, network, n)
        pool = self._pools.get((plan.snapshot.path, plan.snapshot.created)) if network is None else None
        children: list[VM] = []
        while pool is not None and len(children) < n:
            # One child: wait for a restore the pool already runs rather than start a competing one.
            child = pool.take(wait=POOL_WAIT_S if n == 1 else 0.0)
            if child is None:
                break
            child.origin = plan.snapshot
            children.append(child)
        pooled = len(children)
        missing = n - pooled
        try:
            problem = fork_memory_problem(missing) if missing > 1 else None
            if problem is not None:
                raise HostNotReady(f"cannot fork {n} children of snapshot {plan.snapshot.tag!r} at once: {problem}")
            if missing > 1:
                children += self._launch_together(missing, plan, wait_ready=wait_ready)
            elif missing:
                children.append(self._launch_child(plan, wait_ready=wait_ready))
        except BaseException:
            for child in children:  # the pooled ones: a fork hands out all its children or none
                child.close()
            raise
        elapsed = (time.perf_counter() - started) * 1000
        for index, child in enumerate(children):
            extra = {"pooled": index < pooled, **({} if wait_ready else {"agent_awaited": False})}
            child._record_timing("fork", elapsed, backend=plan.snapshot.backend, extra=extra)
        if not wait_ready:  # every child runs now: a thread each waits for its agent's first answer
            for child in children[pooled:]:
                waiter = functools.partial(_await_agent, child, child.agent, BOOT_TIMEOUT_S)
                threading.Thread(target=waiter, name=f"forkd-ready-{child.name}", daemon=True).start()
        return children

    def _image_of(self, snapshot: Snapshot) -> Any:
        """The exact image a snapshot was taken with, even if its name now points to a rebuild."""
        return self.engine.image_for(snapshot.image, snapshot.fingerprint.get("image"))

    def _plan(self, snapshot: Snapshot, network: NetworkChoice, n: int = 1) -> ChildPlan:
        """Check a request for ``n`` children of ``snapshot``, then plan them (nothing has started yet).

        The arguments here; the network, the snapshot's files, the machine the engine names for it and
        the backend in :func:`~pytest_forkd.storage.child_plan.plan_child`.
        """
        self._ensure_open()  # nothing is copied or probed for a factory that starts no more VMs
        validate.count(n, "n")
        validate.memory_mib(snapshot.memory_mib)
        validate.vcpus(snapshot.vcpus)
        return plan_child(
            snapshot,
            network,
            engine=self.engine,
            probe=functools.partial(self._probe_snapshot_image, snapshot.image, snapshot.fingerprint.get("image")),
            backends=self.runtime.backends,
            copies=self._local_copies,
            owner=self,
        )

    def _launch_child(
        self, plan: ChildPlan, timeout: float = BOOT_TIMEOUT_S, *, wait_ready: bool = True, resume: bool = True
    ) -> VM:
        """Start one copy-on-write child of ``plan`` and return it once its agent answers.

        The child's ``restore_phases`` says where the time went (see :class:`RestorePhases`).
        ``wait_ready=False``: return once it is restored, without asking its agent (see
        :meth:`fork_snapshot`), and left paused unless ``resume``.
        """
        phases = RestorePhases()
        with phases.phase("qemu_start_ms"):
            run_dir = self.run_dir
            name = run_dir.new_name("child")
            try:
                machine = self.engine.restore(
                    plan.spec,
                    plan.image,
                    directory=run_dir.path,
                    name=name,
                    memory_file=plan.memory_file,
                    network=plan.network,
                )
                phases.pid = machine.pid
            except OSError as exc:
                raise _launch_error(name, exc) from exc
        try:
            with phases.phase("memory_ms"):
                plan.backend.prepare_child(plan.snapshot, machine, plan.store)
            with phases.phase("device_state_ms"):
                machine.load_device_state(plan.state_file)
                if resume or wait_ready:
                    machine.resume()
        except EngineError as exc:
            error = VMStartError(
                f"restoring a child of snapshot {plan.snapshot.tag!r} failed: {exc}; "
                f"the {self.engine.name} engine said: {machine.stderr_tail() or 'nothing'}"
            )
            machine.kill()
            raise error from exc
        except BaseException:
            machine.kill()
            raise
        with phases.phase("first_reply_ms"):
            child = self.adopt(
                machine,
                plan.image,
                ready_timeout=timeout,
                origin=plan.snapshot,
                memory_base=plan.memory_base,
                new_epoch=True,
                wait_ready=wait_ready,
            )
        with phases.phase("forwards_ms"):
            child._restore_forwards()
        phases.qemu_cpu_ms = process_cpu_ms(machine.pid)
        child.restore_phases = phases
        return child

    def _launch_together(self, n: int, plan: ChildPlan, *, wait_ready: bool = True) -> list[VM]:
        """Restore ``n`` children on parallel threads; they are handed back ready together.

        Each restore is its own QEMU process, so the threads keep every core
        busy. A child that is ready early waits paused (an idle running guest
        costs CPU under TCG that its siblings' restores need); all resume
        together at the end. If any restore fails, every child it started is
        killed and the first error raised: no QEMU is left behind (the caller
        closes the children it had already). ``wait_ready=False``: a child is
        ready once restored; its agent answers after they all resume (see
        :meth:`fork_snapshot`).
        """
        workers = min(n, FORK_THREADS if wait_ready else UNREADY_FORK_THREADS)

        def launch_parked() -> VM:
            if not wait_ready:  # restored and left paused: resumed with its siblings below
                return self._launch_child(plan, wait_ready=False, resume=False)
            child = self._launch_child(plan)
            try:
                park_vm(child)
            except BaseException:
                child.close()
                raise
            return child

        started: list[VM] = []
        errors: list[BaseException] = []
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="forkd-fork") as executor:
            futures = [executor.submit(launch_parked) for _ in range(n)]
            for future in futures:
                try:
                    started.append(future.result())
                except BaseException as exc:  # noqa: BLE001 - re-raised below after cleanup
                    errors.append(exc)
                    for other in futures:
                        other.cancel()  # restores not begun yet need not start
        if not errors:
            for child in started:
                try:
                    unpark_vm(child)
                except BaseException as exc:  # noqa: BLE001 - re-raised below after cleanup
                    errors.append(exc)
                    break
        if errors:
            for child in started:
                child.close()
            raise errors[0]
        return started

    def restore_into(self, vm: VM, snapshot: Snapshot) -> None:
        """Replace ``vm``'s guest with a fresh child of ``snapshot``, keeping the handle."""
        started = time.perf_counter()
        child = self.fork_snapshot(snapshot, 1)[0]
        vm._take_over(child, child.origin or snapshot, child.memory_base)
        vm._record_timing("restore", (time.perf_counter() - started) * 1000, backend=snapshot.backend)

    def pool(
        self,
        snapshot: Snapshot,
        size: int,
        *,
        maximum: int | None = None,
        demand: Callable[[], int | None] | None = None,
        resize: Callable[[VM], int | None] | None = None,
        warm: Callable[[VM], None] | None = None,
    ) -> ChildPool[VM]:
        """Keep at least ``size`` pre-restored children of ``snapshot`` ready for :meth:`fork_snapshot`.

        With ``maximum`` above ``size`` the pool grows with the measured demand
        (see :mod:`pytest_forkd.core.pool`); ``demand`` returns how many more
        children the caller may still take (None: unknown), so a pool never
        restores children nobody will use; with it known, a core left idle
        (the running test sleeps or waits) restores children ahead. Refills
        run on background threads, several at once; ready children wait paused.
        ``warm`` replaces the first command a restored child runs (``true``):
        a caller whose children do something else first warms that path instead.
        """
        plan = self._plan(snapshot, None)
        key = (plan.snapshot.path, plan.snapshot.created)
        with self._lock:
            existing = self._pools.get(key)
            if existing is not None and existing.size == size and existing.sizer.maximum == max(size, maximum or size):
                return existing
        if existing is not None:
            existing.close()

        def launch_warm() -> VM:
            # One guest command through the agent directly (no history, no timing, no
            # generation bump): the child's first real exec then skips ~100 ms of
            # first-time code translation under TCG.
            child = self._launch_child(plan)
            try:
                started = time.perf_counter()
                if warm is None:
                    child.agent.exec(["true"])
                else:
                    warm(child)
                if child.restore_phases is not None:
                    child.restore_phases.lap("warm_ms", started, child.machine.pid)
            except BaseException:
                child.close()
                raise
            return child

        pool: ChildPool[VM] = ChildPool(
            launch_warm,
            size,
            name=plan.snapshot.tag,
            maximum=maximum,
            park=park_vm,
            unpark=unpark_vm,
            usable=vm_usable,
            demand=demand or (lambda: None),
            resize=resize,
            room=memory_room,
            idle=IdleCores(),
        )
        with self._lock:
            self._pools[key] = pool
        return pool

    def drop_pool(self, snapshot: Snapshot) -> None:
        """Kill the unused pre-restored children of ``snapshot``."""
        mapped = self._local_copies.mapped(snapshot)
        with self._lock:
            pool = self._pools.pop((mapped.path, mapped.created), None)
        if pool is not None:
            pool.close()

    def _probe_boot(self, image: Any, spec: Any, timeout: float) -> None:
        """A throwaway boot of ``image``, the ProbeBoot the engine may use to check an accelerator."""
        initrd = getattr(image, "initrd", None)
        if initrd is not None:
            # Enough memory for the image to boot: a guest that panics for lack of it would read as "no KVM".
            spec = spec.with_memory(max(spec.memory_mib, validate.initramfs_floor_mib(initrd)))
        self._boot_spec(image, spec, timeout).close()

    def _probe_snapshot_image(self, name: str, key: str | None, spec: Any, timeout: float) -> None:
        """:meth:`_probe_boot` of the exact image a snapshot was taken with (``name``, ``key``)."""
        self._probe_boot(self.engine.image_for(name, key), spec, timeout)

    # -- ownership ------------------------------------------------------------
    @property
    def vms(self) -> list[VM]:
        with self._lock:
            return list(self._vms)

    def _forget(self, vm: VM) -> None:
        with self._lock:
            self._vms.discard(vm)

    def close_soon(self, vm: VM) -> None:
        """Kill ``vm`` now; reap its QEMU process and remove its files on a background thread.

        A test's teardown then does not wait for the kernel to tear down a
        QEMU process (tens of ms on a busy host); :meth:`close` waits for
        every pending cleanup before it removes the run directory.
        """
        machine = vm.machine
        if not vm.closed and machine.alive():  # not reaped yet, so the pid is still this VMM's
            try:
                os.kill(machine.pid, signal.SIGKILL)
            except OSError:
                pass
        with self._lock:
            if self._closer is None:
                self._closer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forkd-closer")
            closer = self._closer
        try:
            closer.submit(vm.close)
        except RuntimeError:  # the factory is closing: close it here
            vm.close()

    def close(self) -> None:
        """Kill every VM this factory started and remove the run directory."""
        with self._lock:
            closer, self._closer = self._closer, None
        if closer is not None:
            closer.shutdown(wait=True)
        with self._lock:
            self._closed = True
            vms = list(self._vms)
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()
        for vm in vms:
            vm.close()
        with self._lock:
            run_dir, self._run_dir = self._run_dir, None
        if run_dir is not None:
            run_dir.close()
        self._local_copies.close()


def _await_agent(vm: VM, agent: AgentClient, ready_timeout: float) -> None:
    """Wait for the first answer of ``vm``'s agent; a VM whose agent never answers is closed.

    Runs on a thread of its own for a running VM started without waiting for its agent.
    Requests sent meanwhile wait in the channel and are answered in turn; if
    the agent does not answer in time (or the guest dies first), the VM fails
    every call, those already waiting included, with the error a waiting
    start would have raised.
    """
    try:
        agent.ping(timeout=ready_timeout)
    except Exception as exc:  # noqa: BLE001 - the VM's calls raise it
        if vm.closed:
            return
        if isinstance(exc, (ChannelClosed, AgentTimeout)):
            vm._start_error = _not_ready_error(vm.machine, exc, ready_timeout)
        else:
            vm._start_error = VMStartError(f"VM {vm.name}: its guest agent failed before answering: {exc}")
        vm.close()  # requests waiting in its channel fail with that error


def _not_ready_error(machine: AnyMachine, exc: BaseException, ready_timeout: float) -> VMError:
    """What a child whose agent never answered raises: its death, or the timeout with the console's last lines."""
    if isinstance(exc, ChannelClosed):
        return machine.crash_error("guest died before its agent answered")
    tail = machine.console_tail()
    return VMStartError(
        f"VM {machine.name}: the guest agent did not answer within {ready_timeout:.0f} s"
        + (f"\n--- last lines of the guest console ---\n{tail}" if tail else "")
    )


def _launch_error(name: str, exc: OSError) -> VMStartError:
    """A VMStartError for an OSError met while starting a VMM (sockets, logs, the binary itself)."""
    return VMStartError(
        f"cannot start VM {name}: {exc.strerror or exc}"
        + (f" ({exc.filename})" if exc.filename else "")
        + "; check that the run directory (/dev/shm or $FORKD_SHM_DIR) is writable with free space and that "
        "`forkd doctor` passes"
    )


_default_factories: dict[str, VMFactory] = {}
_default_lock = threading.Lock()


def default_factory(accel: str = "auto") -> VMFactory:
    """The process-wide factory (one per accel choice) behind :func:`pytest_forkd.boot`; closed at exit."""
    with _default_lock:
        factory = _default_factories.get(accel)
        if factory is None or factory._closed:
            # Inside a pytest run, the run's runtime (see pytest_forkd.core.defaults)
            factory = _default_factories[accel] = VMFactory(accel=accel, runtime=defaults.runtime())
            atexit.register(factory.close)
        return factory


def close_default_factories() -> None:
    """Close the process-wide factories now (their VMs and run directories) instead of at exit.

    pytest-xdist workers end without running ``atexit`` handlers, so the plugin
    calls this when pytest unconfigures.
    """
    with _default_lock:
        factories = list(_default_factories.values())
        _default_factories.clear()
    for factory in factories:
        factory.close()


def boot(
    image: str = "default", *, memory_mib: int = 256, vcpus: int = 1, accel: str = "auto", network: NetworkChoice = None
) -> VM:
    """Start a root VM from ``image`` and return its handle (close it, or use ``with``).

    ``image`` is a guest image name (``default``, or one built with ``forkd
    image build``) or a container image reference: ``docker://REF``,
    ``oci:DIR[:TAG]``, ``oci-archive:FILE[:TAG]``, ``docker-archive:FILE`` or
    ``dockerfile:PATH`` (pulled or built on first use, then taken from the cache).

    ``network``: None/"none" (the default: no network), "outbound", "host", a
    list of host ports the guest may reach, or ``{"mode", "allow", "forward"}``.
    Bad arguments raise InvalidArgument before any QEMU process starts.
    """
    validate.memory_mib(memory_mib)
    validate.vcpus(vcpus)
    network_spec(network)
    return default_factory(accel).boot(image, memory_mib=memory_mib, vcpus=vcpus, network=network)


def import_snapshot(
    path: Path | str,
    *,
    store: SnapshotStore | Path | str | None = None,
    replace: bool = False,
    name: str | None = None,
    project: Path | str | None = None,
) -> Snapshot:
    """Import the archive ``path`` into ``store`` (default: the persistent store) and return the snapshot.

    Refuses an existing snapshot of the same name unless ``replace``;
    ``name`` imports it under another name. A snapshot that belonged to a
    project (declared in its forkd.yaml) goes into the namespace of
    ``project`` (default: the project around the working directory), as a
    run there looks it up; a shared one (``base``) into the store itself.
    The record is attached to the process-wide factory behind
    :func:`pytest_forkd.boot`, so ``import_snapshot(path).fork()`` starts
    children at once (close them when done). See
    :func:`pytest_forkd.archives.archive.import_archive`.
    """
    from pytest_forkd.archives.archive import import_archive

    info = import_archive(path, store=store, replace=replace, name=name, project=project)
    assert info.snapshot is not None
    return info.snapshot.with_owner(default_factory())
