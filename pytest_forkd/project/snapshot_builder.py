"""Building named snapshots once and keeping them in the persistent store.

A test suite starts from named snapshots: ``base`` (the default image booted
with its agent ready) and whatever forkd.yaml declares. Booting and running
setup commands takes seconds under TCG, forking a snapshot a fraction of one,
so each snapshot is built once and reused by every later run, and by every
xdist worker of this run.

A snapshot is reused only while its files are intact (sizes and, for files
modified since they were stored, checksums: see :mod:`pytest_forkd.storage.integrity`)
and it is still what its recipe describes: its
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
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal

from pytest_forkd import private
from pytest_forkd.core import branching
from pytest_forkd.engine.memory import copy_sparse
from pytest_forkd.engine.network import NetworkSpec
from pytest_forkd.errors import ConfigError, DamagedSnapshot, InvalidArgument, SnapshotError
from pytest_forkd.guest.exec_result import ExecResult
from pytest_forkd.image import Image, ensure_container_image, ensure_image
from pytest_forkd.image.oci.reference import is_reference
from pytest_forkd.image.oci.store import check_policy
from pytest_forkd.paths import validate_tag
from pytest_forkd.project import lifecycle
from pytest_forkd.project.config import BASE_SNAPSHOT, IMAGE_PREFIX, Project, SnapshotRecipe
from pytest_forkd.storage.snapshot import Snapshot
from pytest_forkd.storage.store import SnapshotStore

if TYPE_CHECKING:
    from pytest_forkd.core.factory import VMFactory
    from pytest_forkd.core.vm import VM

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
    recipe_hash: str | None = None
    """What the snapshot was built from (None for a stored snapshot without a recipe)."""


@dataclass(frozen=True)
class _Plan:
    """One snapshot to have in the store: a recipe at a memory size and CPU count."""

    tag: str
    recipe: SnapshotRecipe
    memory_mib: int
    vcpus: int
    parent: _Plan | None
    """The plan of the snapshot this one starts from; None when it boots an image."""
    network: NetworkSpec = NetworkSpec()
    """The network the snapshot is built with and records (its children's network)."""


class SnapshotBuilder:
    """Hands out named snapshots from ``store``, building the missing or outdated ones."""

    def __init__(
        self,
        factory: VMFactory,
        store: SnapshotStore,
        project: Project,
        *,
        progress: Callable[[str], None] | None = None,
        shared_store: SnapshotStore | None = None,
        max_store_bytes: int | None = None,
        pull_policy: str | None = None,
    ) -> None:
        self.factory = factory
        self.pull_policy = pull_policy
        """Container images: ``--forkd-pull``'s policy over forkd.yaml's ``settings.pull`` (None: the setting)."""
        self.store = store
        """The project's own snapshots (its namespace; see :mod:`pytest_forkd.project.lifecycle`)."""
        self.shared_store = shared_store or store
        """The store root: the built-in ``base`` and snapshots marked ``shared: true``."""
        self.project = project
        self.progress = progress or (lambda line: None)
        self.max_store_bytes = max_store_bytes
        """``store_max_size``: after a build, least recently used recipe snapshots are evicted down to it."""
        self.events: list[BuildEvent] = []
        self._ready: dict[str, Snapshot] = {}
        self._hashes: dict[str, str] = {}
        self._images: dict[str, Image] = {}

    def store_for(self, name: str) -> SnapshotStore:
        """Where snapshot ``name`` lives: the shared store root, or the project's namespace."""
        return self.shared_store if self.project.is_shared(name) else self.store

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
            store = next((store for store in (self.store, self.shared_store) if store.exists(name)), None)
            if store is None:
                raise unknown_snapshot_error(name, self.project, self.store)
            ready = store.get(name).with_owner(self.factory)
            lifecycle.mark_used(ready)
            self.progress(f"forkd: using stored snapshot {name!r} (not declared in forkd.yaml, never rebuilt)")
            self.events.append(BuildEvent(name, "cached", 0.0, ready.extra.get("recipe_hash")))
            self._ready[name] = ready
        if memory_mib not in (None, ready.memory_mib):
            raise ConfigError(
                f"snapshot {name!r} has {ready.memory_mib} MiB of memory and no recipe in forkd.yaml to build a "
                f"{memory_mib} MiB variant from; declare it in forkd.yaml or drop memory_mib"
            )
        return ready

    # -- planning ---------------------------------------------------------------
    def _recipe(self, name: str) -> SnapshotRecipe:
        if name == BASE_SNAPSHOT:
            return self.project.snapshots.get(BASE_SNAPSHOT, BASE_RECIPE)
        return self.project.snapshots[name]

    def image(self, name: str) -> Image:
        """Guest image ``name``: declared under ``images:`` (built on demand), else built with ``forkd image build``."""
        image = self._images.get(name)
        if image is None:
            with private.private_umask():  # a first use builds the image: its files are created 0600
                declared = self.project.images.get(name)
                if declared is not None:
                    from pytest_forkd.project.images import ensure_project_image

                    image = ensure_project_image(declared, progress=self.progress, origin=self.project.origin)
                elif is_reference(name):
                    image = self._container_image(name)
                else:
                    image = ensure_image(name, progress=self.progress)
            self._images[name] = image
        return image

    def _container_image(self, reference: str) -> Image:
        """The guest image of a container reference in ``from:``, pulled per the run's pull policy."""
        policy = check_policy(self.pull_policy or self.project.settings.get("pull", "missing"), "settings.pull")

        def report(line: str) -> None:
            self.progress(f"forkd: image {reference!r}: {line}")

        return ensure_container_image(
            reference,
            policy=policy,
            insecure_registries=self.project.settings.get("insecure_registries", ()),
            progress=report,
        )

    def _plan(self, name: str, memory_mib: int | None, vcpus: int | None = None, card: bool | None = None) -> _Plan:
        """``card``: the network card a child of this snapshot needs (None: whatever the recipe gives).

        A snapshot with a network card can only be built from a parent with
        one (the device sets must match), so a recipe that declares a network
        over a parent without one is built from a variant of that parent
        booted with a card, tagged ``<parent>-net`` (and isolated: mode
        ``host`` with no allowed ports), and the reverse from ``<parent>-nonet``.
        """
        recipe = self._recipe(name)
        declared_card = recipe.network.has_card if recipe.network is not None else None
        if recipe.source_image is not None:
            parent = None
            natural_memory, natural_vcpus = recipe.memory_mib or DEFAULT_MEMORY_MIB, recipe.vcpus or DEFAULT_VCPUS
            natural_network = recipe.network or NetworkSpec()
        else:
            natural_parent = self._plan(recipe.source, recipe.memory_mib, recipe.vcpus, declared_card)
            natural_memory, natural_vcpus = natural_parent.memory_mib, natural_parent.vcpus
            natural_network = recipe.network or natural_parent.network
            parent = natural_parent
        memory = memory_mib or natural_memory
        cpus = vcpus or natural_vcpus
        network = natural_network
        tag = name
        if memory != natural_memory:
            tag += f"-m{memory}"
        if cpus != natural_vcpus:
            tag += f"-c{cpus}"
        if card is not None and card != natural_network.has_card:
            network = NetworkSpec("host") if card else NetworkSpec()
            tag += "-net" if card else "-nonet"
        if parent is not None and (
            (memory, cpus) != (natural_memory, natural_vcpus) or network.has_card != natural_network.has_card
        ):
            parent = self._plan(recipe.source, memory, cpus, network.has_card)
        try:
            validate_tag(tag)
        except ConfigError:
            raise ConfigError(
                f"snapshot {name!r} at {memory} MiB and {cpus} vCPU would be stored as {tag!r}, which is not a "
                "valid snapshot name (too long?); use a shorter snapshot name"
            ) from None
        return _Plan(tag, recipe, memory, cpus, parent, network)

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
            "files": [[copy.guest_path, _file_digest(copy.host_path, copy.exclude)] for copy in recipe.files],
            "setup": list(recipe.setup),
        }
        if plan.network.has_card:
            description["network"] = plan.network.to_json()
        if plan.parent is not None:
            description["parent"] = self.recipe_hash(plan.parent)
        else:
            image_name = recipe.source_image or DEFAULT_IMAGE
            image = self.image(image_name)
            try:
                spec = self.factory.machine_spec(
                    image, memory_mib=plan.memory_mib, vcpus=plan.vcpus, network_card=plan.network.has_card
                )
            except InvalidArgument as exc:
                if self.project.path is None or recipe is BASE_RECIPE:
                    raise
                raise ConfigError(f"{self.project.origin}: snapshots.{recipe.name}.memory_mib: {exc}") from None
            description["machine"] = dict(self.factory.fingerprint(image, spec))
            declared = self.project.images.get(image_name)
            if declared is not None and declared.setup:
                description["image_setup"] = list(declared.setup)
        if recipe.workdir is not None:  # only when set: existing snapshots keep their hashes
            description["workdir"] = recipe.workdir
        if recipe.main_process is not None:
            description["main_process"] = dict(recipe.main_process.describe())
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
        store = self.store_for(plan.recipe.name)
        action: Literal["built", "cached"] = "cached"
        snapshot = self._cached(plan.tag, wanted, store)
        if snapshot is None:
            self._refuse_building_in_a_read_only_store(plan.tag, wanted, store)
            self._explain_rebuilding_an_import(plan.tag, wanted, store)
            with store.lock(plan.tag):
                snapshot = self._cached(plan.tag, wanted, store)  # built by another process while we waited
                if snapshot is None:
                    snapshot = self._build(plan, parent, wanted, store)
                    action = "built"
        if action == "cached":
            self.progress(f"forkd: using cached snapshot {plan.tag!r}")
        lifecycle.mark_used(snapshot)
        self.events.append(BuildEvent(plan.tag, action, time.perf_counter() - started, wanted))
        snapshot = snapshot.with_owner(self.factory)
        self._ready[plan.tag] = snapshot
        if action == "built" and self.max_store_bytes is not None:
            self._evict()
        return snapshot

    def _refuse_building_in_a_read_only_store(self, tag: str, wanted: str, store: SnapshotStore) -> None:
        """A shared store mounted read-only is only restored from: say what is missing instead of failing a write."""
        problem = store.read_only_reason()
        if problem is None:
            return
        try:
            stored = store.get(tag)
            state = f"built from recipe {stored.extra.get('recipe_hash') or '<none>'} ({stored.status}) in"
        except SnapshotError:
            state = "missing from"
        raise SnapshotError(
            f"snapshot {tag!r} (recipe {wanted}) is {state} the read-only snapshot store {store.root} "
            f"({problem}), and nothing is built there; build it where the store is writable "
            f"(`forkd snapshots build {tag}`, or `forkd snapshots import` an exported archive), or point "
            "--forkd-store at a writable directory"
        )

    def _explain_rebuilding_an_import(self, tag: str, wanted: str, store: SnapshotStore) -> None:
        """An imported snapshot that does not fit this run is rebuilt: say why (the import was meant to spare it)."""
        try:
            stored = store.get(tag)
        except SnapshotError:
            return
        imported = stored.extra.get("imported")
        if isinstance(imported, dict):
            self.progress(
                f"forkd: snapshot {tag!r} imported from {imported.get('archive')} was built from recipe "
                f"{stored.extra.get('recipe_hash')}, this run needs {wanted} (another QEMU, accelerator, image or "
                "forkd.yaml recipe?); rebuilding it here"
            )

    def _evict(self) -> None:
        """Apply ``store_max_size``: evict least recently used recipe snapshots this run does not use."""
        assert self.max_store_bytes is not None
        keep = [snapshot.path for snapshot in self._ready.values()]
        for removal in lifecycle.evict(self.shared_store, self.max_store_bytes, keep=keep):
            where = f" of project {removal.project}" if removal.project else ""
            self.progress(f"forkd: evicted snapshot {removal.tag!r}{where}: {removal.reason}")

    def _cached(self, tag: str, wanted: str, store: SnapshotStore | None = None) -> Snapshot | None:
        """The stored snapshot ``tag`` if it is ready and was built from the wanted recipe."""
        store = store or self.store
        try:
            snapshot = store.get(tag)
        except SnapshotError:  # missing or unreadable: (re)build it
            return None
        if snapshot.status != "ready" or snapshot.extra.get("recipe_hash") != wanted:
            return None
        try:
            store.check_restorable(snapshot)
        except DamagedSnapshot as exc:
            self.progress(f"forkd: stored snapshot {tag!r} is damaged ({'; '.join(exc.problems)}); rebuilding it")
            return None
        return snapshot

    def _build(
        self, plan: _Plan, parent: Snapshot | None, recipe_hash: str, store: SnapshotStore | None = None
    ) -> Snapshot:
        """Build the snapshot; its VMs' timings are kept apart from the tests' (see ``Recorder.building``)."""
        recipe = plan.recipe
        started_from = f"image {recipe.source_image!r}" if parent is None else repr(parent.tag)
        commands = len(recipe.setup)
        self.progress(
            f"forkd: building snapshot {plan.tag!r} from {started_from} "
            f"({commands} setup command{'' if commands == 1 else 's'})..."
        )
        staging_tag = f"build-{recipe_hash[:16]}"
        staging = self.factory.session_store
        clock = _Clock(self.progress, plan.tag)
        with self.factory.runtime.recorder.building(plan.tag):
            staged, env = self._assemble(plan, parent, staging_tag, staging, clock)
        try:
            extra = {"recipe_hash": recipe_hash, "recipe": recipe.name, "env": env, "setup": list(recipe.setup)}
            snapshot = publish_copy(staged, store or self.store, plan.tag, extra=extra)
        finally:
            staging.remove(staging_tag)
        self.progress(f"forkd: built snapshot {plan.tag!r} in {clock.elapsed():.1f} s")
        return snapshot

    def _assemble(
        self, plan: _Plan, parent: Snapshot | None, staging_tag: str, staging: SnapshotStore, clock: _Clock
    ) -> tuple[Snapshot, dict[str, str]]:
        """Boot or fork the snapshot's first VM, run its recipe, stage the result; return it and its env."""
        recipe = plan.recipe
        if parent is None:
            image_name = recipe.source_image or DEFAULT_IMAGE
            image = self.image(image_name)
            with clock.step(f"booting image {image_name!r}"):
                vm = self.factory.boot(image, memory_mib=plan.memory_mib, vcpus=plan.vcpus, network=plan.network)
        else:
            with clock.step(f"restoring {parent.tag!r}"):
                vm = self.factory.fork_snapshot(parent, 1, network=plan.network)[0]  # inherits env and workdir
        try:
            if parent is None and recipe.source_image is not None and recipe.source_image in self.project.images:
                self._image_setup(vm, plan, recipe.source_image, clock)
            vm.env = {**vm.env, **recipe.env}
            env = dict(vm.env)
            self._provision(vm, plan, env, clock)
            if recipe.main_process is not None:  # last, so that it runs in every VM of the snapshot
                with clock.step("starting the main process"):
                    recipe.main_process.start(vm, self.progress)
            with clock.step("saving the snapshot"):
                if parent is None:
                    staged = branching.freeze(vm, staging_tag, store=staging, keep_running=False, replace=True)
                else:
                    staged = branching.branch(vm, staging_tag, backend="full", store=staging)
        finally:
            vm.close()
        return staged, env

    def _provision(self, vm: VM, plan: _Plan, env: Mapping[str, str], clock: _Clock) -> None:
        """Copy the recipe's files in and run its setup commands; stop at the first failure."""
        recipe = plan.recipe
        if recipe.workdir is not None:
            vm.exec(["mkdir", "-p", recipe.workdir], check=True)
            vm.cwd = recipe.workdir
        for copy in recipe.files:  # a file or a whole tree; parents are made
            with clock.step(f"copying {copy.host_path} to {copy.guest_path}"):
                vm.copy_in(copy.host_path, copy.guest_path, exclude=copy.exclude)
        for index, command in enumerate(recipe.setup):
            with clock.step(f"setup[{index + 1}/{len(recipe.setup)}] $ {command}"):
                result = vm.exec(command, env=dict(env))
            if result.exit_code != 0:
                raise SnapshotError(_setup_failure(plan.tag, index, command, result))

    def _image_setup(self, vm: VM, plan: _Plan, image_name: str, clock: _Clock) -> None:
        """Run the setup commands of an image declared under ``images:`` in a VM just booted from it."""
        commands = self.project.images[image_name].setup
        for index, command in enumerate(commands):
            with clock.step(f"images.{image_name}.setup[{index + 1}/{len(commands)}] $ {command}"):
                result = vm.exec(command)
            if result.exit_code != 0:
                raise SnapshotError(
                    _setup_failure(plan.tag, index, command, result, field=f"images.{image_name}.setup")
                )


