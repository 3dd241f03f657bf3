"""What changed in a guest's filesystem since a checkpoint or snapshot: :class:`Changes`.

How it works, and why it is fast:

1. When a checkpoint is taken, the guest records a manifest (see
   :mod:`pytest_forkd.analysis.manifest`: one ``lstat`` per path, no content read) in
   /run/forkd/manifests/<tag>, *before* the snapshot, so the manifest is part of
   the checkpoint's state and of every state descending from it. Finding it in
   the guest later also proves the lineage: a VM restored to something older,
   or a sibling, does not have it.
2. ``changes()`` walks the guest again and compares both manifests on the host.
   Added and deleted paths, and mode, owner, type and symlink-target changes
   follow from metadata alone; a regular file whose size changed has new content.
3. Only files whose size is unchanged but whose inode or ctime moved need their
   content compared. Their new content is hashed in the VM; their old content
   lives in the checkpoint snapshot, so a copy-on-write child of it is started
   (once, on demand) and hashes them there. The same child serves ``diff()``
   and ``read_old()``: old content is never copied at checkpoint time.

A snapshot taken without a manifest (``vm.branch()``, or the snapshot a VM was
forked from) works too: the child of that snapshot records the old manifest.
"""

from __future__ import annotations

import difflib
import fnmatch
import secrets
import threading
import weakref
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pytest_forkd.analysis.manifest import (
    DEFAULT_EXCLUDES,
    GUEST_MANIFESTS,
    Entry,
    Manifest,
    ManifestFormatError,
    hash_command,
    walk_command,
)
from pytest_forkd.core.handles import VMHandle
from pytest_forkd.errors import ChangesError, ForkdError
from pytest_forkd.guest.client import GuestOSError
from pytest_forkd.storage.snapshot import Snapshot


class _Since(Protocol):
    """A checkpoint as a comparison point (see :class:`~pytest_forkd.core.checkpoint.Checkpoint`)."""

    @property
    def snapshot(self) -> Snapshot: ...

    @property
    def tag(self) -> str: ...


Status = Literal["added", "modified", "deleted"]
#: What a modification can be about.
ASPECTS = ("type", "content", "mode", "owner", "target")
_DIFF_LIMIT = 1 << 20


class Paths(frozenset[str]):
    """A set of guest paths, iterated in sorted order.

    Compares equal to any set, list or tuple of the same paths, so both
    ``changes.added == {"/a", "/b"}`` and ``== ["/a", "/b"]`` read naturally
    in an assertion.
    """

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(frozenset.__iter__(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple)):
            return len(other) == len(self) and frozenset(other) == frozenset(self)
        return frozenset.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = frozenset.__hash__

    def __repr__(self) -> str:
        return "{" + ", ".join(repr(path) for path in self) + "}" if self else "Paths()"


@dataclass(frozen=True)
class Change:
    """One changed path: ``status`` and, for a modification, which ``aspects`` changed."""

    path: str
    status: Status
    aspects: frozenset[str] = frozenset()
    old: Entry | None = None
    new: Entry | None = None

    def describe(self) -> str:
        letter = {"added": "A", "modified": "M", "deleted": "D"}[self.status]
        entry = self.new or self.old
        kind = f" ({entry.kind})" if entry is not None and entry.kind != "file" else ""
        details = []
        old, new = self.old, self.new
        if old is not None and new is not None:
            if "type" in self.aspects:
                details.append(f"type {old.kind} -> {new.kind}")
            if "content" in self.aspects:
                details.append("content" + (f" {old.size} -> {new.size} bytes" if old.size != new.size else ""))
            if "mode" in self.aspects:
                details.append(f"mode {old.permissions:04o} -> {new.permissions:04o}")
            if "owner" in self.aspects:
                details.append(f"owner {old.uid}:{old.gid} -> {new.uid}:{new.gid}")
            if "target" in self.aspects:
                details.append(f"target {old.target!r} -> {new.target!r}")
        elif new is not None and new.kind == "symlink":
            details.append(f"-> {new.target}")
        return f"{letter} {self.path}{kind}" + (f"  [{'; '.join(details)}]" if details else "")


