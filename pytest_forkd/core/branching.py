"""Taking snapshots of VMs: BRANCH (the VM keeps running) and FREEZE (it becomes a base).

The storage backend decides how memory is captured; this module does what
every backend shares: choosing the tag and the backend, publishing the
snapshot atomically, timing the pause, and making sure a failed branch never
leaves the source VM frozen (it is resumed and must answer a ping before the
error propagates).
"""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path
from typing import Any

from pytest_forkd.core.handles import VMHandle
from pytest_forkd.engine import space
from pytest_forkd.engine.memory import copy_sparse
from pytest_forkd.errors import SnapshotError
from pytest_forkd.paths import validate_tag
from pytest_forkd.storage.backend import MEMORY_FILE, STATE_FILE, CaptureFinish, CaptureSource
from pytest_forkd.storage.snapshot import Snapshot
from pytest_forkd.storage.store import SnapshotStore

_tag_counter = itertools.count(1)


def _auto_tag(vm: VMHandle) -> str:
    return f"{vm.name}-b{next(_tag_counter)}-{int(time.time() * 1000) % 100000}"


def _record(vm: VMHandle, tag: str, path: Path, backend: str, **fields: Any) -> Snapshot:
    factory = vm.factory
    # The VM's exec defaults travel with the snapshot, so its children (in any process) get them.
    fields["extra"] = {**vm.defaults(), **(fields.get("extra") or {})}
    return Snapshot(
        tag=tag,
        path=path,
        backend=backend,
        memory_mib=vm.memory_mib,
        vcpus=vm.machine.spec.vcpus,
        image=vm.image.name,
        fingerprint=factory.fingerprint(vm.image, vm.machine.spec),
        state_file=STATE_FILE,
        parent=vm.origin.tag if vm.origin else None,
        network=vm._network_record(),
        machine=factory.engine.machine_record(vm.machine.spec),
        **fields,
    )


def branch(
    vm: VMHandle, tag: str | None = None, *, backend: str | None = None, store: SnapshotStore | None = None
) -> Snapshot:
    """Snapshot the running ``vm`` with a short pause; the VM keeps running."""
    factory = vm.factory
    store = store or factory.session_store
    tag = validate_tag(tag) if tag is not None else _auto_tag(vm)  # "" is an error, not "pick one"
    chosen = factory.runtime.backends.get(backend or vm.default_backend or factory.default_backend)
    capabilities = factory.engine.capabilities()
    chosen.require_available(capabilities)
    started = time.perf_counter()
    with store.begin(tag) as pending:
        try:
            source = CaptureSource(
                vm.machine, vm.memory_base, store, vm.image, lambda: vm.agent.ping(timeout=30), capabilities
            )
            capture = chosen.capture(source, pending.dir)
        except BaseException as exc:
            vm._recover_after_failed_pause()
            if isinstance(exc, OSError) and space.is_no_space(exc):
                raise SnapshotError(
                    space.no_space_text(exc, store.root, f"branching VM {vm.name} into snapshot {tag!r}")
                    + "; the VM was resumed"
                ) from exc
            if isinstance(exc, OSError):  # a file the backend wrote or read: say which, and what to do
                raise SnapshotError(
                    f"branching VM {vm.name} with the {chosen.id} backend failed: {exc.strerror or exc}"
                    + (f" ({exc.filename})" if exc.filename else "")
                    + f"; the VM was resumed. Check free space and permissions of {store.root} and the run "
                    "directory, or try another backend"
                ) from exc
            raise
        snapshot = pending.publish(
            _record(
                vm,
                tag,
                pending.dir,
                chosen.id,
                base=capture.base,
                memory_file=capture.memory_file,
                diff_file=capture.diff_file,
                pause_ms=round(capture.pause_ms, 3),
                total_ms=round((time.perf_counter() - started) * 1000, 3),
                bytes_written=capture.bytes_written,
                dirty_bytes=capture.dirty_bytes,
                status=capture.status,
                extra=capture.extra,
            )
        )
    total_ms = (time.perf_counter() - started) * 1000
    if capture.remapped and snapshot.memory_path is not None:  # re-based: the VM maps the snapshot's memory now
        vm.machine.ram_path = snapshot.memory_path
        vm.memory_base = snapshot.with_owner(factory)
    if capture.finish is not None:
        _finish_in_background(store, snapshot, capture.finish, started)
    chosen.published(snapshot, store)
    fields = {"backend": chosen.id, "dirty_bytes": capture.dirty_bytes}
    vm._record_timing("branch_pause", capture.pause_ms, **fields)
    vm._record_timing("branch_total", total_ms, **fields)
    return snapshot.with_owner(factory)