#: A step still running after this many seconds is reported again, then every as many seconds more.
STILL_RUNNING_S: Final = 15.0


class _Clock:
    """Progress of one snapshot build: each step as it starts, with the time since the build started.

    A step that runs long (``apt-get install`` under TCG) is reported again
    every :data:`STILL_RUNNING_S` seconds, so a build never goes quiet for
    long. The reminder comes from a helper thread while the step runs on the
    caller's thread; the caller is blocked in the step meanwhile, so the two
    never write at the same time.
    """

    def __init__(self, progress: Callable[[str], None], tag: str) -> None:
        self.progress = progress
        self.tag = tag
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    @contextmanager
    def step(self, what: str) -> Iterator[None]:
        self.progress(f"forkd: snapshot {self.tag!r} +{self.elapsed():.1f} s: {what}")
        done = threading.Event()
        step_started = time.perf_counter()

        def remind() -> None:
            while not done.wait(STILL_RUNNING_S):
                self.progress(
                    f"forkd: snapshot {self.tag!r} +{self.elapsed():.1f} s: still running "
                    f"({time.perf_counter() - step_started:.0f} s): {what}"
                )

        reminder = threading.Thread(target=remind, name=f"forkd-progress-{self.tag}", daemon=True)
        reminder.start()
        try:
            yield
        finally:
            done.set()
            reminder.join()