class _PathFilter:
    """``include``/``exclude`` items: absolute paths (the path and what is below it) or glob patterns."""

    def __init__(self, items: Iterable[str], what: str) -> None:
        if isinstance(items, str):
            items = (items,)
        self.items = tuple(items)
        for item in self.items:
            if not isinstance(item, str) or not item.startswith("/"):
                raise ChangesError(
                    f"{what} entries are absolute guest paths or glob patterns starting with '/', got {item!r}"
                )
            for excluded in DEFAULT_EXCLUDES:
                if what == "include" and (item == excluded or item.startswith(excluded + "/")):
                    raise ChangesError(
                        f"include={item!r} lies under {excluded}, which is never recorded "
                        f"(default excludes: {', '.join(DEFAULT_EXCLUDES)}); include another path"
                    )

    @staticmethod
    def _matches(item: str, path: str) -> bool:
        if any(char in item for char in "*?["):
            return fnmatch.fnmatchcase(path, item)
        item = item.rstrip("/") or "/"
        return item == "/" or path == item or path.startswith(item + "/")

    def match(self, path: str) -> bool:
        return any(self._matches(item, path) for item in self.items)

    def unmatched(self, paths: Iterable[str]) -> list[str]:
        remaining = set(self.items)
        for path in paths:
            remaining -= {item for item in remaining if self._matches(item, path)}
            if not remaining:
                break
        return sorted(remaining)


def compare(
    old: Manifest, new: Manifest, *, include: Iterable[str] = (), exclude: Iterable[str] = ()
) -> tuple[dict[str, Change], list[str]]:
    """Changes between two manifests, and the paths whose content must be compared by hash.

    Content candidates are regular files present in both with equal size but a
    different inode or ctime; they are reported as modified only if their
    content hashes differ (:func:`resolve_candidates`). Directories are added,
    deleted, or modified in mode/owner only: their entries are reported themselves.
    """
    includes, excludes = _PathFilter(include, "include"), _PathFilter(exclude, "exclude")
    every = old.entries.keys() | new.entries.keys()
    for name, path_filter in (("include", includes), ("exclude", excludes)):
        missing = path_filter.unmatched(every)
        if missing:
            raise ChangesError(
                f"{name} filter {', '.join(map(repr, missing))} matches no path of the guest, then or now; "
                f"check the spelling (filters are absolute paths or globs such as '/srv/*.py')"
            )

    def wanted(path: str) -> bool:
        return (not includes.items or includes.match(path)) and not excludes.match(path)

    changes: dict[str, Change] = {}
    candidates: list[str] = []
    for path in every:
        if not wanted(path):
            continue
        before, after = old.entries.get(path), new.entries.get(path)
        if before is None:
            changes[path] = Change(path, "added", new=after)
            continue
        if after is None:
            changes[path] = Change(path, "deleted", old=before)
            continue
        aspects = set()
        if before.kind != after.kind:
            aspects |= {"type", "content"}
        else:
            if after.kind == "file":
                if before.size != after.size:
                    aspects.add("content")
                elif (before.inode, before.ctime_ns) != (after.inode, after.ctime_ns):
                    candidates.append(path)
            elif after.kind == "symlink" and before.target != after.target:
                aspects.add("target")
        if before.permissions != after.permissions and after.kind != "symlink":
            aspects.add("mode")
        if (before.uid, before.gid) != (after.uid, after.gid):
            aspects.add("owner")
        if aspects:
            changes[path] = Change(path, "modified", frozenset(aspects), before, after)
    return changes, sorted(candidates)


def resolve_candidates(
    changes: dict[str, Change],
    candidates: list[str],
    old: Manifest,
    new: Manifest,
    old_hashes: list[str],
    new_hashes: list[str],
) -> None:
    """Mark the candidates whose content hash differs as content modifications (in place)."""
    for path, before_hash, after_hash in zip(candidates, old_hashes, new_hashes):
        if before_hash != after_hash:
            existing = changes.get(path)
            aspects = (existing.aspects if existing else frozenset()) | {"content"}
            changes[path] = Change(path, "modified", aspects, old.entries[path], new.entries[path])


