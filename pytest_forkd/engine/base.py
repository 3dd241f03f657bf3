"""The engine interface: what a virtual machine monitor must do for forkd.

forkd's core (VM handles, the factory, branches, pools) and the storage
backends never talk to a VMM directly. They hold an :class:`Engine`, which
starts :class:`Machine` objects, and they ask it for :class:`Capabilities`
instead of knowing which VMM runs underneath. ``engine/qemu/`` is the real
implementation (QEMU ``microvm``); ``engine/fake/`` runs the real guest agent
as a host process with a plain file as its memory, for fast tests. A second
real VMM (Firecracker, Cloud Hypervisor) implements the same two protocols;
see docs/engines.md.

A machine's life, as forkd drives it:

* **boot**: start from an image with a fresh RAM file mapped *shared* (the
  file may become a snapshot's memory when the machine is frozen);
* **restore**: start paused from a snapshot's flat memory file mapped
  *copy-on-write* (never written: siblings share it), let a storage backend
  write extra pages into the mapping, load the device state, resume;
* **stop / resume / save_device_state**: a consistent pause in which
  backends copy memory out of :meth:`Machine.memory_layout`;
* the **agent channel** is a connected stream socket to the guest agent
  (:mod:`pytest_forkd.guest.wire` protocol); the console log tail explains a
  death.

Engines are found by name: the built-in ones below, then the
``pytest_forkd.engines`` entry-point group (``name = "module:Class"``). The
default is ``qemu``; a factory names another explicitly (``VMFactory(engine="fake")``).
"""

from __future__ import annotations

import dataclasses
import importlib
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast, runtime_checkable

from pytest_forkd.errors import ConfigError, VMError

if TYPE_CHECKING:
    from pytest_forkd.engine.network import NetworkSpec
    from pytest_forkd.errors import GuestCrashed

ENTRY_POINT_GROUP = "pytest_forkd.engines"
DEFAULT_ENGINE = "qemu"
#: Built-in engines, by name: "module:attribute" of a class whose instances are :class:`Engine`.
BUILTIN_ENGINES: Mapping[str, str] = {
    "qemu": "pytest_forkd.engine.qemu.engine:QemuEngine",
    "fake": "pytest_forkd.engine.fake:FakeEngine",
}


class EngineError(VMError):
    """The VMM refused or failed an operation (a state load, a pause, a live snapshot)."""


# -- capabilities -------------------------------------------------------------
LIVE_SNAPSHOT = "live_snapshot"
DIRTY_PAGE_TRACKING = "dirty_page_tracking"
UFFD_WRITE_PROTECT = "uffd_write_protect"
INCOMING_RESTORE = "incoming_restore"
NETWORK = "network"


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do on this host; storage backends ask for these instead of probing the VMM.

    Each flag that is False may have a reason in :attr:`reasons` (shown to the
    user when a backend that needs it is chosen).
    """

    live_snapshot: bool = False
    """Snapshot a running machine while the guest keeps running (QEMU: its background snapshot migration)."""
    dirty_page_tracking: bool = False
    """The pages a copy-on-write machine changed since its memory file can be listed (PAGEMAP_SCAN)."""
    uffd_write_protect: bool = False
    """The VMM can write-protect guest memory with userfaultfd (what a live snapshot rests on)."""
    incoming_restore: bool = True
    """A machine can start paused from a memory file plus a device-state file."""
    network: bool = False
    """Machines can have a network card, with host ports forwarded to guest ports."""
    memory_remap: bool = False
    """Guest RAM may be remapped in place in the VMM process while the machine is paused (what re-basing a
    diff onto a new flat memory file rests on)."""
    memory_file_layout: str = "file"
    """Where guest RAM lives: ``"file"``: one flat file per machine, mapped shared by a booted machine
    and copy-on-write (private) by a restored one, at :meth:`Machine.memory_layout` in process ``pid``."""
    reasons: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Why a capability is missing, by name."""
    engine: str = "?"
    """Name of the engine these capabilities describe."""

    def has(self, name: str) -> bool:
        value = getattr(self, name, None)
        if not isinstance(value, bool):
            raise ConfigError(f"unknown engine capability {name!r}; known: {', '.join(capability_names())}")
        return value

    def missing(self, names: Iterable[str]) -> str | None:
        """Why the capabilities ``names`` are not all there (the reason of each missing one), or None."""
        problems = []
        for name in names:
            if not self.has(name):
                reason = self.reasons.get(name, f"the {self.engine} engine has no {name} capability")
                if reason not in problems:
                    problems.append(reason)
        return "; ".join(problems) or None