def recipe_key(builder: SnapshotBuilder, names: list[str]) -> str:
    """A cache key for snapshots ``names``: QEMU version, accelerator, and a hash of their recipe hashes.

    It changes exactly when one of them would be rebuilt (or could not be
    restored: another QEMU), so CI can cache exported archives under it.
    Nothing is built but the guest image, when it is missing.
    """
    hashes = {}
    for name in names:
        if name != BASE_SNAPSHOT and name not in builder.project.snapshots:
            raise unknown_snapshot_error(name, builder.project, builder.store)
        hashes[name] = builder.recipe_hash(builder._plan(name, None))
    image = ensure_image(DEFAULT_IMAGE, progress=builder.progress)
    spec = builder.factory.machine_spec(image, memory_mib=DEFAULT_MEMORY_MIB, vcpus=DEFAULT_VCPUS)
    digest = hashlib.sha256(json.dumps(hashes, sort_keys=True).encode()).hexdigest()[:16]
    return f"forkd-qemu{spec.qemu.version}-{spec.accel}-{digest}"


def check_images(project: Project, names: Iterable[str]) -> None:
    """Fail (ConfigError naming the forkd.yaml field) when a snapshot of ``names`` starts from a missing image.

    Checked when the run starts, so a typo in ``from: image:NAME`` is one
    usage error before any test, not the same error in every test's setup
    after seconds of booting. Only the ``from`` chains of ``names`` (the
    snapshots this run uses) are checked: an image missing on this machine
    matters only to the suites that boot it.
    """
    from pytest_forkd.image.catalog import image_names

    built: list[str] | None = None
    for name in names:
        seen: set[str] = set()
        current = name
        while current not in seen and (current == BASE_SNAPSHOT or current in project.snapshots):
            seen.add(current)
            recipe = project.snapshots.get(current, BASE_RECIPE)
            image = recipe.source_image
            if image is None:
                current = recipe.source
                continue
            if image != DEFAULT_IMAGE and image not in project.images and not is_reference(image):
                built = image_names() if built is None else built
                if image not in built:
                    declared = ", ".join(sorted(project.images)) or "none"
                    raise ConfigError(
                        f"{project.origin}: snapshots.{recipe.name}.from: no image named {image!r} "
                        f"(built on this machine: {', '.join(built) or 'none'}; declared under images: {declared}); "
                        f"fix the name, declare it under `images:` in {project.origin}, build it with "
                        f"`forkd image build --name {image}`, or start from a snapshot (from: base)"
                    )
            break


