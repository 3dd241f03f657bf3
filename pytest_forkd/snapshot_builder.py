"""Building named snapshots once and keeping them in the persistent store.

A test suite starts from named snapshots: ``base`` (the default image booted
with its agent ready) and whatever forkd.yaml declares. Booting and running
setup commands takes seconds under TCG, forking a snapshot a fraction of one,
so each snapshot is built once and reused by every later run, and by every
xdist worker of this run.

A snapshot is reused only while it is still what its recipe describes: its
record carries a hash (``extra["recipe_hash"]``) of the recipe, the contents
of the files it copies in, the guest image, the machine it ran on and,
through the parent's hash, its whole ``from`` chain. Any change there
rebuilds it, replacing the old one (``replace=True``: processes still using
the old files keep them). Builds run under the store's per-tag lock, so
concurrent workers build each snapshot once and the others wait, then reuse.

A snapshot is assembled in the run directory on /dev/shm (a freeze there is a
rename, a branch a memory copy at RAM speed), then copied into the
persistent store in one piece.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal

from . import branching
from .engine.memory import copy_sparse
from .errors import ConfigError, SnapshotError
from .exec_result import ExecResult
from .image import ensure_image
from .paths import validate_tag
from .project import BASE_SNAPSHOT, IMAGE_PREFIX, Project, SnapshotRecipe
from .snapshot import Snapshot
from .store import SnapshotStore

if TYPE_CHECKING:
    from .factory import VMFactory
    from .vm import VM

#: Bump when the way snapshots are built changes, so cached ones are rebuilt.
BUILDER_VERSION: Final = 1
DEFAULT_IMAGE: Final = "default"
DEFAULT_MEMORY_MIB: Final = 256
DEFAULT_VCPUS: Final = 1

#: The recipe behind ``base``: the default image, booted, with nothing added.
BASE_RECIPE: Final = SnapshotRecipe(name=BASE_SNAPSHOT, source=IMAGE_PREFIX + DEFAULT_IMAGE)


@dataclass(frozen=True)
class BuildEvent:
    """What happened when a snapshot was asked for: ``built`` now, or ``cached`` (reused)."""

    snapshot: str
    action: Literal["built", "cached"]
    seconds: float


@dataclass(frozen=True)
class _Plan:
    """One snapshot to have in the store: a recipe at a memory size and CPU count."""

    tag: str
    recipe: SnapshotRecipe
    memory_mib: int
    vcpus: int
    parent: _Plan | None
    """The plan of the snapshot this one starts from; None when it boots an image."""


class SnapshotBuilder:
    """Hands out named snapshots from ``store``, building the missing or outdated ones."""

    def __init__(self, factory: VMFactory, store: SnapshotStore, project: Project, *,
                 progress: Callable[[str], None] | None = None) -> None:
        self.factory = factory
        self.store = store
        self.project = project
        self.progress = progress or (lambda line: None)
        self.events: list[BuildEvent] = []
        self._ready: dict[str, Snapshot] = {}
        self._hashes: dict[str, str] = {}

    def get(self, name: str, *, memory_mib: int | None = None) -> Snapshot:
        """Snapshot ``name`` (at ``memory_mib`` when given), built first if missing or outdated.

        A snapshot asked for at another memory size than its recipe's is a
        variant named ``<name>-m<MiB>``, built from the same recipe (and from
        the same variant of its ``from`` chain). A name forkd.yaml does not
        declare may still name a snapshot already in the store (a kept failed
        test's VM, say): it is used as it is.
        """
        if name != BASE_SNAPSHOT and name not in self.project.snapshots:
            return self._stored(name, memory_mib)
        return self._ensure(self._plan(name, memory_mib))

    def _stored(self, name: str, memory_mib: int | None) -> Snapshot:
        ready = self._ready.get(name)
        if ready is None:
            if not self.store.exists(name):
                raise unknown_snapshot_error(name, self.project, self.store)
            ready = self.store.get(name).with_owner(self.factory)
            self.progress(f"forkd: using stored snapshot {name!r} (not declared in forkd.yaml, never rebuilt)")
            self.events.append(BuildEvent(name, "cached", 0.0))
            self._ready[name] = ready
        if memory_mib not in (None, ready.memory_mib):
            raise ConfigError(
                f"snapshot {name!r} has {ready.memory_mib} MiB of memory and no recipe in forkd.yaml to build a "
                f"{memory_mib} MiB variant from; declare it in forkd.yaml or drop memory_mib"
            )
        return ready

    # -- planning ---------------------------------------------------------------
    def _recipe(self, name: str) -> SnapshotRecipe:
        return BASE_RECIPE if name == BASE_SNAPSHOT else self.project.snapshots[name]

    def _plan(self, name: str, memory_mib: int | None, vcpus: int | None = None) -> _Plan:
        recipe = self._recipe(name)
        if recipe.source_image is not None:
            parent = None
            natural_memory, natural_vcpus = recipe.memory_mib or DEFAULT_MEMORY_MIB, recipe.vcpus or DEFAULT_VCPUS
        else:
            natural_parent = self._plan(recipe.source, recipe.memory_mib, recipe.vcpus)
            natural_memory, natural_vcpus = natural_parent.memory_mib, natural_parent.vcpus
            parent = natural_parent
        memory = memory_mib or natural_memory
        cpus = vcpus or natural_vcpus
        tag = name
        if memory != natural_memory:
            tag += f"-m{memory}"
        if cpus != natural_vcpus:
            tag += f"-c{cpus}"
        if parent is not None and (memory, cpus) != (natural_memory, natural_vcpus):
            parent = self._plan(recipe.source, memory, cpus)
        try:
            validate_tag(tag)
        except ConfigError:
            raise ConfigError(
                f"snapshot {name!r} at {memory} MiB and {cpus} vCPU would be stored as {tag!r}, which is not a "
                "valid snapshot name (too long?); use a shorter snapshot name"
            ) from None
        return _Plan(tag, recipe, memory, cpus, parent)

    def recipe_hash(self, plan: _Plan) -> str:
        """Hash of everything the snapshot's contents depend on (see the module docstring)."""
        cached = self._hashes.get(plan.tag)
        if cached is not None:
            return cached
        recipe = plan.recipe
        description: dict[str, object] = {
            "builder": BUILDER_VERSION,
            "memory_mib": plan.memory_mib,
            "vcpus": plan.vcpus,
            "env": dict(sorted(recipe.env.items())),
            "files": [[copy.guest_path, _file_digest(copy.host_path)] for copy in recipe.files],
            "setup": list(recipe.setup),
        }
        if plan.parent is not None:
            description["parent"] = self.recipe_hash(plan.parent)
        else:
            image = ensure_image(recipe.source_image or DEFAULT_IMAGE, progress=self.progress)
            spec = self.factory.machine_spec(image, memory_mib=plan.memory_mib, vcpus=plan.vcpus)
            description["machine"] = dict(self.factory.fingerprint(image, spec))
        digest = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:24]
        self._hashes[plan.tag] = digest
        return digest

    # -- building ---------------------------------------------------------------
    def _ensure(self, plan: _Plan) -> Snapshot:
        ready = self._ready.get(plan.tag)
        if ready is not None:
            return ready
        parent = self._ensure(plan.parent) if plan.parent is not None else None
        started = time.perf_counter()
        wanted = self.recipe_hash(plan)
        action: Literal["built", "cached"] = "cached"
        snapshot = self._cached(plan.tag, wanted)
        if snapshot is None:
            with self.store.lock(plan.tag):
                snapshot = self._cached(plan.tag, wanted)  # built by another process while we waited
                if snapshot is None:
                    snapshot = self._build(plan, parent, wanted)
                    action = "built"
        if action == "cached":
            self.progress(f"forkd: using cached snapshot {plan.tag!r}")
        self.events.append(BuildEvent(plan.tag, action, time.perf_counter() - started))
        snapshot = snapshot.with_owner(self.factory)
        self._ready[plan.tag] = snapshot
        return snapshot

    def _cached(self, tag: str, wanted: str) -> Snapshot | None:
        """The stored snapshot ``tag`` if it is ready and was built from the wanted recipe."""
        try:
            snapshot = self.store.get(tag)
        except SnapshotError:  # missing or unreadable: (re)build it
            return None
        if snapshot.status != "ready" or snapshot.extra.get("recipe_hash") != wanted:
            return None
        return snapshot

    def _build(self, plan: _Plan, parent: Snapshot | None, recipe_hash: str) -> Snapshot:
        recipe = plan.recipe
        started_from = f"image {recipe.source_image!r}" if parent is None else repr(parent.tag)
        commands = len(recipe.setup)
        self.progress(
            f"forkd: building snapshot {plan.tag!r} from {started_from} "
            f"({commands} setup command{'' if commands == 1 else 's'})..."
        )
        env = {**(parent.extra.get("env", {}) if parent is not None else {}), **recipe.env}
        staging_tag = f"build-{recipe_hash[:16]}"
        staging = self.factory.session_store
        if parent is None:
            vm = self.factory.boot(recipe.source_image or DEFAULT_IMAGE, memory_mib=plan.memory_mib, vcpus=plan.vcpus)
        else:
            vm = self.factory.fork_snapshot(parent, 1)[0]
        try:
            self._provision(vm, plan, env)
            if parent is None:
                staged = branching.freeze(vm, staging_tag, store=staging, keep_running=False, replace=True)
            else:
                staged = branching.branch(vm, staging_tag, backend="full", store=staging)
        finally:
            vm.close()
        try:
            extra = {"recipe_hash": recipe_hash, "recipe": recipe.name, "env": env, "setup": list(recipe.setup)}
            return publish_copy(staged, self.store, plan.tag, extra=extra)
        finally:
            staging.remove(staging_tag)

    def _provision(self, vm: VM, plan: _Plan, env: Mapping[str, str]) -> None:
        """Copy the recipe's files in and run its setup commands; stop at the first failure."""
        recipe = plan.recipe
        if recipe.files:
            folders = sorted({str(Path(copy.guest_path).parent) for copy in recipe.files})
            vm.exec(["mkdir", "-p", *folders], check=True)
        for copy in recipe.files:
            vm.write_file(copy.guest_path, copy.host_path.read_bytes(), mode=copy.host_path.stat().st_mode & 0o7777)
        for index, command in enumerate(recipe.setup):
            result = vm.exec(command, env=dict(env))
            if result.exit_code != 0:
                raise SnapshotError(_setup_failure(plan.tag, index, command, result))


