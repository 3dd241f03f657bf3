"""The forkd session: what the ``forkd`` fixture is, one per pytest process.

It owns the VM factory (every QEMU process of the run), hands out named
snapshots (built once, see :mod:`pytest_forkd.project.snapshot_builder`), keeps the
warm *parent* VM and knows the snapshot that stands for the parent's current
state, which is what every test's child is forked from.

Everything is lazy: nothing boots and no accelerator is probed until a test
asks for a VM, and a suite that never touches ``forkd_parent`` never starts a
parent at all (its children come straight from the selected snapshot).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pytest_forkd.core.runtime import Runtime
from pytest_forkd.errors import ImageError, VMError
from pytest_forkd.latency.timings import Recorder
from pytest_forkd.project.config import Project
from pytest_forkd.project.settings import Settings, VMChoice
from pytest_forkd.storage.snapshot import Snapshot
from pytest_forkd.storage.store import SnapshotStore

if TYPE_CHECKING:
    from pytest_forkd.core.factory import VMFactory
    from pytest_forkd.core.vm import VM
    from pytest_forkd.project.snapshot_builder import BuildEvent, SnapshotBuilder


def open_stores(settings: Settings, project: Project) -> tuple[SnapshotStore, SnapshotStore]:
    """The snapshot store root of a run and the project's namespace in it (the root itself without forkd.yaml)."""
    from pytest_forkd.project.lifecycle import project_store

    root = SnapshotStore(settings.store) if settings.store else SnapshotStore.persistent()
    return root, (project_store(root, project.root) if project.root is not None else root)


#: Longest the pool prefill waits before the first test (children still missing are restored on demand).
PREFILL_TIMEOUT_S = 600.0