def unknown_snapshot_error(name: str, project: Project, store: SnapshotStore) -> ConfigError:
    """The error for a snapshot name that is neither built in, declared, nor in the store."""
    stored = sorted(snapshot.tag for snapshot in store.list() if snapshot.tag not in project.snapshot_names())
    where = f"in {project.path}" if project.path else "in forkd.yaml (there is none in the rootdir)"
    return ConfigError(
        f"unknown snapshot {name!r}: declared snapshots: {', '.join(project.snapshot_names())}; "
        f"other snapshots in {store.root}: {', '.join(stored) or 'none'}. "
        f"Declare {name!r} under `snapshots:` {where}, or pick one of those with --forkd-snapshot"
    )


def _setup_failure(tag: str, index: int, command: str, result: ExecResult, field: str | None = None) -> str:
    output = (result.stderr or result.stdout).strip()
    if len(output) > 2000:
        output = "..." + output[-2000:]
    return (
        f"building snapshot {tag!r}: {field or 'setup'}[{index}] `{command}` exited with status {result.exit_code}"
        + (f":\n{output}" if output else " and printed nothing")
        + "\nFix the command in forkd.yaml ("
        + (field or f"snapshots.{tag}.setup")
        + ") and run again; "
        "nothing was stored"
    )


def _file_digest(path: Path, exclude: tuple[str, ...] = ()) -> str:
    """sha256 of what a copy of ``path`` holds: contents and modes (a directory: of every entry, by name)."""
    digest = hashlib.sha256()
    if path.is_dir():
        from pytest_forkd.guest.tarstream import Excludes

        excludes = Excludes(exclude)
        digest.update(f"exclude={sorted(exclude)}".encode())
        for folder, dirs, files in os.walk(path):
            base = Path(folder)
            dirs[:] = sorted(name for name in dirs if not excludes.excluded(str((base / name).relative_to(path))))
            for name in sorted(files) + [f"{name}/" for name in dirs]:
                entry = base / name.rstrip("/")
                relative = str(entry.relative_to(path))
                if not name.endswith("/") and excludes.excluded(relative):
                    continue
                info = entry.lstat()
                digest.update(f"\0{relative}\0{info.st_mode:o}\0".encode())
                if entry.is_symlink():
                    digest.update(os.readlink(entry).encode())
                elif entry.is_file():
                    digest.update(_file_digest(entry).encode())
        return digest.hexdigest()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    digest.update(f"mode={path.stat().st_mode & 0o7777:o}".encode())
    return digest.hexdigest()


def publish_copy(
    snapshot: Snapshot, store: SnapshotStore, tag: str, *, extra: Mapping[str, object] | None = None
) -> Snapshot:
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
