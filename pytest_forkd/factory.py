"""The VM factory: starts VMs and owns them.

Every VM of a process is started by a factory and registered with it; closing
the factory kills them all and removes the run directory. This is what keeps
a failed test, an exception or Ctrl-C from leaking QEMU processes or /dev/shm
files (a ``kill -9`` is covered by PDEATHSIG and the stale-run cleanup).
"""

from __future__ import annotations

import atexit
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from . import timings
from .backend import registry, resolve_base
from .engine.accel import PROBE_TIMEOUT_S, AccelVerdict, resolve_accel, validate_accel
from .engine.host import Qemu, find_qemu
from .engine.qemu import Machine, MachineSpec
from .engine.qmp import QMPError
from .engine.rundir import RunDir
from .errors import VMStartError
from .guest.client import AgentClient, AgentTimeout, ChannelClosed
from .image import Image, ensure_image, load_image
from .image.catalog import image_at, image_directory, is_published
from .pool import ChildPool
from .snapshot import Snapshot
from .store import SnapshotStore
from .vm import VM

BOOT_TIMEOUT_S = 90.0


class VMFactory:
    """Starts and owns VMs; ``close()`` kills every VM it started."""

    def __init__(self, *, accel: str = "auto", progress: Callable[[str], None] | None = None,
                 default_backend: str = "diff") -> None:
        self.requested_accel = validate_accel(accel)
        self.progress = progress
        self.default_backend = default_backend
        self._pools: dict[Path, ChildPool] = {}
        self._session_store: SnapshotStore | None = None
        self._lock = threading.RLock()
        self._vms: set[VM] = set()
        self._run_dir: RunDir | None = None
        self._qemu: Qemu | None = None
        self._verdict: AccelVerdict | None = None
        self._closed = False

    # -- host facts, resolved lazily and once -------------------------------
    @property
    def qemu(self) -> Qemu:
        if self._qemu is None:
            self._qemu = find_qemu()
        return self._qemu

    @property
    def run_dir(self) -> RunDir:
        with self._lock:
            if self._run_dir is None:
                self._run_dir = RunDir()
            return self._run_dir

    def accel_verdict(self, image: Image) -> AccelVerdict:
        if self._verdict is None:
            self._verdict = resolve_accel(self.requested_accel, self.qemu, lambda: self._probe_kvm(image))
        return self._verdict

    def machine_spec(self, image: Image, *, memory_mib: int, vcpus: int) -> MachineSpec:
        return MachineSpec(qemu=self.qemu, accel=self.accel_verdict(image).accel, memory_mib=memory_mib,
                           vcpus=vcpus, kernel_args=tuple(image.kernel_args))

    def fingerprint(self, image: Image, spec: MachineSpec) -> dict[str, str]:
        """What a snapshot's children must match: QEMU, machine arguments, image."""
        return {"qemu": spec.qemu.version, "machine": spec.fingerprint(), "image": image.key}

    @property
    def session_store(self) -> SnapshotStore:
        """Snapshot store for this process's own snapshots, inside the run directory (RAM)."""
        with self._lock:
            if self._session_store is None:
                self._session_store = SnapshotStore(self.run_dir.path / "snapshots")
            return self._session_store

    # -- starting VMs ---------------------------------------------------------
    def boot(self, image: str | Image = "default", *, memory_mib: int = 256, vcpus: int = 1,
             timeout: float = BOOT_TIMEOUT_S) -> VM:
        """Cold-boot a root VM from ``image``; returns once its agent answers."""
        if isinstance(image, str):
            image = ensure_image(image, progress=self.progress)
        spec = self.machine_spec(image, memory_mib=memory_mib, vcpus=vcpus)
        started = time.perf_counter()
        vm = self._boot_spec(image, spec, timeout)
        timings.record("boot", (time.perf_counter() - started) * 1000, memory_mib=memory_mib, cold=True)
        return vm

    def _boot_spec(self, image: Image, spec: MachineSpec, timeout: float) -> VM:
        run_dir = self.run_dir
        name = run_dir.new_name("vm")
        machine = Machine.launch(spec, run_dir.path, name, kernel=image.kernel, initrd=image.initrd,
                                 ram_path=run_dir.path / f"{name}.ram", share=True, owns_ram=True)
        return self.adopt(machine, image, ready_timeout=timeout)

    def adopt(self, machine: Machine, image: Image, *, ready_timeout: float, origin: Snapshot | None = None,
              memory_base: Snapshot | None = None, new_epoch: bool = False) -> VM:
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
        with self._lock:
            if self._closed:
                vm.close()
                raise VMStartError("the VM factory was closed while a VM was starting")
            self._vms.add(vm)
        return vm

    # -- children of snapshots ----------------------------------------------------
    def _child_plan(self, snapshot: Snapshot) -> tuple[Snapshot, Image, MachineSpec, SnapshotStore]:
        if not snapshot.is_ready:
            snapshot = snapshot.wait_ready()
        store = SnapshotStore(snapshot.path.parent)
        image = self._image_of(snapshot)
        spec = self.machine_spec(image, memory_mib=snapshot.memory_mib, vcpus=snapshot.vcpus)
        store.check_compatible(snapshot, self.fingerprint(image, spec))
        return snapshot, image, spec, store

    @staticmethod
    def _image_of(snapshot: Snapshot) -> Image:
        """The exact image a snapshot was taken with, even if its name now points to a rebuild."""
        key = snapshot.fingerprint.get("image")
        if key and is_published(key):
            return image_at(snapshot.image, image_directory(key))
        return load_image(snapshot.image)  # the fingerprint check then explains a mismatch

    def _launch_child(self, snapshot: Snapshot, image: Image, spec: MachineSpec, store: SnapshotStore,
                      timeout: float = BOOT_TIMEOUT_S) -> VM:
        """Start one copy-on-write child of ``snapshot`` and return it once its agent answers."""
        backend = registry().get(snapshot.backend)
        memory_file = backend.child_memory(snapshot, store)
        memory_base = snapshot if snapshot.memory_path == memory_file else resolve_base(snapshot, store)
        run_dir = self.run_dir
        machine = Machine.launch(spec, run_dir.path, run_dir.new_name("child"), kernel=image.stub_kernel,
                                 initrd=image.stub_initrd, ram_path=memory_file, share=False, owns_ram=False,
                                 incoming=True)
        try:
            backend.prepare_child(snapshot, machine, store)
            machine.load_device_state(snapshot.state_path)
            machine.resume()
        except QMPError as exc:
            error = VMStartError(f"restoring a child of snapshot {snapshot.tag!r} failed: {exc}; "
                                 f"QEMU said: {machine.stderr_tail() or 'nothing'}")
            machine.kill()
            raise error from exc
        except BaseException:
            machine.kill()
            raise
        return self.adopt(machine, image, ready_timeout=timeout, origin=snapshot.with_owner(self),
                          memory_base=memory_base, new_epoch=True)

    def fork_snapshot(self, snapshot: Snapshot, n: int = 1) -> list[VM]:
        """Start ``n`` copy-on-write children of ``snapshot`` concurrently (pooled ones first)."""
        if n < 1:
            raise ValueError(f"fork needs n >= 1, got {n}")
        started = time.perf_counter()
        snapshot, image, spec, store = self._child_plan(snapshot)
        children: list[VM] = []
        pool = self._pools.get(snapshot.path)
        while pool is not None and len(children) < n:
            child = pool.take()
            if child is None:
                break
            child.origin = snapshot.with_owner(self)
            children.append(child)
        pooled = len(children)
        missing = n - len(children)
        if missing:
            with ThreadPoolExecutor(max_workers=min(missing, 8), thread_name_prefix="forkd-fork") as executor:
                futures = [executor.submit(self._launch_child, snapshot, image, spec, store) for _ in range(missing)]
                errors = []
                for future in futures:
                    try:
                        children.append(future.result())
                    except BaseException as exc:  # noqa: BLE001 - re-raised below after cleanup
                        errors.append(exc)
            if errors:
                for child in children:
                    child.close()
                raise errors[0]
        elapsed = (time.perf_counter() - started) * 1000
        for index, child in enumerate(children):
            child.record_timing("fork", elapsed, backend=snapshot.backend, extra={"pooled": index < pooled})
        return children

    def restore_into(self, vm: VM, snapshot: Snapshot) -> None:
        """Replace ``vm``'s guest with a fresh child of ``snapshot``, keeping the handle."""
        started = time.perf_counter()
        child = self.fork_snapshot(snapshot, 1)[0]
        vm.take_over(child, child.origin, child.memory_base)
        vm.record_timing("restore", (time.perf_counter() - started) * 1000, backend=snapshot.backend)

    def pool(self, snapshot: Snapshot, size: int) -> ChildPool:
        """Keep ``size`` pre-restored children of ``snapshot`` ready for :meth:`fork_snapshot`."""
        snapshot, image, spec, store = self._child_plan(snapshot)
        with self._lock:
            existing = self._pools.get(snapshot.path)
            if existing is not None and existing.size == size:
                return existing
        if existing is not None:
            existing.close()
        def launch_warm() -> VM:
            # One guest command through the agent directly (no history, no timing, no
            # generation bump): the child's first real exec then skips ~100 ms of
            # first-time code translation under TCG.
            child = self._launch_child(snapshot, image, spec, store)
            child.agent.exec(["true"])
            return child

        pool = ChildPool(launch_warm, size, name=snapshot.tag)
        with self._lock:
            self._pools[snapshot.path] = pool
        return pool

    def drop_pool(self, snapshot: Snapshot) -> None:
        """Kill the unused pre-restored children of ``snapshot``."""
        with self._lock:
            pool = self._pools.pop(snapshot.path, None)
        if pool is not None:
            pool.close()

    def _probe_kvm(self, image: Image) -> None:
        spec = MachineSpec(qemu=self.qemu, accel="kvm", memory_mib=128, vcpus=1,
                           kernel_args=tuple(image.kernel_args))
        self._boot_spec(image, spec, PROBE_TIMEOUT_S).close()

    # -- ownership ------------------------------------------------------------
    @property
    def vms(self) -> list[VM]:
        with self._lock:
            return list(self._vms)

    def _forget(self, vm: VM) -> None:
        with self._lock:
            self._vms.discard(vm)

    def close(self) -> None:
        """Kill every VM this factory started and remove the run directory."""
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


def boot(image: str = "default", *, memory_mib: int = 256, vcpus: int = 1, accel: str = "auto") -> VM:
    """Start a root VM from ``image`` and return its handle (close it, or use ``with``)."""
    return default_factory(accel).boot(image, memory_mib=memory_mib, vcpus=vcpus)
