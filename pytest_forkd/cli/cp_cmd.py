"""``forkd cp``: copy files and trees out of a snapshot, or into a new snapshot made from one.

One side names a path in a snapshot as ``TAG:/guest/path``, the other a path
on this machine. Both directions work in a copy-on-write child of the
snapshot, which is killed at the end, so the snapshot itself never changes:

- ``forkd cp base:/etc/os-release ./os-release`` copies out of a child;
- ``forkd cp ./src base:/srv/app --save with-app`` copies into a child and
  saves that child as the new snapshot ``with-app`` (next to ``base``: the
  current project's namespace when run inside one), which tests then start
  from (``--forkd-snapshot=with-app``) and ``forkd shell with-app`` opens.

The destination names the copy itself (see :mod:`pytest_forkd.core.copy`):
``./src`` copied to ``base:/srv/app`` gives ``/srv/app/setup.py``. A local
path that looks like ``TAG:/path`` is written ``./TAG:/path``.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass

from pytest_forkd.core.copy import CopyResult
from pytest_forkd.core.factory import VMFactory
from pytest_forkd.core.vm import VM
from pytest_forkd.engine.host import ACCELS
from pytest_forkd.errors import InvalidArgument
from pytest_forkd.paths import validate_tag
from pytest_forkd.project import lifecycle
from pytest_forkd.storage.snapshot import Snapshot
from pytest_forkd.storage.store import SnapshotStore

_REMOTE = re.compile(r"^(?P<tag>[A-Za-z0-9_-]{1,64}):(?P<path>/.*)$")
_USAGE = (
    "usage: forkd cp TAG:/guest/path LOCAL (copy out of a child of snapshot TAG), or "
    "forkd cp LOCAL TAG:/guest/path --save NEWTAG (copy into a child, saved as snapshot NEWTAG)"
)


@dataclass(frozen=True)
class GuestSide:
    tag: str
    path: str


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "cp",
        help="copy files or trees out of a snapshot, or into a new snapshot made from one",
        description="Copy between this machine and a copy-on-write child of a stored snapshot; one side is "
        "TAG:/guest/path. Out: forkd cp base:/etc/os-release ./os-release. In (saved as a new "
        "snapshot, the old one never changes): forkd cp ./src base:/srv/app --save with-app. "
        "The destination names the copy itself: ./src to base:/srv/app gives /srv/app/<files of src>. "
        "Modes, symbolic links and modification times are kept.",
    )
    p.add_argument("source", metavar="SRC", help="LOCAL path, or TAG:/guest/path")
    p.add_argument("destination", metavar="DEST", help="TAG:/guest/path, or LOCAL path")
    p.add_argument("--save", metavar="NEWTAG", help="copying in: save the child as this new snapshot (required)")
    p.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="PATTERN",
        help="leave out names (*.pyc, .git) or relative paths (build/*) matching this glob; repeatable",
    )
    p.add_argument("--store", metavar="DIR", help="snapshot store (default: $FORKD_STORE or the user cache)")
    p.add_argument("--accel", choices=ACCELS, default="auto", help="accelerator (default: %(default)s)")
    p.set_defaults(run=run)


def guest_side(text: str) -> GuestSide | None:
    """``TAG:/path`` as a snapshot path, or None for a local path."""
    match = _REMOTE.match(text)
    return GuestSide(match["tag"], match["path"]) if match else None


def run(args: argparse.Namespace) -> int:
    source, destination = guest_side(args.source), guest_side(args.destination)
    if (source is None) == (destination is None):
        both = "both name a snapshot path" if source else "neither names a snapshot path (TAG:/guest/path)"
        raise InvalidArgument(f"forkd cp: {args.source!r} and {args.destination!r}: {both}; {_USAGE}")
    if destination is not None and not args.save:
        raise InvalidArgument(
            f"forkd cp: copying into snapshot {destination.tag!r} needs --save NEWTAG: a snapshot never changes, so "
            f"the copy is saved as a new one (e.g. forkd cp {args.source} {args.destination} --save "
            f"{destination.tag}-copy)"
        )
    if source is not None and args.save:
        raise InvalidArgument(
            "forkd cp: --save only applies when copying into a snapshot; copying out of "
            f"{source.tag!r} changes nothing to save"
        )
    if destination is not None:
        validate_tag(args.save)
        if args.save == destination.tag:
            raise InvalidArgument(
                f"forkd cp: --save {args.save} would replace the snapshot the copy starts from; pick a new tag"
            )
    root = SnapshotStore(args.store) if args.store else SnapshotStore.persistent()
    snapshot = lifecycle.find_snapshot(root, (source or destination).tag)  # type: ignore[union-attr]
    factory = VMFactory(accel=args.accel, progress=lambda line: print(line, file=sys.stderr))
    try:
        vm = factory.fork_snapshot(snapshot, 1)[0]
        if source is not None:
            result = vm.copy_out(source.path, args.destination, exclude=args.exclude)
            _report(result, f"{args.source} -> {args.destination}")
            return 0
        assert destination is not None
        result = vm.copy_in(args.source, destination.path, exclude=args.exclude)
        saved = _save(
            factory,
            vm,
            root,
            args.save,
            extra={"copied_into": destination.path, "copied_from_snapshot": destination.tag},
        )
        _report(result, f"{args.source} -> {args.save}:{destination.path}")
        print(
            f"forkd: saved snapshot {saved.tag!r} (from {destination.tag!r} plus the copy) in {saved.path.parent}",
            file=sys.stderr,
        )
        return 0
    finally:
        factory.close()


def _save(factory: VMFactory, vm: VM, root: SnapshotStore, tag: str, *, extra: dict[str, object]) -> Snapshot:
    """Branch the child (a flat copy) and publish it as ``tag`` where ``forkd shell``/tests find it."""
    from pytest_forkd.project.snapshot_builder import publish_copy

    project = lifecycle.current_project()
    store = lifecycle.project_store(root, project) if project is not None else root
    staged = vm.branch(backend="full")
    try:
        return publish_copy(staged, store, tag, extra=extra)
    finally:
        factory.session_store.remove(staged.tag)


def _report(result: CopyResult, what: str) -> None:
    skipped = f", {result.skipped} special files skipped" if result.skipped else ""
    print(
        f"forkd: copied {what}: {result.files} entries, {result.bytes} bytes in {result.seconds:.1f} s "
        f"({result.mib_per_s:.1f} MiB/s){skipped}",
        file=sys.stderr,
    )