class ForkdSession:
    """The per-process forkd state behind the ``forkd`` fixture.

    ``snapshot`` is the parent's current state as a snapshot: the selected
    snapshot while the parent is untouched, else a branch of the parent taken
    the first time a child is needed after it changed (``VM.generation``).
    """

    def __init__(
        self,
        settings: Settings,
        project: Project,
        *,
        runtime: Runtime | None = None,
        recorder: Recorder | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        """``runtime``: the backends and recorder to run with (a fresh one by default); ``recorder`` alone
        gives a fresh runtime that records there (the form of earlier versions)."""
        if runtime is not None and recorder is not None and runtime.recorder is not recorder:
            raise ValueError("pass either runtime= or recorder= (the runtime's recorder), not both")
        if settings.image is not None:
            project, name = project.with_image_snapshot(settings.image)
            settings = dataclasses.replace(settings, snapshot=name)
        self.settings = settings
        self.project = project
        self.runtime = runtime if runtime is not None else Runtime(recorder=recorder)
        """The storage backends and the timing recorder of this session's VMs (handed to its factory)."""
        self.timings = self.runtime.recorder
        """Every timing sample of this session's VMs (``self.runtime.recorder``)."""
        self.progress = progress or (lambda line: None)
        self.shared_store, self.store = open_stores(settings, project)
        """The store root (the built-in ``base``, ``shared: true`` snapshots) and the project's namespace of it."""
        self._factory: VMFactory | None = None
        self._builder: SnapshotBuilder | None = None
        self._parent: VM | None = None
        self._current: Snapshot | None = None
        self._current_generation: int | None = None
        """The parent's generation when ``_current`` was taken (None: no parent yet)."""
        self._pooled: Snapshot | None = None
        """The snapshot whose children the factory keeps ready."""
        self._staged: dict[tuple[Path, str], Snapshot] = {}
        """Copies on /dev/shm of disk-backed snapshots, for backends that need tmpfs memory, by snapshot
        (directory and creation time: a snapshot rebuilt under the same tag is copied again)."""
        self._lock = threading.RLock()
        self.children_expected: int | None = None
        """How many more tests of this run will ask for a child of the parent's state (None: unknown).

        Set by the plugin from the collected tests; the pool never restores more children than this."""
        self.prefill_seconds = 0.0
        """Time spent filling the pool before the first test (``pool_prefill``): a session cost, like building."""
        self.prefills: list[dict[str, object]] = []
        """Each prefill: the snapshot, how many children were made ready, and how long it took."""
        self.build_seconds = 0.0
        """Time spent building or looking up named snapshots; not part of any test's fixture overhead."""
        self.unavailable: dict[str, ImageError] = {}
        """Snapshots whose image could not be had (not in the registry, a failed build...), with the error.

        Asked for again in this session, such a snapshot fails at once with the same error: the registry
        is asked, or the build tried, once per session, not once per test."""

    @classmethod
    def open(
        cls,
        *,
        snapshot: str | None = None,
        config: Path | str | None = None,
        pool: int | None = None,
        progress: Callable[[str], None] | None = None,
        image: str | None = None,
    ) -> ForkdSession:
        """A session outside pytest, for the sandbox providers of agent frameworks and for scripts.

        ``config`` names a forkd.yaml (its ``settings:`` apply as in a pytest
        run, and its snapshots can be named); ``snapshot`` overrides the one
        it selects (default: the built-in ``base``); ``image`` (a container
        reference, bare means docker://) runs it on a snapshot of that image
        instead. ``PYTEST_FORKD_*``
        variables apply as they do under pytest. Raises ConfigError for a
        missing or malformed file or an unknown snapshot name, before anything
        boots. Close it (or use it as a context manager) to kill its VMs.
        """
        import os

        from pytest_forkd.project.config import EMPTY_PROJECT, load_project
        from pytest_forkd.project.settings import resolve

        path = Path(config).absolute() if config is not None else None
        if path is not None and not path.is_file():
            from pytest_forkd.errors import ConfigError

            raise ConfigError(f"{path}: no such forkd.yaml; fix the path or leave the config out to use 'base'")
        project = load_project(path) if path is not None else EMPTY_PROJECT
        cli: dict[str, object] = {"snapshot": snapshot, "pool": None if pool is None else str(pool), "image": image}
        runtime = Runtime()
        settings = resolve(
            cli=cli,
            env=os.environ,
            ini={},
            project_settings=project.settings,
            backends=lambda: runtime.backends.ids(),
            rootdir=path.parent if path is not None else Path.cwd(),
            config=path,
            config_source="argument" if path is not None else "default",
            project_origin=path.name if path is not None else "forkd.yaml",
        )
        session = cls(settings, project, runtime=runtime, progress=progress)
        session.check_snapshot_name(session.settings.snapshot)
        return session

    def check_snapshot_name(self, name: str) -> None:
        """ConfigError unless ``name`` is the built-in ``base``, declared in forkd.yaml, or already in the store."""
        from pytest_forkd.errors import ConfigError, UnknownSnapshot
        from pytest_forkd.project.lifecycle import find_snapshot

        if name in self.project.snapshot_names():
            return
        try:
            find_snapshot(self.shared_store, name, self.project.root)
        except UnknownSnapshot:
            declared = ", ".join(self.project.snapshot_names())
            raise ConfigError(
                f"unknown snapshot {name!r}: not built in, not declared in {self.project.origin}, not in the store; "
                f"declare it under snapshots: in forkd.yaml or pick one of: {declared}"
            ) from None

    def __enter__(self) -> ForkdSession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- lazily created machinery ------------------------------------------------
    @property
    def factory(self) -> VMFactory:
        """The factory that starts and owns every VM of this session (created on first use)."""
        with self._lock:
            if self._factory is None:
                from pytest_forkd.core.factory import VMFactory

                self._factory = VMFactory(
                    accel=self.settings.accel,
                    progress=self.progress,
                    default_backend=self.settings.backend,
                    max_output=self.settings.max_output,
                    runtime=self.runtime,
                )
                self.store.clean_stale_temp()
            return self._factory

    @property
    def builder(self) -> SnapshotBuilder:
        with self._lock:
            if self._builder is None:
                from pytest_forkd.project.snapshot_builder import SnapshotBuilder

                self._builder = SnapshotBuilder(
                    self.factory,
                    self.store,
                    self.project,
                    progress=self.progress,
                    shared_store=self.shared_store,
                    max_store_bytes=self.settings.store_max_size,
                    pull_policy=self.settings.pull,
                )
            return self._builder

    @property
    def build_events(self) -> list[BuildEvent]:
        """Which named snapshots this session built or found cached, and how long that took."""
        return list(self._builder.events) if self._builder is not None else []

    # -- snapshots ----------------------------------------------------------------
    def snapshot_for(self, name: str, *, memory_mib: int | None = None) -> Snapshot:
        """Named snapshot ``name`` (``base`` or declared in forkd.yaml), built on first use.

        Its work is not attributed to the running test: building is a
        session cost, reported once in the terminal summary. An image that
        cannot be had (ImageError) is tried once: see :attr:`unavailable`.
        """
        failed = self.unavailable.get(name)
        if failed is not None:
            raise failed.with_traceback(None)
        started = time.perf_counter()
        try:
            with self.timings.running_test(None):
                return self.builder.get(name, memory_mib=memory_mib)
        except ImageError as exc:
            self.unavailable[name] = exc
            raise
        finally:
            self.build_seconds += time.perf_counter() - started

    @property
    def selected(self) -> Snapshot:
        """The snapshot chosen for this run (``--forkd-snapshot``)."""
        return self._on_suitable_memory(self.snapshot_for(self.settings.snapshot))

    def _on_suitable_memory(self, snapshot: Snapshot, backend: str | None = None) -> Snapshot:
        """``snapshot``, or a once-per-session copy on /dev/shm when the backend needs tmpfs memory.

        The uffd backend can only branch VMs whose RAM file is on tmpfs, and
        the persistent store usually lives on disk.
        """
        from pytest_forkd.engine.memory import filesystem_type
        from pytest_forkd.project.snapshot_builder import publish_copy

        memory = snapshot.memory_path
        if (
            memory is None
            or not self.runtime.backends.get(backend or self.settings.backend).requires_tmpfs_memory
            or filesystem_type(memory) == "tmpfs"
        ):
            return snapshot
        with self._lock:
            key = (snapshot.path, snapshot.created)
            staged = self._staged.get(key)
            if staged is None:
                with self.timings.running_test(None):
                    staged = publish_copy(snapshot, self.factory.session_store, f"{snapshot.tag}-tmpfs")
                self._staged[key] = staged = staged.with_owner(self.factory)
            return staged

    @property
    def snapshot(self) -> Snapshot:
        """The parent's current state; branches the parent first if it changed since the last branch."""
        with self._lock:
            parent = self._parent
            if (
                parent is not None
                and not parent.closed
                and (parent.generation != self._current_generation or self._defaults_changed(parent))
            ):
                if parent.generation == self._current_generation:  # only its env/cwd defaults changed
                    parent.generation += 1
                self._current_generation = parent.generation
                self._current = parent.branch(f"parent-g{parent.generation}", backend=self.settings.backend)
            elif self._current is None:
                self._current = self.selected
            self._keep_children_ready(self._current)
            return self._current

    def _defaults_changed(self, parent: VM) -> bool:
        """Whether the parent's env/cwd defaults differ from those its children would get now."""
        current = self._current
        if current is None:
            return False
        recorded = {"env": dict(current.extra.get("env") or {}), "cwd": current.extra.get("cwd")}
        return parent.defaults() != recorded

    def _keep_children_ready(self, snapshot: Snapshot) -> None:
        """Move the pool of pre-restored children to ``snapshot`` (the one tests' VMs come from now)."""
        if self._pooled is not None and self._pooled.path == snapshot.path:
            return
        if self._pooled is not None:
            self.factory.drop_pool(self._pooled)
        self._pooled = snapshot
        if self.settings.pool > 0:
            from pytest_forkd.core.pool import DEFAULT_CHILD_MIB, available_memory_mib, memory_bound, vm_memory_bound

            pool = self.factory.pool(
                snapshot,
                self.settings.pool,
                maximum=max(self.settings.pool, memory_bound(DEFAULT_CHILD_MIB, available_memory_mib())),
                demand=lambda: self.children_expected,
                resize=vm_memory_bound,
            )
            if self.settings.pool_prefill and not self.prefills:
                started = time.perf_counter()
                self.progress(
                    f"forkd: restoring pooled children of {snapshot.tag!r} ahead of the tests (--forkd-pool-prefill)"
                )
                ready = pool.prefill(timeout=PREFILL_TIMEOUT_S)
                seconds = time.perf_counter() - started
                self.prefill_seconds += seconds
                self.prefills.append({"snapshot": snapshot.tag, "children": ready, "seconds": round(seconds, 3)})

    # -- VMs ----------------------------------------------------------------------
    @property
    def parent(self) -> VM:
        """The session's warm parent VM, started from the selected snapshot on first use.

        Prepare it further with ``exec``/``write_file``: the next child is
        forked from its state then.
        """
        with self._lock:
            if self._parent is None:
                with self.timings.running_test(None):
                    self._current = self.selected
                    self._parent = self.factory.fork_snapshot(self._current, 1)[0]
                self._current_generation = self._parent.generation
            elif self._parent.closed:
                raise VMError(
                    f"the parent VM {self._parent.name} is gone (its guest crashed or it was closed), and with "
                    "it the state prepared in it; do not close forkd_parent, and check its console in the report"
                )
            return self._parent

    def fork(self, n: int = 1) -> list[VM]:
        """``n`` copy-on-write children of the parent's current state; close them when done."""
        return self.factory.fork_snapshot(self.snapshot, n)

    def child(self, choice: VMChoice) -> VM:
        """A fresh child for one test: of the parent's state, or of the snapshot its marker names."""
        pooled = choice.snapshot == self.settings.snapshot and choice.memory_mib in (None, self.selected.memory_mib)
        if pooled:
            origin = self.snapshot
        else:
            origin = self._on_suitable_memory(
                self.snapshot_for(choice.snapshot, memory_mib=choice.memory_mib), choice.backend
            )
        try:
            return self.factory.fork_snapshot(origin, 1)[0]
        finally:
            if pooled and self.children_expected is not None:  # one test fewer to restore ahead for
                self.children_expected = max(0, self.children_expected - 1)

    def close(self) -> None:
        """Kill every VM of the session and remove its run directory."""
        with self._lock:
            factory, self._factory = self._factory, None
            self._parent = self._current = self._pooled = None
        if factory is not None:
            factory.close()
