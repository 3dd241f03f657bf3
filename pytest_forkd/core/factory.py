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
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pytest_forkd import private
from pytest_forkd.core import validate
from pytest_forkd.core.pool import (
    ChildPool,
    fork_memory_problem,
    memory_room,
    park_vm,
    unpark_vm,
    vm_usable,
)
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
from pytest_forkd.engine.network import NetworkChoice, NetworkSpec, check_card, network_from_record, network_spec
from pytest_forkd.engine.rundir import RunDir
from pytest_forkd.errors import ConfigError, HostNotReady, VMStartError
from pytest_forkd.guest.client import DEFAULT_MAX_OUTPUT, AgentClient, AgentTimeout, ChannelClosed
from pytest_forkd.latency import timings
from pytest_forkd.storage import local_copy
from pytest_forkd.storage.backend import registry, resolve_base
from pytest_forkd.storage.snapshot import Snapshot
from pytest_forkd.storage.store import SnapshotStore

BOOT_TIMEOUT_S = 90.0
#: Longest a single fork waits for a child its pool is restoring before restoring one itself.
POOL_WAIT_S = 30.0
#: Restores one fork(n) runs at once: each is a QEMU process, one per core plus one that keeps
#: the cores busy while another waits on a socket. Under TCG a restore is CPU-bound; four per
#: core cost 7% more CPU per child than two in back-to-back runs of fork(20) (more TCG buffers
#: and page faults in flight at once), for no more throughput.
FORK_THREADS = max(2, (os.cpu_count() or 1) + 1)


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

    def to_dict(self) -> dict[str, Any]:
        fields = dataclasses.asdict(self)
        fields.pop("_cpu_mark")
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
    ) -> None:
        self.engine: AnyEngine = make_engine(engine, accel=accel)
        """What starts this factory's machines: an engine name (``qemu``, ``fake``...), an instance,
        or None for the default, QEMU."""
        self.requested_accel = accel
        self.max_output = max_output
        """The ``max_output`` of every VM this factory starts (bytes kept per output stream of an exec)."""
        self.progress = progress
        self.default_backend = default_backend
        self._pools: dict[Path, ChildPool[VM]] = {}
        self._session_store: SnapshotStore | None = None
        self._local_copies: dict[tuple[Path, str], Snapshot | None] = {}
        """Per snapshot (directory, creation time): its copy in the run directory, or None when mapped in place."""
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
                if self._closed:  # a directory made now would outlive the factory
                    raise VMStartError("this VM factory is closed: it starts no more VMs; make a new VMFactory")
                try:
                    self._run_dir = RunDir()
                except OSError as exc:
                    raise HostNotReady(
                        f"cannot create a run directory for VM files under {exc.filename or 'the shm root'}: "
                        f"{exc.strerror or exc}; check that /dev/shm (or $FORKD_SHM_DIR) exists, is writable "
                        "and has free space"
                    ) from exc
            return self._run_dir

    def accel_verdict(self, image: Any) -> Any:
        """The accelerator the engine chose (KVM or TCG for QEMU), probing it once with a throwaway VM."""
        return self._accelerated_engine().accel_verdict(image, self._probe(image))

    def machine_spec(self, image: Any, *, memory_mib: int, vcpus: int, network_card: bool = False) -> Any:
        """The machine for ``image`` at this size; checks the size first (no VM has started yet)."""
        validate.memory_mib(memory_mib, initrd=getattr(image, "initrd", None), image=image.name)
        validate.vcpus(vcpus)
        return self.engine.machine_spec(
            image, memory_mib=memory_mib, vcpus=vcpus, network_card=network_card, probe=self._probe(image)
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
            validate.validate_tag(image, "image name")
            with private.private_umask():  # a first use builds the image: its files are created 0600
                image = self.engine.image(image, progress=self.progress)
        spec = self.machine_spec(image, memory_mib=memory_mib, vcpus=vcpus, network_card=net.has_card)
        started = time.perf_counter()
        vm = self._boot_spec(image, spec, timeout, net)
        timings.record("boot", (time.perf_counter() - started) * 1000, memory_mib=memory_mib, cold=True)
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
    ) -> VM:
        """Wrap a launched machine into a VM once its agent answers; kill it if it never does."""
        agent = AgentClient(machine.agent_sock)
        if new_epoch:
            agent.new_epoch()
        try:
            agent.ping(timeout=ready_timeout)
        except ChannelClosed:
            error = machine.crash_error("guest died before its agent answered")
            agent.close()
            machine.kill()
            raise error from None
        except AgentTimeout:
            tail = machine.console_tail()
            agent.close()
            machine.kill()
            raise VMStartError(
                f"VM {machine.name}: the guest agent did not answer within {ready_timeout:.0f} s"
                + (f"\n--- last lines of the guest console ---\n{tail}" if tail else "")
            ) from None
        except BaseException:
            agent.close()
            machine.kill()
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
        from pytest_forkd.core.archive import export_snapshot

        return export_snapshot(snapshot, destination).path

    # -- children of snapshots ----------------------------------------------------
    def _child_plan(self, snapshot: Snapshot) -> tuple[Snapshot, Any, Any, SnapshotStore]:
        if not snapshot.is_ready:
            snapshot = snapshot.wait_ready()
        store = SnapshotStore(snapshot.path.parent, clean=False)
        store.check_restorable(snapshot)
        mappable = self._mappable(snapshot)
        if mappable.path.parent != snapshot.path.parent:  # restored from a local copy: its own store
            store = SnapshotStore(mappable.path.parent, clean=False)
        snapshot = mappable
        image = self._image_of(snapshot)
        spec = self.machine_spec(
            image,
            memory_mib=snapshot.memory_mib,
            vcpus=snapshot.vcpus,
            network_card=network_from_record(snapshot.network).has_card,
        )
        store.check_compatible(snapshot, self.fingerprint(image, spec))
        return snapshot, image, spec, store

    def _mappable(self, snapshot: Snapshot) -> Snapshot:
        """``snapshot``, or once per factory a copy in the run directory when QEMU cannot map it where it is.

        Snapshots in a read-only shared store are restored from such a copy;
        nothing is written into the store (see :mod:`pytest_forkd.storage.local_copy`).
        """
        with self._lock:
            key = (snapshot.path, snapshot.created)
            if key not in self._local_copies:
                unmappable = local_copy.unmappable_reason(snapshot) is not None
                self._local_copies[key] = local_copy.local_copy(snapshot, self.session_store) if unmappable else None
            copied = self._local_copies[key]
            return snapshot if copied is None else copied.with_owner(self)

    def _image_of(self, snapshot: Snapshot) -> Any:
        """The exact image a snapshot was taken with, even if its name now points to a rebuild."""
        return self.engine.image_for(snapshot.image, snapshot.fingerprint.get("image"))

    def _launch_child(
        self,
        snapshot: Snapshot,
        image: Any,
        spec: Any,
        store: SnapshotStore,
        timeout: float = BOOT_TIMEOUT_S,
        network: NetworkSpec | None = None,
    ) -> VM:
        """Start one copy-on-write child of ``snapshot`` and return it once its agent answers.

        The child's ``restore_phases`` says where the time went (see :class:`RestorePhases`).
        """
        phases = RestorePhases()
        mark = time.perf_counter()
        backend = registry().get(snapshot.backend)
        memory_file = backend.child_memory(snapshot, store)
        memory_base = snapshot if snapshot.memory_path == memory_file else resolve_base(snapshot, store)
        run_dir = self.run_dir
        name = run_dir.new_name("child")
        try:
            machine = self.engine.restore(
                spec,
                image,
                directory=run_dir.path,
                name=name,
                memory_file=memory_file,
                network=network or network_from_record(snapshot.network),
            )
        except OSError as exc:
            raise _launch_error(name, exc) from exc
        mark = phases.lap("qemu_start_ms", mark, machine.pid)
        try:
            backend.prepare_child(snapshot, machine, store)
            mark = phases.lap("memory_ms", mark, machine.pid)
            machine.load_device_state(snapshot.state_path)
            machine.resume()
            mark = phases.lap("device_state_ms", mark, machine.pid)
        except EngineError as exc:
            error = VMStartError(
                f"restoring a child of snapshot {snapshot.tag!r} failed: {exc}; "
                f"the {self.engine.name} engine said: {machine.stderr_tail() or 'nothing'}"
            )
            machine.kill()
            raise error from exc
        except BaseException:
            machine.kill()
            raise
        child = self.adopt(
            machine,
            image,
            ready_timeout=timeout,
            origin=snapshot.with_owner(self),
            memory_base=memory_base,
            new_epoch=True,
        )
        mark = phases.lap("first_reply_ms", mark, machine.pid)
        child._restore_forwards()
        phases.lap("forwards_ms", mark, machine.pid)
        phases.qemu_cpu_ms = process_cpu_ms(machine.pid)
        child.restore_phases = phases
        return child

    def fork_snapshot(self, snapshot: Snapshot, n: int = 1, *, network: NetworkChoice = None) -> list[VM]:
        """Start ``n`` copy-on-write children of ``snapshot`` concurrently (pooled ones first).

        Children have the snapshot's network unless ``network`` (same forms as
        :meth:`boot`) gives them another policy (the guest ports the snapshot
        forwarded are forwarded unless it lists its own); the network card itself is a
        device of the snapshot, so a snapshot taken without network cannot have
        children with one, nor the other way round (NetworkError says so).
        """
        validate.count(n, "n")
        override = None if network is None else network_spec(network)
        started = time.perf_counter()
        snapshot, image, spec, store = self._child_plan(snapshot)
        if override is not None:
            recorded = network_from_record(snapshot.network)
            check_card(snapshot.tag, recorded, override)
            if not override.forward:  # the guest's servers are still there: keep forwarding them
                override = override.with_forward(recorded.forward)
        children: list[VM] = []
        pool = self._pools.get(snapshot.path) if override is None else None
        while pool is not None and len(children) < n:
            # One child: wait for a restore the pool already runs rather than start a competing one.
            child = pool.take(wait=POOL_WAIT_S if n == 1 else 0.0)
            if child is None:
                break
            child.origin = snapshot.with_owner(self)
            children.append(child)
        pooled = len(children)
        missing = n - len(children)
        if missing == 1:
            try:
                children.append(self._launch_child(snapshot, image, spec, store, BOOT_TIMEOUT_S, override))
            except BaseException:
                for child in children:
                    child.close()
                raise
        elif missing:
            problem = fork_memory_problem(missing)
            if problem is not None:
                for child in children:
                    child.close()
                raise HostNotReady(f"cannot fork {n} children of snapshot {snapshot.tag!r} at once: {problem}")
            children += self._launch_together(missing, snapshot, image, spec, store, override, pooled=children)
        elapsed = (time.perf_counter() - started) * 1000
        for index, child in enumerate(children):
            child._record_timing("fork", elapsed, backend=snapshot.backend, extra={"pooled": index < pooled})
        return children

    def _launch_together(
        self,
        n: int,
        snapshot: Snapshot,
        image: Any,
        spec: Any,
        store: SnapshotStore,
        network: NetworkSpec | None,
        *,
        pooled: list[VM],
    ) -> list[VM]:
        """Restore ``n`` children on parallel threads; they are handed back ready together.

        Each restore is its own QEMU process, so the threads keep every core
        busy. A child that is ready early waits paused (an idle running guest
        costs CPU under TCG that its siblings' restores need); all resume
        together at the end. If any restore fails, every child of the call
        (``pooled`` ones included) is killed and the first error raised: no
        QEMU is left behind.
        """
        workers = min(n, FORK_THREADS)

        def launch_parked() -> VM:
            child = self._launch_child(snapshot, image, spec, store, BOOT_TIMEOUT_S, network)
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
            for child in [*pooled, *started]:
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
    ) -> ChildPool[VM]:
        """Keep at least ``size`` pre-restored children of ``snapshot`` ready for :meth:`fork_snapshot`.

        With ``maximum`` above ``size`` the pool grows with the measured demand
        (see :mod:`pytest_forkd.core.pool`); ``demand`` returns how many more
        children the caller may still take (None: unknown), so a pool never
        restores children nobody will use. Refills run on background threads,
        several at once; ready children wait paused.
        """
        snapshot, image, spec, store = self._child_plan(snapshot)
        with self._lock:
            existing = self._pools.get(snapshot.path)
            if existing is not None and existing.size == size and existing.sizer.maximum == max(size, maximum or size):
                return existing
        if existing is not None:
            existing.close()

        def launch_warm() -> VM:
            # One guest command through the agent directly (no history, no timing, no
            # generation bump): the child's first real exec then skips ~100 ms of
            # first-time code translation under TCG.
            child = self._launch_child(snapshot, image, spec, store)
            try:
                started = time.perf_counter()
                child.agent.exec(["true"])
                if child.restore_phases is not None:
                    child.restore_phases.lap("warm_ms", started, child.machine.pid)
            except BaseException:
                child.close()
                raise
            return child

        pool: ChildPool[VM] = ChildPool(
            launch_warm,
            size,
            name=snapshot.tag,
            maximum=maximum,
            park=park_vm,
            unpark=unpark_vm,
            usable=vm_usable,
            demand=demand or (lambda: None),
            resize=resize,
            room=memory_room,
        )
        with self._lock:
            self._pools[snapshot.path] = pool
        return pool

    def drop_pool(self, snapshot: Snapshot) -> None:
        """Kill the unused pre-restored children of ``snapshot``."""
        with self._lock:
            pool = self._pools.pop(snapshot.path, None)
        if pool is not None:
            pool.close()

    def _probe(self, image: Any) -> Callable[[Any, float], None]:
        """A throwaway boot of ``image`` the engine may use to check an accelerator (see ProbeBoot)."""

        def probe(spec: Any, timeout: float) -> None:
            initrd = getattr(image, "initrd", None)
            if initrd is not None:
                # Enough memory for the image to boot: a guest that panics for lack of it would read as "no KVM".
                spec = spec.with_memory(max(spec.memory_mib, validate.initramfs_floor_mib(initrd)))
            self._boot_spec(image, spec, timeout).close()

        return probe

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
            factory = _default_factories[accel] = VMFactory(accel=accel)
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
    :func:`pytest_forkd.core.archive.import_archive`.
    """
    from pytest_forkd.core.archive import import_archive

    info = import_archive(path, store=store, replace=replace, name=name, project=project)
    assert info.snapshot is not None
    return info.snapshot.with_owner(default_factory())