def capability_names() -> list[str]:
    """The names of the capability flags."""
    return [f.name for f in dataclasses.fields(Capabilities) if f.type in ("bool", bool)]


@dataclass(frozen=True)
class MemoryLayout:
    """Where a machine's guest RAM is: in a file, and mapped at ``start`` in process ``pid``.

    A booted machine maps ``path`` shared (``shared=True``: its writes reach the
    file). A restored one maps it privately: the pages it changed since are
    anonymous pages of that mapping, which ``/proc/PID/pagemap`` and
    ``/proc/PID/mem`` reach (see :mod:`pytest_forkd.engine.memory`).
    """

    path: Path
    pid: int
    start: int
    length: int
    shared: bool


# -- what the core hands an engine, and gets back ---------------------------------
class ImageLike(Protocol):
    """The guest image a machine runs: a name and a key (its content hash) are all the core reads."""

    @property
    def name(self) -> str: ...

    @property
    def key(self) -> str: ...


class SpecLike(Protocol):
    """Everything that must be identical between a snapshot's parent and its children."""

    @property
    def memory_mib(self) -> int: ...

    @property
    def vcpus(self) -> int: ...

    @property
    def network_card(self) -> bool: ...

    def fingerprint(self) -> str: ...

    def with_memory(self, memory_mib: int) -> SpecLike:
        """The same machine with another memory size."""
        ...


#: The engine's own machine description and image types (QEMU: MachineSpec and Image).
SpecT = TypeVar("SpecT", bound=SpecLike)
SpecT_co = TypeVar("SpecT_co", bound=SpecLike, covariant=True)
ImageT = TypeVar("ImageT", bound=ImageLike)

#: Boots a throwaway machine of ``spec`` and stops it, raising if it does not come up within the timeout.
#: It may raise the spec's memory (``with_memory``) to what the image needs to boot.
ProbeBoot = Callable[[SpecLike, float], None]


@runtime_checkable
class Machine(Protocol[SpecT_co]):
    """One running virtual machine, as its VMM process sees it; generic over the engine's spec type."""

    name: str

    @property
    def spec(self) -> SpecT_co:
        """The machine's description (what its children must match)."""
        ...

    directory: Path
    ram_path: Path
    """The file holding guest RAM (see :meth:`memory_layout`)."""
    owns_ram: bool
    """True for a booted machine: its RAM file is its own (removed on kill unless frozen)."""
    agent_sock: socket.socket
    """The connected channel to the guest agent (forkd's wire protocol)."""
    network: NetworkSpec

    @property
    def pid(self) -> int:
        """The VMM process (its memory is where guest RAM is mapped)."""
        ...

    def alive(self) -> bool: ...

    def stop(self) -> None:
        """Pause the guest's CPUs: memory and devices hold still until :meth:`resume`."""

    def resume(self) -> None: ...

    def status(self) -> str:
        """``running``, ``paused`` or another engine-specific word for a machine that is neither."""
        ...

    def save_device_state(self, path: Path) -> None:
        """Write the device state (no RAM) of a stopped machine to ``path``, created 0600."""

    def load_device_state(self, path: Path, *, timeout: float = 30.0) -> None:
        """Load a device-state file into a restored machine; it stays paused."""

    def memory_layout(self) -> MemoryLayout: ...

    def start_live_snapshot(self, stream: Path, armed: Callable[[], bool]) -> None:
        """Begin writing guest memory and devices to ``stream`` while the guest runs (``live_snapshot``).

        Returns once the memory is write-protected and ``armed()`` says the guest runs again.
        """

    def finish_live_snapshot(self, timeout: float) -> None:
        """Wait until the stream of :meth:`start_live_snapshot` is complete."""

    def materialise(self, stream: Path, image: ImageLike, memory_file: Path, state_file: Path) -> None:
        """Turn a live-snapshot stream into a flat memory file and a device-state file."""

    def forward_port(self, guest_port: int) -> int:
        """Forward a free host loopback port to ``guest_port``; returns the host port."""
        ...

    def move_forward(self, from_port: int, to_port: int, guest_port: int) -> bool: ...

    def console_tail(self, lines: int = 40) -> str: ...

    def stderr_tail(self, lines: int = 10) -> str:
        """What the VMM itself printed last."""
        ...

    def crash_error(self, what: str) -> GuestCrashed: ...

    def translation_stats(self) -> dict[str, int]:
        """The VMM's code-translation state (binary translation only; empty under hardware virtualisation).

        Keys: ``tb_count`` (translated blocks alive), ``gen_code_bytes``
        (host code generated for them), ``tb_flushes`` and
        ``tb_invalidations`` (how often translated code was thrown away).
        """
        ...

    def kill(self, *, remove_files: bool = True) -> None:
        """Stop the VMM process and remove its sockets and logs (and its RAM file when owned). Idempotent."""


