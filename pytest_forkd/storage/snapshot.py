"""The snapshot record: what a snapshot directory holds and how to read it back.

A snapshot of a VM is a directory with the device state (the QEMU migration
stream of the devices only), the guest memory (a flat RAM file, or a sparse
diff against the flat memory of a *base* snapshot) and ``snapshot.json``, the
metadata described by :class:`Snapshot`. The record is immutable: children map
the memory files copy-on-write, so a published snapshot's files never change.
Only its metadata is rewritten, by the store, when memory written in the
background arrives: the status goes from ``writing`` to ``ready`` or
``failed``, or a diff gains flat memory of its own.

The record is plain data: it does not know how to start VMs or write
archives. The factory that took or restored it attaches itself as the record's
*owner* (a :class:`SnapshotOwner`), and :meth:`Snapshot.fork` and
:meth:`Snapshot.export` hand the record to it; records read straight from
disk are detached.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import socket
import threading
import types
import typing
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, Protocol

from pytest_forkd import private, processes
from pytest_forkd.errors import ForkdError, SnapshotError
from pytest_forkd.paths import validate_tag
from pytest_forkd.waiting import poll_until

SNAPSHOT_FILE = "snapshot.json"

# Version of the snapshot.json layout; bump it when a field changes meaning.
# Format 2 added ``files`` (size and checksum of every data file) and ``writer_host``.
FORMAT_VERSION = 2
# Formats this version reads: a format-1 record simply has no ``files``.
READABLE_FORMATS: tuple[int, ...] = (1, 2)

SnapshotStatus = Literal["writing", "ready", "failed"]
STATUSES: tuple[str, ...] = typing.get_args(SnapshotStatus)

# Fields that describe where the record lives or who uses it, not the snapshot.
_NOT_SERIALISED = frozenset({"path", "owner"})
# Optional fields left out of snapshot.json when unset, so that readers which
# predate them still read the records that do not use them.
_OMITTED_WHEN_NONE = frozenset({"network", "machine"})


class SnapshotOwner(Protocol):
    """What starts child VMs from a snapshot and writes its archives (a :class:`~pytest_forkd.core.factory.VMFactory`).

    ``network`` is whatever the owner accepts as a network policy (the
    factory's ``NetworkChoice``); the record passes it through untouched.
    """

    def fork_snapshot(self, snapshot: Snapshot, n: int = 1, *, network: Any = None) -> list[Any]:
        """Start ``n`` copy-on-write children of ``snapshot`` and return their handles."""
        ...

    def export_snapshot(self, snapshot: Snapshot, destination: Path | str) -> Path:
        """Write ``snapshot`` with its image into the archive ``destination``; return its path."""
        ...


def utc_now_iso() -> str:
    """Current time as ISO-8601 UTC with milliseconds, the format of ``Snapshot.created``."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def process_is_alive(pid: int) -> bool:
    """Whether a process with this pid runs on this host (see :func:`pytest_forkd.processes.is_alive`).

    Used to tell an interrupted write (its writer is gone) from a slow one.
    """
    return processes.is_alive(pid)


def writer_is_alive(pid: int, host: str | None = None) -> bool:
    """Whether the process ``pid`` that writes a snapshot still runs.

    A writer on another ``host`` (a store shared over the network) cannot be
    checked from here and counts as alive.
    """
    if host is not None and host != this_host():
        return True
    return process_is_alive(pid)


def this_host() -> str:
    """This machine's name, recorded with a writer pid (pids mean nothing on another host)."""
    return socket.gethostname()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Snapshot:
    """Metadata of one snapshot, as stored in ``<store>/<tag>/snapshot.json``."""

    tag: str
    path: Path
    """The snapshot directory; derived from where the record was read, never stored."""
    backend: str
    """Name of the storage backend that took the snapshot (full, diff, uffd...)."""
    memory_mib: int
    vcpus: int
    image: str
    """Name of the guest image the snapshotted VM was booted from."""
    fingerprint: Mapping[str, str] = dataclasses.field(hash=False)
    """What a child must match to restore it: QEMU version, machine arguments, image key."""
    state_file: str
    """Device-state file name inside ``path``."""
    parent: str | None = None
    """Tag of the snapshot (or name of the VM) this one descends from: lineage only."""
    base: str | None = None
    """Tag of the snapshot whose flat memory this one's diff applies to; None for flat memory."""
    memory_file: str | None = None
    """Flat memory file name inside ``path``; None when the memory is the base's."""
    diff_file: str | None = None
    """Sparse diff file name inside ``path`` (pages changed since ``base``)."""
    created: str = dataclasses.field(default_factory=utc_now_iso)
    pause_ms: float | None = None
    """How long the VM was paused to take the snapshot."""
    total_ms: float | None = None
    """Wall time from the request to a ready snapshot."""
    bytes_written: int = 0
    dirty_bytes: int | None = None
    status: SnapshotStatus = "ready"
    error: str | None = None
    """Why materialising the memory failed, when ``status`` is ``failed``."""
    writer_pid: int | None = None
    """Process that will complete a ``writing`` snapshot; tells a stalled write from a slow one."""
    writer_host: str | None = None
    """Host name of ``writer_pid``'s machine (a pid is only meaningful there)."""
    files: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict, hash=False)
    """Size and checksum of every data file, by file name, recorded when the file was stored::

        {"memory.ram": {"size": 268435456, "checksum": "crc32-1MiB:5f0c...", "mtime_ns": 1764745...},
         "state.bin": {...}}

    Restoring checks every size (a stat per file); the checksum (see
    :mod:`pytest_forkd.storage.integrity`) is checked by ``forkd snapshots verify`` and
    whenever a file's ``mtime_ns`` differs from the recorded one. Empty in
    records written before format 2."""
    network: Mapping[str, Any] | None = dataclasses.field(default=None, hash=False)
    """The network of the snapshotted VM (``{"mode", "allow", "forward"}``), None without one.

    Children are restored with it: a VM with a network card cannot be restored
    without one, nor the other way round (the device sets must match)."""
    machine: Mapping[str, Any] | None = dataclasses.field(default=None, hash=False)
    """The machine the snapshot was taken on, as its engine describes it (for QEMU: ``qemu_version``,
    ``machine``, ``cpu_model``, ``accel``, ``machine_args``, ``machine_fingerprint``): what an archive
    tells the importing host. None in records written before it was kept."""
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)
    """Free-form JSON-serialisable details: pagemap statistics, environment, recipe hash."""
    owner: SnapshotOwner | None = dataclasses.field(default=None, compare=False, repr=False, hash=False)

    def __post_init__(self) -> None:
        validate_tag(self.tag)
        if self.status not in STATUSES:
            raise SnapshotError(f"snapshot {self.tag!r}: status {self.status!r} is not one of {', '.join(STATUSES)}")
        # Frozen means frozen: the mappings are read-only views of private copies.
        object.__setattr__(self, "path", Path(self.path))
        object.__setattr__(self, "fingerprint", types.MappingProxyType(dict(self.fingerprint)))
        object.__setattr__(self, "extra", types.MappingProxyType(dict(self.extra)))
        if self.network is not None:
            object.__setattr__(self, "network", types.MappingProxyType(dict(self.network)))
        for name, entry in self.files.items():
            if not (
                isinstance(entry, Mapping)
                and isinstance(entry.get("size"), int)
                and entry["size"] >= 0
                and isinstance(entry.get("checksum"), str)
            ):
                raise SnapshotError(
                    f"snapshot {self.tag!r}: files[{name!r}] must hold a 'size' (bytes) and a 'checksum', "
                    f"found {entry!r}"
                )
        object.__setattr__(
            self,
            "files",
            types.MappingProxyType({name: types.MappingProxyType(dict(entry)) for name, entry in self.files.items()}),
        )

    @property
    def state_path(self) -> Path:
        return (self.path / self.state_file).absolute()

    @property
    def memory_path(self) -> Path | None:
        """The flat memory file, or None when the memory is the base's plus a diff."""
        return (self.path / self.memory_file).absolute() if self.memory_file else None

    @property
    def diff_path(self) -> Path | None:
        return (self.path / self.diff_file).absolute() if self.diff_file else None

    @property
    def is_ready(self) -> bool:
        return self.status == "ready"

    def replace(self, **changes: Any) -> Snapshot:
        """A copy with some fields changed (the owner is kept unless changed too)."""
        return dataclasses.replace(self, **changes)

    def with_owner(self, owner: SnapshotOwner | None) -> Snapshot:
        """A copy attached to ``owner``, so that :meth:`fork` can start VMs."""
        return dataclasses.replace(self, owner=owner)

    def fork(self, n: int = 1, *, network: Any = None) -> list[Any]:
        """Start ``n`` copy-on-write children of this snapshot (the owner, a factory, starts them).

        ``network`` gives the children another network policy than the
        snapshot's (mode, allowed host ports, forwards); whether there is a
        network card at all is fixed by the snapshot.
        """
        return self._owner("start VMs").fork_snapshot(self, n, network=network)

    def _owner(self, what: str, otherwise: str = "") -> SnapshotOwner:
        """The owner that does ``what`` for this record; SnapshotError saying how to attach one if none."""
        if self.owner is None:
            raise SnapshotError(
                f"snapshot record {self.tag!r} is not attached to a session, so it cannot {what}: "
                "records read straight from a SnapshotStore are detached; take the snapshot from "
                "the forkd session (its fixtures hand out attached records) or attach one with "
                "snapshot.with_owner(session.factory)" + otherwise
            )
        return self.owner

    def wait_ready(self, timeout: float | None = None) -> Snapshot:
        """Block until the memory is materialised and return the refreshed record.

        Raises SnapshotError if the write failed, if its writer process is gone
        (the write was interrupted and will never finish) or after ``timeout``
        seconds (None waits as long as the writer lives).
        """
        if self.is_ready:
            return self

        def reread() -> Snapshot:
            current = Snapshot.load_from(self.path).with_owner(self.owner)
            if current.status == "failed":
                raise SnapshotError(
                    f"snapshot {self.tag!r} could not be written: {current.error}; remove it and take it again"
                )
            if current.status == "writing" and current.writer_pid is not None:
                if not process_is_alive(current.writer_pid):
                    raise SnapshotError(
                        f"snapshot {self.tag!r} is still marked 'writing' but its writer process "
                        f"{current.writer_pid} is gone, so the write was interrupted; "
                        "remove it and take it again"
                    )
            return current

        def written() -> Snapshot | None:
            current = reread()
            return None if current.status == "writing" else current

        return poll_until(
            written,
            timeout=timeout,
            interval=0.005,
            backoff=0.1,
            what=f"snapshot {self.tag!r} to be written",
            error=lambda message: SnapshotError(
                f"snapshot {self.tag!r} at {self.path} was still being written after {timeout:g} s; "
                "give it a larger timeout, or check the writer process"
            ),
        )

    def export(self, path: Path | str) -> Path:
        """Write this snapshot, with its image, into one portable archive at ``path``; return ``path``.

        Another host (or a fresh cache) imports it with
        :func:`pytest_forkd.import_snapshot` or ``forkd snapshots import`` and forks
        from it without building anything. See :mod:`pytest_forkd.archives.archive`
        (:func:`pytest_forkd.export_snapshot` exports a detached record).
        """
        owner = self._owner("write an archive", ", or export it with pytest_forkd.export_snapshot(snapshot, path)")
        return owner.export_snapshot(self, path)

    def save_to(self, directory: Path | str) -> Path:
        """Write ``snapshot.json`` into ``directory`` atomically and return its path.

        The file is written under a temporary name and renamed over the old one,
        so a concurrent reader sees either the old or the new record, never a mix.
        """
        directory = Path(directory)
        try:
            text = json.dumps(self._to_json(), indent=2) + "\n"
        except (TypeError, ValueError) as exc:
            raise SnapshotError(
                f"snapshot {self.tag!r}: metadata is not JSON-serialisable ({exc}); "
                "keep `extra` to strings, numbers, booleans, None, lists and dicts"
            ) from exc
        target = directory / SNAPSHOT_FILE
        scratch = directory / f".{SNAPSHOT_FILE}.{os.getpid()}.{threading.get_ident()}.tmp"
        scratch.unlink(missing_ok=True)  # left by a crash of this very pid: never adopt its mode
        private.write_bytes(scratch, text.encode("utf-8"))
        os.replace(scratch, target)
        return target

    @classmethod
    def load_from(
        cls,
        directory: Path | str,
        *,
        remedy: str = "remove the snapshot directory and take the snapshot again",
    ) -> Snapshot:
        """Read the record in ``directory/snapshot.json``; ``path`` is set to ``directory``.

        Raises SnapshotError naming the file and the bad field when the file is
        missing, is not JSON or does not describe a snapshot; ``remedy`` is the
        advice appended to that message.
        """
        directory = Path(directory)
        source = directory / SNAPSHOT_FILE

        def damaged(problem: str) -> SnapshotError:
            return SnapshotError(f"cannot read snapshot {source}: {problem}; {remedy}")

        try:
            data = json.loads(source.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise damaged("the file does not exist (not a snapshot, or its writer crashed)") from None
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise damaged(f"not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise damaged(f"expected a JSON object, found {type(data).__name__}")

        version = data.pop("format", None)
        if version not in READABLE_FORMATS:
            raise damaged(
                f"field 'format' is {version!r}, this pytest-forkd reads format "
                f"{' and '.join(map(str, READABLE_FORMATS))} (a different pytest-forkd version wrote it)"
            )
        hints = _field_types()
        unknown = sorted(set(data) - set(hints))
        if unknown:
            raise damaged(f"unknown field(s) {', '.join(map(repr, unknown))}")
        for field in dataclasses.fields(cls):
            if field.name in _NOT_SERIALISED:
                continue
            has_default = field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING
            if field.name not in data:
                if has_default:
                    continue
                raise damaged(f"field {field.name!r} is missing")
            if not _conforms(data[field.name], hints[field.name]):
                raise damaged(
                    f"field {field.name!r} must be {_describe(hints[field.name])}, found {data[field.name]!r}"
                )
        try:
            return cls(path=directory, **data)
        except ForkdError as exc:
            raise damaged(str(exc)) from None

    def _to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"format": FORMAT_VERSION}
        for field in dataclasses.fields(self):
            if field.name in _NOT_SERIALISED:
                continue
            value = getattr(self, field.name)
            if field.name in _OMITTED_WHEN_NONE and value is None:
                continue
            data[field.name] = _plain(value)
        return data


def _plain(value: Any) -> Any:
    """``value`` with read-only mappings turned back into dicts, for json.dumps."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    return value


@functools.cache
def _field_types() -> dict[str, Any]:
    """Resolved type hints of the serialised fields, used to validate snapshot.json."""
    hints = typing.get_type_hints(Snapshot)
    return {name: hint for name, hint in hints.items() if name not in _NOT_SERIALISED}


def _conforms(value: Any, hint: Any) -> bool:
    """Whether a decoded JSON value matches a field's type hint."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return value in typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, option) for option in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is Mapping:
        key_type, value_type = typing.get_args(hint)
        return isinstance(value, dict) and all(
            _conforms(key, key_type) and _conforms(item, value_type) for key, item in value.items()
        )
    if hint is Any:
        return True
    if isinstance(value, bool):  # JSON true/false must not pass for numbers
        return hint is bool
    if hint is float:
        return isinstance(value, (int, float))
    return isinstance(value, hint)


def _describe(hint: Any) -> str:
    """A type hint in words, for error messages."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(hint)))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(option) for option in typing.get_args(hint))
    if hint is type(None):
        return "null"
    if origin is Mapping:
        return "an object"
    return {str: "a string", int: "an integer", float: "a number"}.get(hint, getattr(hint, "__name__", str(hint)))
