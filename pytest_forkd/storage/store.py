"""The on-disk snapshot store: atomic publication of write-once snapshots.

Layout of a store root::

    <tag>/snapshot.json, <tag>/<device state>, <tag>/<memory or diff>   published snapshots
    .tmp-<tag>-<pid>-<random>/      being written by process <pid>; never read
    .trash-<tag>-<pid>-<random>/    being deleted by process <pid>
    .locks/<tag>.lock               serialises builders of one tag across processes

Directories are created 0700 and files 0600 (see :mod:`pytest_forkd.private`):
memory files hold guest RAM. Every data file's size and checksum is recorded
in the snapshot's metadata when it is stored (``Snapshot.files``, see
:mod:`pytest_forkd.storage.integrity`); :meth:`SnapshotStore.check_restorable` checks
the sizes before every restore and :meth:`SnapshotStore.verify` the checksums.
Opening a store removes snapshots left ``writing`` by a process that is gone.

Children map memory files copy-on-write, and MAP_PRIVATE does not protect them
from later writes to the file, so a published file is never written again:
snapshots are assembled in a temporary directory and appear under their tag
with one ``rename``; replacing or removing one first renames it out of the way
(processes that still map its files keep them alive) and only then deletes it.
"""

from __future__ import annotations

import builtins
import errno
import functools
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Callable, NamedTuple, TypeVar

import filelock

from pytest_forkd import paths, private
from pytest_forkd.engine import space
from pytest_forkd.errors import (
    BackendError,
    DamagedSnapshot,
    IncompatibleSnapshot,
    InvalidArgument,
    SnapshotError,
    UnknownSnapshot,
)
from pytest_forkd.filesystems import Remedy, unwritable_text
from pytest_forkd.paths import validate_tag
from pytest_forkd.storage import integrity, leftovers
from pytest_forkd.storage.leftovers import DEFAULT_STALE_AGE_S as DEFAULT_STALE_AGE_S  # where archives find it
from pytest_forkd.storage.snapshot import SNAPSHOT_FILE, Snapshot, this_host, writer_is_alive

log = logging.getLogger(__name__)
_T = TypeVar("_T")

_LOCKS_DIR = ".locks"
#: What to do when the store's filesystem is full or read-only.
_REMEDY = Remedy(
    room=space.STORE_HINT,
    elsewhere="build or import it where the store is writable, or point --forkd-store (or FORKD_STORE, or "
    "--store) at a writable directory",
)

# Fields complete() and attach_memory() set themselves.
_COMPLETION_FIELDS = frozenset(
    {"tag", "path", "owner", "status", "error", "writer_pid", "writer_host", "memory_file", "files"}
)


