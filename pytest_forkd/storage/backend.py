"""Storage backends: the interface, the pluggy hook, and the registry.

A storage backend decides how a BRANCH (a snapshot of a running VM) captures
guest memory and how a child of that snapshot gets it. Backends are pluggy
plugins: a plugin implements the :func:`forkd_register_backends` hook and adds
:class:`StorageBackend` objects to a :class:`BackendRegistry`, keyed by backend
id. Each :class:`~pytest_forkd.core.runtime.Runtime` (one per pytest session,
``forkd`` command or script) fills its own registry through
:func:`plugin_manager`: the built-in backends (``full``, ``diff``, ``uffd``, in
the top-level ``backends/`` directory, import package ``forkd_backends``) are
registered in code through that same hook, then third-party ones listed under
the ``pytest_forkd.backends`` entry-point group, then plugin objects handed to
the runtime or to :func:`register_plugin`.

Writing a backend::

    from pytest_forkd.storage.backend import StorageBackend, hookimpl

    class MyBackend(StorageBackend):
        id = "mine"
        description = "what it does"
        def capture(self, source, target): ...

    @hookimpl
    def forkd_register_backends(registry):
        registry.add(MyBackend())

and in pyproject.toml::

    [project.entry-points."pytest_forkd.backends"]
    mine = "my_package.my_module"

A backend talks to the engine only through :class:`CaptureSource` (pause,
resume, device state, guest-RAM location: the
:class:`~pytest_forkd.engine.base.Machine` protocol) and the child's machine;
it names the engine capabilities it needs in ``requires`` (for instance
``("dirty_page_tracking",)``) instead of probing the VMM, never builds VMM
command lines and never sees pytest options.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping

import pluggy

from pytest_forkd.engine.base import Capabilities
from pytest_forkd.errors import BackendError
from pytest_forkd.storage.store import resolve_base as resolve_base  # where backends find it

if TYPE_CHECKING:
    from pytest_forkd.engine.base import AnyMachine, ImageLike
    from pytest_forkd.storage.snapshot import Snapshot
    from pytest_forkd.storage.store import SnapshotStore

PROJECT = "pytest_forkd"
ENTRY_POINT_GROUP = "pytest_forkd.backends"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

# The second half of a background capture (see Capture.finish).
CaptureFinish = Callable[["Snapshot", "SnapshotStore"], tuple[Path, "Path | None", dict[str, Any]]]


class BackendHooks:
    """Hook specifications of pytest-forkd's backend plugin system."""

    @hookspec(historic=True)
    def forkd_register_backends(self, registry: "BackendRegistry") -> None:
        """Add storage backends to ``registry`` with ``registry.add(backend)``.

        Historic: a plugin registered after the registry was filled is called too
        (see :meth:`pytest_forkd.core.runtime.Runtime.register`)."""


@dataclass
class CaptureSource:
    """What a backend may use of the VM being branched.

    ``base`` is the snapshot whose flat memory file the VM maps copy-on-write
    (None for a root VM, whose RAM file is its own and mutable).
    """

    machine: "AnyMachine"
    base: "Snapshot | None"
    store: "SnapshotStore"
    image: "ImageLike"
    ping: Callable[[], object]
    """A round trip to the guest agent: how a live backend measures the pause the guest saw."""
    capabilities: Capabilities = field(default_factory=Capabilities)
    """What the engine running the machine can do (a backend asks these instead of probing the machine)."""


@dataclass
class Capture:
    """What a backend produced in the pending snapshot directory."""

    pause_ms: float
    bytes_written: int
    memory_file: str | None = None
    diff_file: str | None = None
    base: str | None = None
    dirty_bytes: int | None = None
    status: str = "ready"
    extra: dict[str, Any] = field(default_factory=dict)
    remapped: bool = False
    """True when the VM now maps this snapshot's memory file copy-on-write (a re-based diff): it
    continues as a child of the snapshot, whose later diffs are taken against that file."""
    finish: CaptureFinish | None = None
    """For a background capture: ``finish(snapshot, store) -> (memory_tmp, state_tmp | None, fields)``,
    run on a worker thread after publication to materialise the memory (and the
    device state, when the capture did not save it); the files are then moved
    into the snapshot by ``store.complete``."""