@runtime_checkable
class Engine(Protocol[SpecT, ImageT]):
    """Starts machines of one VMM; one instance per factory. Generic over its spec and image types."""

    name: str

    def capabilities(self) -> Capabilities: ...

    def unavailable_reason(self) -> str | None:
        """Why this engine cannot start machines on this host (its VMM is missing...), or None."""
        ...

    def image(self, name: str, *, progress: Callable[[str], None] | None = None) -> ImageT:
        """The guest image called ``name``, built on first use when the engine needs one."""
        ...

    def image_for(self, name: str, key: str | None) -> ImageT:
        """The exact image a snapshot was taken with (its name and recorded key)."""
        ...

    def machine_spec(
        self, image: ImageT, *, memory_mib: int, vcpus: int, network_card: bool = False, probe: ProbeBoot | None = None
    ) -> SpecT:
        """The machine for ``image`` at this size; ``probe`` may boot a throwaway machine to pick an accelerator."""
        ...

    def fingerprint(self, image: ImageT, spec: SpecT) -> dict[str, str]:
        """What a snapshot's children must match (VMM version, machine arguments, image)."""
        ...

    def machine_record(self, spec: SpecT) -> dict[str, object]:
        """The machine of ``spec`` as a snapshot records it (JSON): VMM version, machine, CPU, arguments."""
        ...

    def boot(
        self,
        spec: SpecT,
        image: ImageT,
        *,
        directory: Path,
        name: str,
        ram_path: Path,
        network: NetworkSpec | None = None,
    ) -> Machine[SpecT]:
        """Start a machine from ``image`` with a fresh RAM file ``ram_path`` mapped shared."""
        ...

    def restore(
        self,
        spec: SpecT,
        image: ImageT,
        *,
        directory: Path,
        name: str,
        memory_file: Path,
        network: NetworkSpec | None = None,
    ) -> Machine[SpecT]:
        """Start a paused machine mapping ``memory_file`` copy-on-write, waiting for its device state."""
        ...

    def describe(self) -> dict[str, object]:
        """Facts for benchmark reports and diagnostics (``{"engine": ..., "version": ...}``)."""
        ...


@runtime_checkable
class AcceleratedEngine(Engine[SpecT, ImageT], Protocol):
    """An engine that chooses between accelerators (hardware virtualisation or binary translation)."""

    def accel_verdict(self, image: ImageT, probe: ProbeBoot | None = None) -> Any:
        """The accelerator chosen for this host and why (probing with ``probe`` once when not known yet)."""
        ...


# -- finding engines ------------------------------------------------------------------
def _load(target: str) -> object:
    module_name, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module_name), attribute)


def engine_names() -> list[str]:
    """Every engine name: built-in ones and those installed through the entry-point group."""
    from importlib.metadata import entry_points

    names = set(BUILTIN_ENGINES)
    names.update(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
    return sorted(names)


#: An engine as a factory holds it: the specs and images it hands out are passed back to it untouched.
AnyEngine = Engine[SpecLike, ImageLike]
#: A machine of such an engine.
AnyMachine = Machine[SpecLike]
EngineClass = Callable[..., AnyEngine]


def engine_class(name: str) -> EngineClass:
    """The class (or factory) of the engine called ``name``."""
    if name in BUILTIN_ENGINES:
        return cast(EngineClass, _load(BUILTIN_ENGINES[name]))
    from importlib.metadata import entry_points

    for entry in entry_points(group=ENTRY_POINT_GROUP):
        if entry.name == name:
            return cast(EngineClass, entry.load())
    raise ConfigError(
        f"unknown engine {name!r}; known engines: {', '.join(engine_names())}. A third-party engine "
        f"registers through the {ENTRY_POINT_GROUP!r} entry-point group"
    )


def make_engine(engine: str | AnyEngine | None = None, **options: object) -> AnyEngine:
    """An engine instance: ``engine`` itself, the engine of that name, or the default (QEMU)."""
    if engine is not None and not isinstance(engine, str):
        return engine
    return engine_class(engine or DEFAULT_ENGINE)(**options)


def default_capabilities() -> Capabilities:
    """The capabilities of the default engine on this host (what ``forkd doctor`` and backends report)."""
    return engine_class(DEFAULT_ENGINE).host_capabilities()  # type: ignore[attr-defined,no-any-return]