def _os_errors_as_store_errors(method: Callable[..., _T]) -> Callable[..., _T]:
    """An OSError while writing the store (permissions, full disk) becomes a SnapshotError with the fix."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> _T:
        try:
            return method(self, *args, **kwargs)
        except OSError as exc:
            store = self if isinstance(self, SnapshotStore) else self.store
            raise store._unwritable(exc) from exc

    return wrapper


class DiskUsage(NamedTuple):
    """Bytes a snapshot's own files take: apparent size, and blocks really allocated.

    Sparse diff files and hole-punched memory files allocate far less than
    their apparent size. Files shared with a base snapshot are not counted.
    """

    apparent_bytes: int
    allocated_bytes: int


class BrokenEntry(NamedTuple):
    """A directory in the store that does not hold a readable snapshot."""

    tag: str
    path: Path
    problem: str


class PendingSnapshot:
    """A snapshot being written: data files go into :attr:`dir`, then :meth:`publish`.

    Use it as a context manager: leaving the block without publishing (on an
    exception, say) removes the temporary directory.
    """

    def __init__(self, store: SnapshotStore, tag: str, directory: Path, replace: bool) -> None:
        self.store = store
        self.tag = tag
        self.dir = directory
        self.replace = replace
        self._finished = False

    def __enter__(self) -> PendingSnapshot:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.abort()

    @_os_errors_as_store_errors
    def publish(self, snapshot: Snapshot) -> Snapshot:
        """Write ``snapshot.json`` and make the snapshot visible under its tag, atomically.

        ``snapshot.path`` may be anything (the temporary directory, say); the
        returned record points at the published directory. A record published
        with status ``writing`` may lack its memory file; :meth:`SnapshotStore.complete`
        adds it later.
        """
        if self._finished:
            raise SnapshotError(f"snapshot {self.tag!r} was already published or aborted")
        if snapshot.tag != self.tag:
            raise SnapshotError(
                f"the record's tag {snapshot.tag!r} does not match the snapshot being written, "
                f"{self.tag!r}; publish a record with tag {self.tag!r}"
            )
        self._check_files(snapshot)
        if snapshot.status == "writing" and snapshot.writer_pid is None:
            snapshot = snapshot.replace(writer_pid=os.getpid())
        if snapshot.status == "writing" and snapshot.writer_host is None:
            snapshot = snapshot.replace(writer_host=this_host())
        _keep_private(self.dir)
        snapshot = snapshot.replace(files=self._record_files(snapshot))
        snapshot.save_to(self.dir)
        final = self.store.root / self.tag
        trash = None
        if self.replace and final.exists():
            self.store._refuse_replacing_a_base(self.tag)
            trash = self.store._move_to_trash(self.tag)
        try:
            os.rename(self.dir, final)
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                # Another process published this tag meanwhile; its snapshot stands.
                if trash is not None:
                    shutil.rmtree(trash, ignore_errors=True)
                raise self.store._already_exists(self.tag) from None
            if trash is not None:
                os.rename(trash, final)  # put the old snapshot back
            raise
        self._finished = True
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        _fsync_directory(self.store.root)
        return snapshot.replace(path=final)

    def abort(self) -> None:
        """Discard everything written so far (nothing happens after a publish)."""
        if not self._finished:
            shutil.rmtree(self.dir, ignore_errors=True)
            self._finished = True

    def _record_files(self, snapshot: Snapshot) -> dict[str, dict[str, Any]]:
        """Size and checksum of the data files written so far (the VM is running again by now).

        A record that arrives with ``files`` already (a copy of another
        snapshot, an import) must match what was written: a copy that differs
        from its source is refused instead of stored.
        """
        records = integrity.record_files(self.dir, integrity.data_files(snapshot))
        differing = [
            name
            for name, entry in records.items()
            if name in snapshot.files
            and (snapshot.files[name]["size"], snapshot.files[name]["checksum"]) != (entry["size"], entry["checksum"])
        ]
        if differing:
            raise DamagedSnapshot(
                f"snapshot {self.tag!r}: {', '.join(differing)} written into {self.dir} differ(s) from the "
                "size and checksum recorded with the snapshot it was copied from; the source is damaged or the "
                f"copy was interrupted: verify the source (`forkd snapshots verify`) and copy it again",
                tag=self.tag,
                problems=[f"{name} differs from its source" for name in differing],
            )
        return records

    def _check_files(self, snapshot: Snapshot) -> None:
        """Refuse a record whose files are not in the temporary directory, or whose base is unusable."""
        expected: dict[str, str | None] = {}
        if snapshot.status != "writing":  # a background writer may still produce the state too
            expected.update(
                state_file=snapshot.state_file, memory_file=snapshot.memory_file, diff_file=snapshot.diff_file
            )
        for field, name in expected.items():
            if name is not None and not (self.dir / name).is_file():
                raise SnapshotError(
                    f"snapshot {self.tag!r}: {field} {name!r} was not written into {self.dir}; "
                    "write every data file into PendingSnapshot.dir before publishing"
                )
        if snapshot.memory_file is None and snapshot.base is None:
            raise SnapshotError(
                f"snapshot {self.tag!r} has neither a memory_file nor a base; "
                "give it its own memory file or the tag of the base its diff applies to"
            )
        # A base in another store (a persistent one, say) cannot be checked from here.
        if snapshot.base is not None and self.store.exists(snapshot.base):
            base = self.store.get(snapshot.base)
            if base.memory_file is None:
                raise SnapshotError(
                    f"snapshot {self.tag!r}: its base {base.tag!r} is itself a diff; diffs apply "
                    f"to flat memory only, so use {base.base!r} (the base of {base.tag!r}) instead"
                )


class SnapshotStore:
    """A directory of published snapshots, one sub-directory per tag.

    The persistent store is :func:`paths.snapshots_dir` (see :meth:`persistent`);
    a session keeps its own checkpoints in a store under its run directory.
    """

    def __init__(self, root: Path | str, *, clean: bool = True) -> None:
        """Open the store at ``root`` (created on first write, mode 0700).

        Opening removes snapshots left ``writing`` by a process that no
        longer exists (see :meth:`clean_interrupted`); ``clean=False`` skips
        that, for code that only locates a snapshot's directory.
        """
        self.root = Path(root)
        if clean:
            try:
                self.clean_interrupted()
            except OSError as exc:  # a store we may read but not write (another user's): reading still works
                log.debug("could not clean interrupted snapshots in %s: %s", self.root, exc)

    @classmethod
    def persistent(cls) -> SnapshotStore:
        """The store shared by all runs: ``$FORKD_STORE`` or the user cache."""
        return cls(paths.snapshots_dir())

    def __repr__(self) -> str:
        return f"SnapshotStore({str(self.root)!r})"

    # -- writing ---------------------------------------------------------

    def begin(self, tag: str, *, replace: bool = False) -> PendingSnapshot:
        """Start writing snapshot ``tag`` into a fresh temporary directory.

        Without ``replace`` an existing ``tag`` is an error (checked now, so no
        time is spent writing, and again when publishing). With ``replace`` the
        old snapshot is moved aside and deleted when the new one is published;
        its files are never written to.
        """
        validate_tag(tag)
        self._require_writable(f"write snapshot {tag!r}")
        if self.exists(tag):
            if not replace:
                raise self._already_exists(tag)
            self._refuse_replacing_a_base(tag)
        return PendingSnapshot(self, tag, self._make_temp_dir(tag), replace)

    def scratch_dir(self, tag: str) -> Path:
        """A fresh directory on the store's filesystem for a file :meth:`complete` will adopt.

        A background writer materialises memory here; the directory is removed
        by :meth:`complete`, or by :meth:`clean_stale_temp` if the writer dies.
        """
        validate_tag(tag)
        return self._make_temp_dir(tag)

    @_os_errors_as_store_errors
    def complete(
        self,
        tag: str,
        memory_file_tmp_path: Path | str,
        final_name: str,
        *,
        state_file_tmp_path: Path | str | None = None,
        **fields: Any,
    ) -> Snapshot:
        """Finish a ``writing`` snapshot: move its memory file in and mark it ready.

        ``memory_file_tmp_path`` must be on the store's filesystem (see
        :meth:`scratch_dir`); it is renamed to ``final_name`` inside the snapshot
        directory, then ``snapshot.json`` is rewritten with status ``ready`` and
        ``fields`` (timings, sizes, extra). A writer that produces the device
        state in the background too passes it as ``state_file_tmp_path``.
        """
        _refuse_fields("complete", fields, _COMPLETION_FIELDS)
        snapshot = self.get(tag)
        if snapshot.status != "writing":
            raise SnapshotError(
                f"cannot complete snapshot {tag!r}: its status is {snapshot.status!r}, and only "
                "snapshots published with status 'writing' are finished later"
            )
        if snapshot.memory_file not in (None, final_name):
            raise SnapshotError(
                f"snapshot {tag!r} was published with memory_file {snapshot.memory_file!r}; "
                f"complete it with that name, not {final_name!r}"
            )
        if state_file_tmp_path is not None:
            self._adopt_file(snapshot, Path(state_file_tmp_path), snapshot.state_file)
        self._adopt_file(snapshot, Path(memory_file_tmp_path), final_name)
        if not snapshot.state_path.is_file():
            raise SnapshotError(f"cannot complete snapshot {tag!r}: its device state {snapshot.state_path} is missing")
        files = {**snapshot.files, **integrity.record_files(snapshot.path, [snapshot.state_file, final_name])}
        ready = snapshot.replace(
            **fields, memory_file=final_name, status="ready", error=None, writer_pid=None, writer_host=None, files=files
        )
        ready.save_to(snapshot.path)
        return ready

    @_os_errors_as_store_errors
    def attach_memory(self, tag: str, memory_file_tmp_path: Path | str, final_name: str, **fields: Any) -> Snapshot:
        """Give a ready diff snapshot flat memory of its own (a diff flattened in the background).

        The flat file is moved in as for :meth:`complete`; from then on children
        map it instead of applying the diff to the base, so the snapshot no
        longer depends on its base (``base`` becomes None and the base may be
        removed). The diff file stays, untouched, for readers of the old record.
        """
        _refuse_fields("attach_memory", fields, _COMPLETION_FIELDS | {"base"})
        snapshot = self.get(tag)
        if snapshot.status != "ready" or snapshot.memory_file is not None:
            raise SnapshotError(
                f"cannot attach memory to snapshot {tag!r}: only a ready diff snapshot without a memory "
                f"file takes one, and this one is {snapshot.status!r} with memory_file {snapshot.memory_file!r}"
            )
        self._adopt_file(snapshot, Path(memory_file_tmp_path), final_name)
        files = {**snapshot.files, **integrity.record_files(snapshot.path, [final_name])}
        flattened = snapshot.replace(**fields, memory_file=final_name, base=None, files=files)
        flattened.save_to(snapshot.path)
        return flattened

    @_os_errors_as_store_errors
    def fail(self, tag: str, error: str) -> Snapshot:
        """Mark a ``writing`` snapshot as failed with ``error``, for everyone waiting on it."""
        snapshot = self.get(tag)
        if snapshot.status != "writing":
            raise SnapshotError(
                f"cannot mark snapshot {tag!r} failed: its status is {snapshot.status!r}, and only "
                "snapshots published with status 'writing' can fail later"
            )
        failed = snapshot.replace(status="failed", error=error, writer_pid=None, writer_host=None)
        failed.save_to(failed.path)
        return failed

    def lock(self, tag: str, timeout: float = -1) -> filelock.FileLock:
        """An inter-process lock for building ``tag`` once (pytest-xdist workers).

        ``timeout`` is in seconds; -1 waits forever.
        """
        validate_tag(tag)
        self._require_writable(f"lock snapshot {tag!r} for building")
        try:
            locks = private.make_dir(self.root / _LOCKS_DIR)
        except OSError as exc:
            raise self._unwritable(exc) from exc
        return filelock.FileLock(locks / f"{tag}.lock", timeout=timeout, mode=private.FILE_MODE)

    def read_only_reason(self) -> str | None:
        """Why nothing can be written into this store (a read-only mount, no permission), or None.

        A shared store is often mounted read-only on the hosts that only run
        tests: they restore from it and must never try to write there.
        """
        existing = self.root
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        try:
            if os.statvfs(existing).f_flag & os.ST_RDONLY:
                return f"{existing} is on a read-only filesystem"
        except OSError as exc:
            return f"{existing} cannot be examined ({exc.strerror or exc})"
        mode = existing.stat().st_mode
        if not mode & 0o222:  # made read-only on purpose (chmod a-w); root could still write, but must not
            return f"{existing} is read-only (mode {mode & 0o7777:04o})"
        if not os.access(existing, os.W_OK | os.X_OK):
            return f"{existing} is not writable by this user"
        return None

    def _require_writable(self, action: str) -> None:
        problem = self.read_only_reason()
        if problem is not None:
            raise SnapshotError(
                f"cannot {action} in the snapshot store {self.root}: {problem}; build or import it where the "
                "store is writable, or point --forkd-store (or FORKD_STORE) at a writable directory"
            )

    # -- reading ---------------------------------------------------------

    def exists(self, tag: str) -> bool:
        validate_tag(tag)
        return (self.root / tag).is_dir()

    def get(self, tag: str) -> Snapshot:
        """The published snapshot ``tag``; UnknownSnapshot lists what the store has."""
        validate_tag(tag)
        directory = self.root / tag
        if not directory.is_dir():
            available = ", ".join(sorted(snapshot.tag for snapshot in self.list())) or "none yet"
            raise UnknownSnapshot(
                f"unknown snapshot {tag!r} in {self.root}; available: {available}. "
                f"Check the name, take the snapshot first (checkpoint or branch a VM as {tag!r}), "
                "or point --forkd-store (or FORKD_STORE) at the store that holds it"
            )
        return self._load(directory)

    def list(self) -> list[Snapshot]:
        """Readable snapshots, oldest first; see :meth:`broken` for the others."""
        return self._scan()[0]

    def broken(self) -> builtins.list[BrokenEntry]:
        """Directories under a tag name that hold no readable snapshot."""
        return self._scan()[1]

    def dependents(self, tag: str) -> builtins.list[Snapshot]:
        """Snapshots that need ``tag``: whose parent or base it is, and whatever is based on those.

        Oldest first.
        """
        validate_tag(tag)
        snapshots = self.list()
        direct = {snapshot.tag for snapshot in snapshots if tag in (snapshot.parent, snapshot.base)}
        return _with_diffs_on(snapshots, direct, exclude=tag)

    def base_chain(self, tag: str) -> builtins.list[Snapshot]:
        """``tag`` followed by its base, its base's base...: what restoring it reads."""
        chain = [self.get(tag)]
        while chain[-1].base is not None:
            base_tag = chain[-1].base
            if any(snapshot.tag == base_tag for snapshot in chain):
                raise SnapshotError(
                    f"snapshot {tag!r}: its bases form a cycle through {base_tag!r}; "
                    f"remove it with `{self._rm_command(tag)}`"
                )
            if not self.exists(base_tag):
                raise SnapshotError(
                    f"snapshot {chain[-1].tag!r} is a diff against {base_tag!r}, which is missing "
                    f"from {self.root}, so it cannot be restored; remove it with "
                    f"`{self._rm_command(chain[-1].tag)}` and take it again"
                )
            chain.append(self.get(base_tag))
        return chain

    def disk_usage(self, tag: str) -> DiskUsage:
        """Apparent and allocated bytes of the files in the snapshot's directory."""
        validate_tag(tag)
        directory = self.root / tag
        if not directory.is_dir():
            self.get(tag)  # raises UnknownSnapshot with the helpful message
        apparent = allocated = 0
        for folder, _subfolders, files in os.walk(directory):
            for name in files:
                try:
                    status = os.lstat(os.path.join(folder, name))
                except FileNotFoundError:  # removed while we looked
                    continue
                apparent += status.st_size
                allocated += status.st_blocks * 512
        return DiskUsage(apparent, allocated)

    def check_restorable(self, snapshot: Snapshot) -> None:
        """Raise DamagedSnapshot unless ``snapshot``'s files (and its base's) are intact enough to restore.

        Cheap: a ``stat`` per file (sizes), plus a full checksum of a file
        only when it was modified after it was recorded. Runs before every
        restore, so a truncated memory file is refused with its name and the
        fix instead of a QEMU size error.
        """
        self._verify_one(snapshot, full=False)
        if snapshot.base is not None and snapshot.memory_file is None:
            base = resolve_base(snapshot, self)
            SnapshotStore(base.path.parent, clean=False)._verify_one(base, full=False, needed_by=snapshot.tag)

    def verify(self, tag: str, *, full: bool = True) -> Snapshot:
        """Check every file of snapshot ``tag`` against its recorded size and checksum.

        Raises DamagedSnapshot naming each damaged file and the command that
        removes the snapshot; returns the snapshot when it is intact. This is
        ``forkd snapshots verify``.
        """
        return self._verify_one(self.get(tag), full=full)

    def _verify_one(self, snapshot: Snapshot, *, full: bool, needed_by: str | None = None) -> Snapshot:
        remedy = f"remove it with `{self._rm_command(snapshot.tag)}` and take it again"
        if needed_by is not None:
            remedy += f" (with --cascade: snapshot {needed_by!r} is a diff against it)"
        remedy += "; a snapshot declared in forkd.yaml is rebuilt by itself on the next run"
        return integrity.verify_snapshot(snapshot, full=full, remedy=remedy)

    def check_compatible(self, snapshot: Snapshot, fingerprint: Mapping[str, str]) -> None:
        """Raise IncompatibleSnapshot unless ``snapshot`` was taken with this ``fingerprint``.

        A child must run the same QEMU with the same machine arguments and image
        as the VM that was snapshotted; the message names every difference.
        """
        missing = "<not recorded>"
        differences = [
            f"{key}: snapshot has {snapshot.fingerprint.get(key, missing)!r}, now {fingerprint.get(key, missing)!r}"
            for key in sorted(set(snapshot.fingerprint) | set(fingerprint))
            if snapshot.fingerprint.get(key) != fingerprint.get(key)
        ]
        if differences:
            raise IncompatibleSnapshot(
                f"snapshot {snapshot.tag!r} was taken with a different setup ("
                + "; ".join(differences)
                + f"). Rebuild it: `{self._rm_command(snapshot.tag)}`, then rerun; "
                "or use the QEMU/image it was taken with"
            )

    # -- removing --------------------------------------------------------

    @_os_errors_as_store_errors
    def remove(self, tag: str, *, cascade: bool = False) -> builtins.list[str]:
        """Delete ``tag`` (and with ``cascade`` its dependents); return the removed tags.

        Works on damaged snapshots too. Each directory is renamed away before it
        is deleted, so no reader sees a half-deleted snapshot.
        """
        validate_tag(tag)
        if not (self.root / tag).is_dir():
            self.get(tag)  # raises UnknownSnapshot with the helpful message
        self._require_writable(f"remove snapshot {tag!r}")
        dependents = self.dependents(tag)
        if not cascade:
            self._refuse_if_depended_on(tag, "remove", dependents)
        doomed = [snapshot.tag for snapshot in dependents]
        removed = []
        # Newest first, so a failure midway never leaves a dependent without what it needs.
        for victim in [*reversed(doomed), tag]:
            try:
                trash = self._move_to_trash(victim)
            except FileNotFoundError:  # removed by another process meanwhile
                continue
            shutil.rmtree(trash, ignore_errors=True)
            removed.append(victim)
        return removed

    def clean_interrupted(self) -> builtins.list[str]:
        """Remove snapshots left ``writing`` by a process that no longer exists; return their tags.

        A live branch (uffd) publishes its snapshot as ``writing`` and a
        background thread completes it; if its process is killed meanwhile,
        the snapshot would say ``writing`` forever. A writer on another host
        is never judged from here. A snapshot that others depend on is marked
        ``failed`` instead of removed.
        """
        if not self.root.is_dir():
            return []
        cleaned = []
        for snapshot in self.list():
            if snapshot.status != "writing" or snapshot.writer_pid is None:
                continue
            if writer_is_alive(snapshot.writer_pid, snapshot.writer_host):
                continue
            reason = (
                f"its writer process {snapshot.writer_pid} ended before the memory was written "
                "(killed?); take the snapshot again"
            )
            if self.dependents(snapshot.tag):
                try:
                    self.fail(snapshot.tag, reason)
                except SnapshotError:  # completed meanwhile
                    continue
            else:
                try:
                    shutil.rmtree(self._move_to_trash(snapshot.tag), ignore_errors=True)
                except FileNotFoundError:  # removed by another process meanwhile
                    continue
            log.info("snapshot %s in %s: %s", snapshot.tag, self.root, reason)
            cleaned.append(snapshot.tag)
        return cleaned

    def clean_stale_temp(self, max_age_s: float = DEFAULT_STALE_AGE_S) -> builtins.list[Path]:
        """Remove temporary and trash directories left by dead processes; return them.

        A directory goes when the process that created it (its pid is in the
        name) is gone, or when it is older than ``max_age_s`` whatever the pid
        (and only then if its name carries no pid). Called at session start.
        See :mod:`pytest_forkd.storage.leftovers`.
        """
        return leftovers.remove_stale(self.root, max_age_s)

    # -- internals -------------------------------------------------------

    def _scan(self) -> tuple[builtins.list[Snapshot], builtins.list[BrokenEntry]]:
        snapshots: builtins.list[Snapshot] = []
        broken: builtins.list[BrokenEntry] = []
        if not self.root.is_dir():
            return snapshots, broken
        for entry in sorted(os.scandir(self.root), key=lambda entry: entry.name):
            if not paths.TAG_PATTERN.fullmatch(entry.name) or not entry.is_dir():
                continue  # temporary, trash and lock directories, or not ours
            try:
                snapshots.append(self._load(Path(entry.path)))
            except SnapshotError as exc:
                broken.append(BrokenEntry(entry.name, Path(entry.path), str(exc)))
        snapshots.sort(key=lambda snapshot: (snapshot.created, snapshot.tag))
        return snapshots, broken

    def _load(self, directory: Path) -> Snapshot:
        tag = directory.name
        remedy = f"remove it with `{self._rm_command(tag)}` and take it again"
        snapshot = Snapshot.load_from(directory, remedy=remedy)
        if snapshot.tag != tag:
            raise SnapshotError(
                f"{directory / SNAPSHOT_FILE} says tag {snapshot.tag!r} but lives in directory "
                f"{tag!r} (renamed by hand?); rename the directory back to {snapshot.tag!r} or {remedy}"
            )
        return snapshot

    def _adopt_file(self, snapshot: Snapshot, source: Path, final_name: str) -> None:
        """Rename ``source`` into the published ``snapshot`` as ``final_name``; never overwrite."""
        if final_name != Path(final_name).name or final_name.startswith(".") or final_name == SNAPSHOT_FILE:
            raise SnapshotError(
                f"snapshot {snapshot.tag!r}: memory file name {final_name!r} must be a plain file name, "
                f"not hidden and not {SNAPSHOT_FILE!r}"
            )
        destination = snapshot.path / final_name
        if destination.exists():
            raise SnapshotError(
                f"snapshot {snapshot.tag!r} already has {destination}; published files are never overwritten"
            )
        try:
            os.rename(source, destination)
        except OSError as exc:
            if exc.errno == errno.EXDEV:
                raise SnapshotError(
                    f"cannot move {source} into snapshot {snapshot.tag!r}: it is on another filesystem "
                    f"than the store {self.root}; write it into SnapshotStore.scratch_dir() instead"
                ) from None
            raise
        if source.parent.parent == self.root and source.parent.name.startswith(leftovers.TEMP_PREFIX):
            try:
                source.parent.rmdir()
            except OSError:  # the writer left other files there; clean_stale_temp will get them
                pass

    def _make_temp_dir(self, tag: str) -> Path:
        directory = self.root / leftovers.temp_name(tag)
        try:
            private.make_dir(self.root)
            directory.mkdir(mode=private.DIR_MODE)
        except OSError as exc:
            raise self._unwritable(exc) from exc
        return directory

    def _unwritable(self, exc: OSError) -> SnapshotError:
        unwritable = unwritable_text(exc, self.root, "writing into the snapshot store", _REMEDY)
        if unwritable is not None:
            return SnapshotError(unwritable)
        return SnapshotError(
            f"cannot write into the snapshot store {self.root}: {exc.strerror or exc}"
            + (f" ({exc.filename})" if exc.filename else "")
            + "; fix its permissions or free space, or use another store (--forkd-store, FORKD_STORE or --store)"
        )

    def _move_to_trash(self, tag: str) -> Path:
        trash = self.root / leftovers.trash_name(tag)
        os.rename(self.root / tag, trash)
        return trash

    def _refuse_if_depended_on(self, tag: str, action: str, dependents: builtins.list[Snapshot]) -> None:
        if dependents:
            names = ", ".join(f"{snapshot.tag} ({_relation(snapshot, tag)})" for snapshot in dependents)
            raise SnapshotError(
                f"cannot {action} snapshot {tag!r}: other snapshots depend on it: {names}; "
                f"remove them first, or remove them all with `{self._rm_command(tag)} --cascade`"
            )

    def _refuse_replacing_a_base(self, tag: str) -> None:
        """Replacing the memory a diff applies to would silently corrupt the diff's children.

        Snapshots that only descend from ``tag`` (parent) do not read its files,
        so they do not prevent replacing it.
        """
        snapshots = self.list()
        direct = {snapshot.tag for snapshot in snapshots if snapshot.base == tag}
        self._refuse_if_depended_on(tag, "replace", _with_diffs_on(snapshots, direct, exclude=tag))

    def _already_exists(self, tag: str) -> SnapshotError:
        return SnapshotError(
            f"snapshot {tag!r} already exists in {self.root}; remove it with "
            f"`{self._rm_command(tag)}` or choose another tag"
        )

    def _rm_command(self, tag: str) -> str:
        """The command that removes ``tag`` from this store, for error messages."""
        command = f"forkd snapshots rm {tag}"
        if self.root.absolute() != paths.snapshots_dir().absolute():
            command += f" --store {self.root}"
        return command