class StorageBackend:
    """Base class of storage backends. Subclasses set ``id`` and ``description``."""

    id: str = ""
    description: str = ""
    requires_tmpfs_memory: bool = False
    """True when the VM's RAM file must be on tmpfs (userfaultfd write-protection
    does not cover private mappings of files on disk); sessions then copy a
    disk-backed snapshot to /dev/shm before forking VMs they will branch."""

    requires: tuple[str, ...] = ()
    """Engine capabilities this backend needs (names of :class:`~pytest_forkd.engine.base.Capabilities` flags)."""

    def unavailable_reason(self) -> str | None:
        """Why this backend cannot work on this host (shown by ``forkd doctor``), or None.

        The default checks :attr:`requires` against the default engine's
        capabilities on this host; a backend with host needs of its own
        overrides this.
        """
        if not self.requires:
            return None
        from pytest_forkd.engine.base import default_capabilities

        return default_capabilities().missing(self.requires)

    def capture(self, source: CaptureSource, target: Path) -> Capture:
        """Snapshot the running VM into the directory ``target``.

        Called with the VM running; the backend pauses it (``source.machine.stop()``),
        saves the device state to ``target / "state.bin"``, captures memory into
        ``target`` and resumes it before returning. If anything fails the caller
        resumes the VM and checks that it answers.
        """
        raise NotImplementedError

    def prepare_child(self, snapshot: "Snapshot", machine: "AnyMachine", store: "SnapshotStore") -> None:
        """Fill in a child's memory before its device state is loaded (diffs apply pages here)."""

    def published(self, snapshot: "Snapshot", store: "SnapshotStore") -> None:
        """Called once ``snapshot`` is visible in ``store`` (the diff backend flattens here)."""

    def child_memory(self, snapshot: "Snapshot", store: "SnapshotStore") -> Path:
        """The flat memory file a child of ``snapshot`` maps copy-on-write."""
        if snapshot.memory_path is not None:
            return snapshot.memory_path
        base = resolve_base(snapshot, store)
        if base.memory_path is None:
            raise BackendError(f"base {base.tag!r} of snapshot {snapshot.tag!r} has no flat memory file")
        return base.memory_path

    def require_available(self, capabilities: "Capabilities | None" = None) -> None:
        """BackendError unless this backend can work with an engine of ``capabilities`` (default: on this host)."""
        if capabilities is None:
            reason = self.unavailable_reason()
        else:
            reason = capabilities.missing(self.requires)
            if reason is None and type(self).unavailable_reason is not StorageBackend.unavailable_reason:
                reason = self.unavailable_reason()  # the backend's own host check
        if reason:
            raise BackendError(f"storage backend {self.id!r} is unavailable on this host: {reason}")


STATE_FILE = "state.bin"
MEMORY_FILE = "memory.ram"
DIFF_FILE = "memory.diff"


class BackendRegistry:
    """Storage backends keyed by id."""

    def __init__(self) -> None:
        self._backends: dict[str, StorageBackend] = {}

    def add(self, backend: StorageBackend) -> None:
        if not backend.id:
            raise BackendError(f"{type(backend).__name__} has no id")
        if backend.id in self._backends:
            raise BackendError(f"two storage backends claim the id {backend.id!r}")
        self._backends[backend.id] = backend

    def get(self, backend_id: str) -> StorageBackend:
        try:
            return self._backends[backend_id]
        except KeyError:
            known = ", ".join(sorted(self._backends)) or "none"
            raise BackendError(
                f"unknown storage backend {backend_id!r}; registered backends: {known}. "
                f"Third-party backends register through the {ENTRY_POINT_GROUP!r} entry-point group"
            ) from None

    def ids(self) -> list[str]:
        return sorted(self._backends)

    def all(self) -> list[StorageBackend]:
        return [self._backends[i] for i in self.ids()]

    def __iter__(self) -> Iterator[StorageBackend]:
        return iter(self.all())

    def __contains__(self, backend_id: object) -> bool:
        return backend_id in self._backends


def plugin_manager(builtin: Mapping[str, object] | None = None, plugins: Iterable[object] = ()) -> pluggy.PluginManager:
    """A plugin manager with the backend hooks and its plugins, in this order.

    ``builtin`` plugins are registered in code under their names (as tox
    registers its internal plugins), then the installed entry points of the
    ``pytest_forkd.backends`` group are loaded (pluggy skips an entry point
    whose name is registered already), then ``plugins`` are registered.
    """
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(BackendHooks)
    for name, plugin in (builtin or {}).items():
        pm.register(plugin, name=name)
    pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    for plugin in plugins:
        if not pm.is_registered(plugin):
            pm.register(plugin)
    return pm


def fill_registry(pm: pluggy.PluginManager) -> BackendRegistry:
    """A registry holding the backends of every plugin of ``pm``; plugins ``pm`` registers later add theirs too."""
    registry = BackendRegistry()
    pm.hook.forkd_register_backends.call_historic(kwargs={"registry": registry})
    return registry


_default_plugins: list[object] = []
_default_plugins_lock = threading.Lock()


def register_plugin(plugin: object) -> None:
    """Have every runtime created from now on load the backend plugin ``plugin``, without an entry point.

    ``plugin`` is a module or an object with a :func:`forkd_register_backends`
    hook implementation. Runtimes (:class:`~pytest_forkd.core.runtime.Runtime`)
    created afterwards load it: call it before the pytest session starts its
    VMs (in a ``conftest.py``), or before making a ``VMFactory``. To add a
    plugin to one runtime only, pass it as ``Runtime(plugins=[plugin])`` or
    call ``runtime.register(plugin)``.
    """
    with _default_plugins_lock:
        if not any(known is plugin for known in _default_plugins):
            _default_plugins.append(plugin)


def default_plugins() -> list[object]:
    """The plugins given to :func:`register_plugin` so far, in order."""
    with _default_plugins_lock:
        return list(_default_plugins)