class _OldState:
    """A copy-on-write child of the 'since' snapshot, to hash and read the old content.

    :meth:`start` forks it in a background thread, so that its start overlaps
    the walk of the current filesystem (host work against guest work);
    :attr:`child` waits for it, or forks it then.
    """

    def __init__(self, vm: VMHandle, snapshot: Snapshot) -> None:
        self._vm = vm
        self._snapshot = snapshot
        self._child: VMHandle | None = None
        self._pending: Future[VMHandle] | None = None

    def _fork(self) -> VMHandle:
        child: VMHandle = self._vm.factory.fork_snapshot(self._snapshot, 1)[0]
        return child

    def start(self) -> None:
        if self._child is None and self._pending is None:
            self._pending = Future()
            pending = self._pending

            def run() -> None:
                try:
                    pending.set_result(self._fork())
                except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the child
                    pending.set_exception(exc)

            threading.Thread(target=run, name="forkd-changes-old-state", daemon=True).start()

    @property
    def child(self) -> VMHandle:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._child = pending.result()
        if self._child is None or self._child.closed:
            self._child = self._fork()
        return self._child

    def close(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                self._child = pending.result()
            except BaseException:  # noqa: BLE001 - nothing was started, nothing to close
                pass
        child, self._child = self._child, None
        if child is not None:
            child.close()


def _guest_exec(vm: VMHandle, argv: list[str], what: str, stdin: bytes | None = None) -> Any:
    result = vm._exec_untracked(argv, stdin=stdin)
    if result.exit_code != 0:
        raise ChangesError(
            f"{what} failed in VM {vm.name} (exit {result.exit_code}): "
            f"{result.stderr.strip()[-500:] or 'no output'}; the guest image needs python3"
        )
    return result


def record_manifest(vm: VMHandle, label: str) -> str:
    """Walk ``vm``'s filesystem into /run/forkd/manifests/<label>; returns the guest path."""
    path = f"{GUEST_MANIFESTS}/{label}"
    _guest_exec(vm, walk_command(path, label), "recording a filesystem manifest")
    return path


def _read_manifest(vm: VMHandle, path: str) -> Manifest:
    try:
        return Manifest.parse(vm._read_file_untracked(path))
    except ManifestFormatError as exc:
        raise ChangesError(
            f"the manifest {path} in VM {vm.name} is unreadable ({exc}); it was written by "
            "another pytest-forkd version: take a new checkpoint"
        ) from None


def _current_manifest(vm: VMHandle) -> Manifest:
    label = f"now-{secrets.token_hex(4)}"
    path = record_manifest(vm, label)
    try:
        return _read_manifest(vm, path)
    finally:
        vm._exec_untracked(["rm", "-f", path])


def _hashes(vm: VMHandle, paths: list[str]) -> list[str]:
    """sha256 of each path's content in ``vm`` ('-' for a path that cannot be read)."""
    if not paths:
        return []
    result = vm._exec_untracked(hash_command(), stdin=b"\0".join(p.encode("utf-8", "surrogateescape") for p in paths))
    digests: dict[str, str] = {}
    for line in result.stdout_bytes.decode("utf-8", "surrogateescape").splitlines():
        digest, sep, path = line.partition("  ")
        if sep:
            digests[path] = digest
    return [digests.get(path, "-") for path in paths]


def _since_snapshot(vm: VMHandle, since: _Since | Snapshot | None) -> tuple[Snapshot, str]:
    if since is None:
        if vm.origin is None:
            raise ChangesError(
                f"VM {vm.name} was booted, not started from a snapshot: pass since=checkpoint "
                "(take one with vm.checkpoint()) to say since when"
            )
        return vm.origin, f"snapshot {vm.origin.tag} (where VM {vm.name} started)"
    if isinstance(since, Snapshot):
        return since, f"snapshot {since.tag}"
    if isinstance(getattr(since, "snapshot", None), Snapshot):
        return since.snapshot, f"checkpoint {since.tag}"
    raise ChangesError(f"since= takes a Checkpoint or a Snapshot, got {type(since).__name__}: {since!r}")


def changes_since(
    vm: VMHandle, since: _Since | Snapshot | None = None, *, include: Iterable[str] = (), exclude: Iterable[str] = ()
) -> Changes:
    """What changed in ``vm``'s filesystem since ``since`` (see :meth:`pytest_forkd.core.vm.VM.changes`)."""
    snapshot, label = _since_snapshot(vm, since)
    old_state = _OldState(vm, snapshot)
    try:
        old = _recorded_manifest(vm, snapshot)
        if old is None:
            if not vm.transcript.descends_from(snapshot):
                raise ChangesError(
                    f"{label} is not in the lineage of VM {vm.name}: the VM's state was not made from it (it was "
                    f"taken of another VM, or this VM was restored to an older state since). Compare with a "
                    f"checkpoint of this VM, or with vm.origin ({vm.origin.tag if vm.origin else 'none'})"
                )
            with ThreadPoolExecutor(1, thread_name_prefix="forkd-changes-old-walk") as executor:
                walking = executor.submit(lambda: _current_manifest(old_state.child))  # both guests walk at once
                new = _current_manifest(vm)
                old = walking.result()
        else:
            old_state.start()  # overlaps the walk below; hashing and diff() need it
            new = _current_manifest(vm)
        changes, candidates = compare(old, new, include=include, exclude=exclude)
        if candidates:
            resolve_candidates(
                changes, candidates, old, new, _hashes(old_state.child, candidates), _hashes(vm, candidates)
            )
    except BaseException:
        old_state.close()
        raise
    return Changes(vm, label, changes, old_state)


def _recorded_manifest(vm: VMHandle, snapshot: Snapshot) -> Manifest | None:
    """The manifest the guest recorded when ``snapshot`` was taken as a checkpoint, if it has it."""
    try:
        data = vm._read_file_untracked(f"{GUEST_MANIFESTS}/{snapshot.tag}")
    except GuestOSError:
        return None
    try:
        manifest = Manifest.parse(data)
    except ManifestFormatError:
        return None
    return manifest if manifest.label == snapshot.tag else None


class Changes:
    """Paths added, modified and deleted in a guest since a checkpoint or snapshot.

    ``added``, ``modified`` and ``deleted`` are :class:`Paths` (sets that also
    compare equal to lists); ``changes[path]`` is the :class:`Change` with what
    was modified (``aspects``: content, mode, owner, target, type).
    ``read(path)`` returns the content now, ``read_old(path)`` the content at
    the checkpoint, ``diff(path)`` a unified diff of a text file. Reading old
    content starts a copy-on-write child of the checkpoint: :meth:`close` it
    (or use ``with``) when done; it is also closed when this object is
    collected and when its VM's factory closes.
    """

    def __init__(self, vm: VMHandle, since: str, changes: dict[str, Change], old_state: _OldState) -> None:
        self.vm = vm
        self.since = since
        """What the changes are relative to, in words."""
        self._changes = dict(sorted(changes.items()))
        self._old = old_state
        self._finalizer = weakref.finalize(self, old_state.close)

    def _with(self, status: Status) -> Paths:
        return Paths(path for path, change in self._changes.items() if change.status == status)

    @property
    def added(self) -> Paths:
        return self._with("added")

    @property
    def modified(self) -> Paths:
        return self._with("modified")

    @property
    def deleted(self) -> Paths:
        return self._with("deleted")

    @property
    def paths(self) -> Paths:
        """Every changed path."""
        return Paths(self._changes)

    def __getitem__(self, path: str) -> Change:
        try:
            return self._changes[path]
        except KeyError:
            raise KeyError(f"{path} did not change since {self.since}") from None

    def __contains__(self, path: object) -> bool:
        return path in self._changes

    def __iter__(self) -> Iterator[Change]:
        return iter(self._changes.values())

    def __len__(self) -> int:
        return len(self._changes)

    def __bool__(self) -> bool:
        return bool(self._changes)

    # -- content ------------------------------------------------------------------------------------------
    def read(self, path: str) -> bytes:
        """The content of ``path`` now (an added or modified file)."""
        change = self[path]
        if change.status == "deleted":
            raise ChangesError(
                f"{path} was deleted since {self.since}: it has no new content (read_old() has the old one)"
            )
        return self.vm._read_file_untracked(path)

    def read_old(self, path: str) -> bytes:
        """The content of ``path`` at the checkpoint (a modified or deleted file)."""
        change = self[path]
        if change.status == "added":
            raise ChangesError(f"{path} was added since {self.since}: it has no old content")
        return self._old.child._read_file_untracked(path)

    def diff(self, path: str, *, context: int = 3) -> str:
        """A unified diff of text file ``path`` between the checkpoint and now ('' if only metadata changed)."""
        change = self[path]
        entry = change.new or change.old
        if entry is None or entry.kind != "file" or (change.old is not None and change.old.kind != "file"):
            raise ChangesError(
                f"{path} is a {entry.kind if entry else '?'}, not a regular file: diff() compares "
                f"text files; see changes[{path!r}] for what changed"
            )
        old = b"" if change.status == "added" else self.read_old(path)
        new = b"" if change.status == "deleted" else self.read(path)
        texts = []
        for label, data in (("old", old), ("new", new)):
            if len(data) > _DIFF_LIMIT or b"\0" in data[:8192]:
                raise ChangesError(
                    f"{path} ({label} content, {len(data)} bytes) is not a text file; compare "
                    f"read_old() and read() instead"
                )
            texts.append(data.decode("utf-8", "replace").splitlines(keepends=True))
        return "".join(difflib.unified_diff(texts[0], texts[1], f"a{path}", f"b{path}", n=context))

    # -- lifecycle and display ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the child VM that serves old content, if one was started."""
        self._finalizer()

    def __enter__(self) -> Changes:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def summary(self) -> str:
        counts = ", ".join(f"{len(self._with(status))} {status}" for status in ("added", "modified", "deleted"))
        return f"changes since {self.since}: {counts}"

    def lines(self, limit: int = 200) -> list[str]:
        """The summary and one line per changed path (A/M/D), at most ``limit`` of them."""
        rows = [change.describe() for change in self._changes.values()]
        shown = rows[:limit]
        if len(rows) > limit:
            shown.append(f"... and {len(rows) - limit} more")
        return [self.summary()] + [f"  {row}" for row in shown]

    def __repr__(self) -> str:
        return "\n".join(self.lines())

    def __str__(self) -> str:
        return self.__repr__()


def explain_comparison(op: str, left: object, right: object) -> list[str] | None:
    """Lines pytest shows for a failed ``==`` involving a Changes or a set of changed paths."""
    if op != "==":
        return None
    if isinstance(left, Changes) or isinstance(right, Changes):
        changes = left if isinstance(left, Changes) else right
        assert isinstance(changes, Changes)
        return [
            f"{changes.summary()} (compare .added, .modified or .deleted with a set of paths)",
            *changes.lines(50)[1:],
        ]
    if (
        isinstance(left, Paths)
        and isinstance(right, (set, frozenset, list, tuple))
        or isinstance(right, Paths)
        and isinstance(left, (set, frozenset, list, tuple))
    ):
        paths, other = (left, right) if isinstance(left, Paths) else (right, left)
        other_set = set(other)
        lines = [f"{len(paths)} changed paths, {len(other_set)} expected:"]
        extra, missing = sorted(set(paths) - other_set), sorted(other_set - set(paths))
        lines += [f"  unexpected: {path}" for path in extra[:50]]
        lines += [f"  missing:    {path}" for path in missing[:50]]
        return lines
    return None


__all__ = ["Change", "Changes", "ForkdError", "Paths", "changes_since", "compare", "record_manifest"]