def _refuse_fields(method: str, fields: Mapping[str, Any], forbidden: frozenset[str]) -> None:
    clashing = sorted(forbidden & set(fields))
    if clashing:
        raise InvalidArgument(f"{method}() sets {', '.join(clashing)} itself; do not pass them")


def _with_diffs_on(snapshots: list[Snapshot], tags: set[str], exclude: str) -> list[Snapshot]:
    """``tags`` plus every snapshot whose base is among them, transitively; oldest first."""
    found = set(tags)
    while True:
        based_on_found = {snapshot.tag for snapshot in snapshots if snapshot.base in found}
        if based_on_found <= found:
            break
        found |= based_on_found
    found.discard(exclude)
    return [snapshot for snapshot in snapshots if snapshot.tag in found]


def _relation(snapshot: Snapshot, tag: str) -> str:
    """How ``snapshot`` depends on ``tag``, for error messages."""
    if snapshot.base == tag:
        return "diff against it"
    if snapshot.parent == tag:
        return "descends from it"
    return f"diff against {snapshot.base}, which depends on it"


def _keep_private(directory: Path) -> None:
    """Take group and other permissions off files a backend wrote into a pending directory.

    Built-in backends create their files 0600; a third-party one may not.
    The pending directory is 0700 and not yet published, so nobody else can
    have opened what is in it: this is the last moment to fix modes safely.
    """
    for entry in os.scandir(directory):
        status = entry.stat(follow_symlinks=False)
        if status.st_mode & 0o077 and not entry.is_symlink():
            os.chmod(entry.path, status.st_mode & 0o700)


def _fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (a no-op cost on tmpfs)."""
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def resolve_base(snapshot: Snapshot, store: SnapshotStore) -> Snapshot:
    """The snapshot whose flat memory ``snapshot``'s diff applies to.

    A session's checkpoints live in a store on /dev/shm while their base may be
    a persistent snapshot in the user cache, so the base's directory is kept
    in ``extra["base_dir"]`` and used when the store does not hold the tag.
    """
    if snapshot.base is None:
        raise BackendError(f"snapshot {snapshot.tag!r} has neither a memory file nor a base")
    if store.exists(snapshot.base):
        return store.get(snapshot.base)
    base_dir = snapshot.extra.get("base_dir")
    if base_dir and Path(base_dir).is_dir():
        return Snapshot.load_from(Path(base_dir))
    raise BackendError(
        f"base {snapshot.base!r} of snapshot {snapshot.tag!r} is gone (not in {store.root}"
        + (f" nor at {base_dir}" if base_dir else "")
        + "); take the snapshot again"
    )
