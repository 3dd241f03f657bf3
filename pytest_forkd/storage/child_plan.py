"""The plan of a snapshot's children: what they are restored from and as, checked before any VMM starts.

Why a module of its own: forking reads top-down. The factory asks storage one
question, "what do children of this snapshot start from?", and gets back a
frozen :class:`ChildPlan`: the ready record (a local copy when the store
cannot be mapped), the store holding it, the backend that prepares each
child, the flat memory file children map copy-on-write and the snapshot that
file belongs to, the device state, and the machine the engine runs them on
(the exact image, the spec, the network). Every check that refuses a fork (a
bad network choice, a write that failed, damaged files, a machine that does
not match, a missing base, an unknown backend) runs here, once per fork; the
factory then asks the engine for machines, the backend to prepare them, and
wraps them as VMs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pytest_forkd.engine.base import AnyEngine, ImageLike, ProbeBoot, SpecLike
from pytest_forkd.engine.network import NetworkChoice, NetworkSpec, child_network
from pytest_forkd.storage.backend import BackendRegistry, StorageBackend
from pytest_forkd.storage.local_copy import LocalCopies
from pytest_forkd.storage.snapshot import Snapshot, SnapshotOwner
from pytest_forkd.storage.store import SnapshotStore, resolve_base


@dataclass(frozen=True)
class ChildPlan:
    """What children of one snapshot are restored from and as (see :func:`plan_child`)."""

    snapshot: Snapshot
    """The ready record children restore (a local copy when the original cannot be mapped), attached to the
    owner that starts them: each child's ``origin``."""
    store: SnapshotStore
    """The store holding ``snapshot`` (where its base is looked up)."""
    backend: StorageBackend
    """The backend that took ``snapshot``: it prepares each child's memory (``prepare_child``)."""
    memory_file: Path
    """The flat memory file every child maps copy-on-write."""
    memory_base: Snapshot
    """The snapshot ``memory_file`` belongs to (``snapshot`` itself, or the base of a diff)."""
    state_file: Path
    """The device state each child loads."""
    image: ImageLike
    """The exact image the snapshot was taken with (the engine's)."""
    spec: SpecLike
    """The machine every child runs (the engine's)."""
    network: NetworkSpec
    """The children's network (the snapshot's, or the policy the fork asked for)."""


def plan_child(
    snapshot: Snapshot,
    network: NetworkChoice = None,
    *,
    engine: AnyEngine,
    probe: ProbeBoot | None,
    backends: BackendRegistry,
    copies: LocalCopies,
    owner: SnapshotOwner,
) -> ChildPlan:
    """Check that children of ``snapshot`` can be restored by ``engine`` with ``network``, and plan them.

    In this order: the network (InvalidArgument, NetworkError: see
    :func:`~pytest_forkd.engine.network.child_network`); the snapshot's files,
    once a snapshot still being written is (DamagedSnapshot, its own files or
    its base's); a local copy, made once per ``copies``, when the VMM cannot
    map it where it is; the machine the engine names for it (``probe`` may boot
    a throwaway machine to choose an accelerator) against the recorded one
    (IncompatibleSnapshot); its backend and base (BackendError).
    """
    children_network = child_network(snapshot.tag, snapshot.network, network)
    if not snapshot.is_ready:
        snapshot = snapshot.wait_ready()
    store = SnapshotStore(snapshot.path.parent, clean=False)
    store.check_restorable(snapshot)
    mappable = copies.mappable(snapshot)
    if mappable.path.parent != snapshot.path.parent:  # restored from a local copy: its own store
        store = SnapshotStore(mappable.path.parent, clean=False)
    image = engine.image_for(mappable.image, mappable.fingerprint.get("image"))  # even if the name was rebuilt
    spec = engine.machine_spec(
        image,
        memory_mib=mappable.memory_mib,
        vcpus=mappable.vcpus,
        network_card=children_network.has_card,
        probe=probe,
    )
    store.check_compatible(mappable, engine.fingerprint(image, spec))
    backend = backends.get(mappable.backend)
    memory_file = backend.child_memory(mappable, store)
    mappable = mappable.with_owner(owner)
    return ChildPlan(
        snapshot=mappable,
        store=store,
        backend=backend,
        memory_file=memory_file,
        memory_base=mappable if mappable.memory_path == memory_file else resolve_base(mappable, store),
        state_file=mappable.state_path,
        image=image,
        spec=spec,
        network=children_network,
    )