def _finish_in_background(store: SnapshotStore, snapshot: Snapshot, finish: CaptureFinish, started: float) -> None:
    def run() -> None:
        try:
            memory_tmp, state_tmp, fields = finish(snapshot, store)
            fields["total_ms"] = round((time.perf_counter() - started) * 1000, 3)
            store.complete(snapshot.tag, memory_tmp, MEMORY_FILE, state_file_tmp_path=state_tmp, **fields)
        except BaseException as exc:  # noqa: BLE001 - recorded in the snapshot for its waiters
            store.fail(snapshot.tag, f"{type(exc).__name__}: {exc}")

    threading.Thread(target=run, name=f"materialise-{snapshot.tag}", daemon=True).start()


def freeze(
    vm: VMHandle, tag: str, *, store: SnapshotStore, keep_running: bool = True, replace: bool = False
) -> Snapshot:
    """Turn a booted root VM into a base snapshot: stop, save devices, keep its RAM file.

    The cheapest snapshot there is (a few ms of pause, no memory copy when the
    store is on the same filesystem as the run directory). The RAM file then
    belongs to the snapshot and is never written again, so a VM that must go
    on continues as a copy-on-write child of its own snapshot.
    """
    validate_tag(tag)
    machine = vm.machine
    if not machine.owns_ram:
        raise SnapshotError(
            f"VM {vm.name} is a child of snapshot {vm.origin.tag if vm.origin else '?'}; only a booted root VM "
            f"can be frozen. Use vm.branch({tag!r}, backend='full') instead"
        )
    started = time.perf_counter()
    with store.begin(tag, replace=replace) as pending:
        destination = pending.dir / MEMORY_FILE
        moved = False
        try:
            machine.stop()
            machine.save_device_state(pending.dir / STATE_FILE)
            pause_ms = (time.perf_counter() - started) * 1000
            try:
                machine.ram_path.rename(destination)
                moved, written = True, 0
            except OSError:  # another filesystem: copy, keeping holes
                written = copy_sparse(machine.ram_path, destination)
            snapshot = pending.publish(
                _record(
                    vm,
                    tag,
                    pending.dir,
                    "full",
                    memory_file=MEMORY_FILE,
                    pause_ms=round(pause_ms, 3),
                    total_ms=round((time.perf_counter() - started) * 1000, 3),
                    bytes_written=written,
                    extra={"frozen": True},
                )
            )
        except BaseException as exc:
            # Every failure (a full store, a signal) leaves the VM as it was: its RAM file back
            # in place, running and answering; the half-written snapshot goes with `pending`.
            if moved:
                destination.rename(machine.ram_path)
            vm._recover_after_failed_pause()
            if isinstance(exc, OSError) and space.is_no_space(exc):
                raise SnapshotError(
                    space.no_space_text(exc, store.root, f"freezing VM {vm.name} into snapshot {tag!r}")
                    + "; the VM was resumed"
                ) from exc
            if isinstance(exc, SnapshotError) and isinstance(exc.__cause__, OSError):
                raise SnapshotError(f"{exc}; the VM was resumed") from exc.__cause__
            raise
        # The agent client first, as VM.close does: its reply reader polls the channel, and a machine
        # that closes the channel under it leaves the poll on a descriptor number a new VM may reuse.
        vm.agent.close()
        machine.kill()  # its RAM file belongs to the snapshot now
    snapshot = snapshot.with_owner(vm.factory)
    vm._record_timing("freeze", pause_ms, backend="full")
    if keep_running:
        vm.restore(snapshot)
    else:
        vm.close()
    return snapshot