def unknown_snapshot_error(name: str, project: Project, store: SnapshotStore) -> ConfigError:
    """The error for a snapshot name that is neither built in, declared, nor in the store."""
    stored = sorted(snapshot.tag for snapshot in store.list() if snapshot.tag not in project.snapshot_names())
    where = f"in {project.path}" if project.path else "in forkd.yaml (there is none in the rootdir)"
    return ConfigError(
        f"unknown snapshot {name!r}: declared snapshots: {', '.join(project.snapshot_names())}; "
        f"other snapshots in {store.root}: {', '.join(stored) or 'none'}. "
        f"Declare {name!r} under `snapshots:` {where}, or pick one of those with --forkd-snapshot"
    )


def _setup_failure(tag: str, index: int, command: str, result: ExecResult) -> str:
    output = (result.stderr or result.stdout).strip()
    if len(output) > 2000:
        output = "..." + output[-2000:]
    return (
        f"building snapshot {tag!r}: setup[{index}] `{command}` exited with status {result.exit_code}"
        + (f":\n{output}" if output else " and printed nothing")
        + "\nFix the command in forkd.yaml (snapshots." + tag + ".setup) and run again; nothing was stored"
    )


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    digest.update(f"mode={path.stat().st_mode & 0o7777:o}".encode())
    return digest.hexdigest()


def publish_copy(snapshot: Snapshot, store: SnapshotStore, tag: str, *,
                 extra: Mapping[str, object] | None = None) -> Snapshot:
    """Copy the flat snapshot ``snapshot`` into ``store`` as ``tag``, replacing an older ``tag``.

    Used to move snapshots assembled on /dev/shm into the persistent store,
    which usually is on another filesystem. Holes in the memory file stay
    holes. The copy appears atomically; readers of a replaced snapshot keep
    its files.
    """
    if snapshot.memory_file is None or snapshot.diff_file is not None:
        raise SnapshotError(
            f"snapshot {snapshot.tag!r} is a diff against {snapshot.base!r}; only a flat snapshot (backend full, "
            "or a frozen root VM) can be copied into another store"
        )
    with store.begin(tag, replace=True) as pending:
        for name in (snapshot.state_file, snapshot.memory_file):
            copy_sparse(snapshot.path / name, pending.dir / name)
        record = snapshot.replace(tag=tag, path=pending.dir, owner=None, extra={**snapshot.extra, **(extra or {})})
        return pending.publish(record)

