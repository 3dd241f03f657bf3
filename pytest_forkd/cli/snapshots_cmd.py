"""``forkd snapshots ls|info|rm|verify|gc|export|import|build|key``: inspect, check, prune and move snapshots."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_forkd import paths
from pytest_forkd.engine.host import ACCELS
from pytest_forkd.errors import ConfigError
from pytest_forkd.project import lifecycle
from pytest_forkd.storage import integrity
from pytest_forkd.storage.store import SnapshotStore
from pytest_forkd.tables import render_table

if TYPE_CHECKING:
    from pytest_forkd.project.snapshot_builder import SnapshotBuilder

_SIZE_UNITS = ("KiB", "MiB", "GiB", "TiB")


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    store_option = argparse.ArgumentParser(add_help=False)
    store_option.add_argument(
        "--store",
        type=Path,
        metavar="DIR",
        default=None,
        help="snapshot store directory (default: $FORKD_STORE, else 'snapshots' in the user cache)",
    )
    store_option.add_argument(
        "--project",
        type=Path,
        metavar="DIR",
        default=None,
        help="use the snapshots of the project in DIR (where its forkd.yaml is): snapshot names are per project",
    )
    p = subparsers.add_parser("snapshots", help="list, inspect and remove stored snapshots")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)

    ls = actions.add_parser(
        "ls", parents=[store_option], help="list the snapshots in a store: shared ones and the current project's"
    )
    ls.add_argument("--all", action="store_true", help="list the snapshots of every project in the store")
    gc = actions.add_parser(
        "gc",
        parents=[store_option],
        help="remove expired kept failures and apply the store size cap",
        description="Remove failed-<test> snapshots (saved by --forkd-keep-failed) beyond the newest "
        "keep_failed_count or older than keep_failed_age in every project of the store, then, when a "
        "size cap is set (store_max_size), the least recently used recipe snapshots until the store "
        "fits; they are rebuilt when a run needs them. Snapshots someone tagged are never evicted. "
        "Limits come from the options, else forkd.yaml's settings (of --project DIR, else the "
        "current directory), else the defaults (5 failures, 7 days, no cap).",
    )
    gc.add_argument("--keep-failed-count", metavar="N", default=None, help="kept failures to keep per project")
    gc.add_argument(
        "--keep-failed-age", metavar="AGE", default=None, help="remove kept failures older than AGE, e.g. 7d or 12h"
    )
    gc.add_argument("--max-size", metavar="SIZE", default=None, help="store size cap, e.g. 20GiB")
    gc.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    info = actions.add_parser("info", parents=[store_option], help="show everything about one snapshot")
    info.add_argument("tag", metavar="TAG")
    rm = actions.add_parser("rm", parents=[store_option], help="remove a snapshot")
    rm.add_argument("tag", metavar="TAG")
    rm.add_argument("--cascade", action="store_true", help="also remove the snapshots that depend on it")
    export = actions.add_parser(
        "export",
        parents=[store_option],
        help="write a snapshot and its image into one portable archive (zstd-compressed tar)",
        description="Write snapshot NAME, its guest image and a manifest (QEMU version, machine, CPU model, "
        "accelerator, memory size, recipe hash, file checksums) into one archive that "
        "`forkd snapshots import` restores on another host or into a fresh cache. Uses the zstd "
        "tool, or zstd's Python module (the [archive] extra) when the tool is missing.",
    )
    export.add_argument("tag", metavar="NAME")
    export.add_argument(
        "-o", "--output", type=Path, required=True, metavar="FILE", help="archive to write, e.g. base.forkd.tar.zst"
    )
    imp = actions.add_parser(
        "import",
        parents=[store_option],
        help="restore a snapshot archive into a store (checks QEMU, machine and CPU first)",
        description="Check that this host can restore the archive (same QEMU version and machine, same CPU for "
        "a KVM -cpu host snapshot), verify every file's checksum and publish the snapshot and its "
        "image atomically: nothing half-imported stays behind.",
    )
    imp.add_argument("archive", type=Path, metavar="FILE")
    imp.add_argument("--replace", action="store_true", help="overwrite a snapshot of the same name")
    imp.add_argument("--name", metavar="NAME", default=None, help="import under another name")
    project_options = argparse.ArgumentParser(add_help=False)
    project_options.add_argument("names", nargs="+", metavar="NAME", help="base, or snapshots forkd.yaml declares")
    project_options.add_argument(
        "--config",
        type=Path,
        metavar="PATH",
        default=None,
        help="project file declaring the snapshots (default: forkd.yaml here, if any)",
    )
    project_options.add_argument(
        "--accel",
        choices=ACCELS,
        default="auto",
        help="accelerator, as the test runs will use it (default: %(default)s)",
    )
    actions.add_parser(
        "build",
        parents=[store_option, project_options],
        help="build (or find cached) named snapshots without running tests, e.g. in a CI job that exports them",
    )
    actions.add_parser(
        "key",
        parents=[store_option, project_options],
        help="print a cache key for named snapshots: QEMU version, accelerator and their recipe hashes",
        description="Print one line naming the QEMU version, the accelerator and a hash of the named snapshots' "
        "recipe hashes, without building any snapshot: a CI cache key that changes exactly when the "
        "snapshots would be rebuilt. The guest image is built first when missing.",
    )
    verify = actions.add_parser(
        "verify",
        parents=[store_option],
        help="check snapshots' files against their recorded sizes and checksums",
        description="Recompute the checksum of every file of the named snapshots (all when none is named) and "
        "compare it, and the size, with what was recorded when the snapshot was stored. Exit status 1 "
        "when a snapshot is damaged; remove it with `forkd snapshots rm TAG` and take it again.",
    )
    verify.add_argument("tags", metavar="TAG", nargs="*", help="snapshots to verify (default: all)")
    verify.add_argument(
        "--quick",
        action="store_true",
        help="check sizes (and files modified since they were stored) only, as a restore does",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    actions = {
        "ls": run_ls,
        "info": run_info,
        "rm": run_rm,
        "verify": run_verify,
        "gc": run_gc,
        "export": run_export,
        "import": run_import,
        "build": run_build,
        "key": run_key,
    }
    return actions[args.action](args)


def run_ls(args: argparse.Namespace) -> int:
    stores = _listed_stores(args)
    now = time.time()
    rows = [("TAG", "BACKEND", "STATUS", "MEMORY", "ON DISK", "BASE", "CREATED (UTC)", "AGE", "LAST USED", "PROJECT")]
    every_broken = []
    every_snapshot = []
    for project, store in stores:
        snapshots = store.list()
        broken = store.broken()
        every_broken += [(store, entry) for entry in broken]
        every_snapshot += [(store, snapshot) for snapshot in snapshots]
        for snapshot in snapshots:
            rows.append(
                (
                    snapshot.tag,
                    snapshot.backend,
                    "damaged" if integrity.problems(snapshot, sizes_only=True) else snapshot.status,
                    f"{snapshot.memory_mib} MiB",
                    _human_bytes(store.disk_usage(snapshot.tag).allocated_bytes),
                    snapshot.base or "-",
                    _format_created(snapshot.created),
                    lifecycle.describe_age(now - lifecycle.created_at(snapshot)),
                    lifecycle.describe_age(now - lifecycle.last_used(snapshot)) + " ago",
                    project or "shared",
                )
            )
        for entry in broken:
            rows.append(
                (
                    entry.tag,
                    "-",
                    "broken",
                    "-",
                    _human_bytes(store.disk_usage(entry.tag).allocated_bytes),
                    "-",
                    "-",
                    "-",
                    "-",
                    project or "shared",
                )
            )
    if len(rows) == 1:
        print(f"no snapshots in {stores[0][1].root}")
        return 0
    print(render_table(rows[1:], rows[0]))
    for _store_of, entry in every_broken:
        print(f"\n{entry.tag}: {entry.problem}")
    for store, snapshot in every_snapshot:
        found = integrity.problems(snapshot, sizes_only=True)
        if found:
            print(
                f"\n{snapshot.tag}: damaged: {'; '.join(found)}; remove it with "
                f"`{store._rm_command(snapshot.tag)}` and take it again"
            )
    return 0


def run_info(args: argparse.Namespace) -> int:
    from pytest_forkd.engine.network import network_from_record

    store = _store(args)
    snapshot = store.get(args.tag)
    usage = store.disk_usage(snapshot.tag)
    fields: list[tuple[str, Any]] = [
        ("tag", snapshot.tag),
        ("path", snapshot.path),
        ("status", snapshot.status),
        ("error", snapshot.error),
        ("backend", snapshot.backend),
        ("image", snapshot.image),
        ("memory", f"{snapshot.memory_mib} MiB"),
        ("vcpus", snapshot.vcpus),
        ("network", network_from_record(snapshot.network).describe()),
        ("created", snapshot.created),
        ("parent", snapshot.parent),
        ("base", snapshot.base),
        ("state file", snapshot.state_file),
        ("memory file", snapshot.memory_file),
        ("diff file", snapshot.diff_file),
        ("pause", _milliseconds(snapshot.pause_ms)),
        ("total", _milliseconds(snapshot.total_ms)),
        ("bytes written", snapshot.bytes_written),
        ("dirty bytes", snapshot.dirty_bytes),
        ("writer pid", snapshot.writer_pid),
        (
            "files",
            ", ".join(f"{name} {entry['size']} B {entry['checksum']}" for name, entry in snapshot.files.items())
            or None,
        ),
        (
            "size on disk",
            f"{_human_bytes(usage.allocated_bytes)} allocated, {_human_bytes(usage.apparent_bytes)} apparent",
        ),
        ("base chain", " -> ".join(link.tag for link in store.base_chain(snapshot.tag))),
        ("dependents", ", ".join(dependent.tag for dependent in store.dependents(snapshot.tag)) or "none"),
    ]
    width = max(len(name) for name, _value in fields) + 1
    for name, value in fields:
        if value is not None:
            print(f"{name + ':':<{width}} {value}")
    for title, mapping in (("fingerprint", snapshot.fingerprint), ("extra", snapshot.extra)):
        if mapping:
            print(f"{title}:")
            for key, value in mapping.items():
                print(f"  {key}: {value if isinstance(value, str) else json.dumps(value)}")
    return 0


def run_rm(args: argparse.Namespace) -> int:
    store = _store(args)
    for tag in store.remove(args.tag, cascade=args.cascade):
        print(f"removed {tag}")
    return 0


def run_export(args: argparse.Namespace) -> int:
    from pytest_forkd.archives.archive import export_snapshot

    root = SnapshotStore(args.store or paths.snapshots_dir())
    project = _project_dir(args.project) if args.project is not None else None
    info = export_snapshot(lifecycle.find_snapshot(root, args.tag, project), args.output)
    print(
        f"exported {args.tag!r} to {info.path}: {_human_bytes(info.archive_bytes)} "
        f"({_human_bytes(info.memory_bytes)} of guest memory, {_human_bytes(info.stored_memory_bytes)} non-zero; "
        f"QEMU {info.manifest['qemu_version']}, {info.manifest['accel']}, -cpu {info.manifest['cpu_model']}) "
        f"in {info.seconds:.1f} s"
    )
    return 0


def run_import(args: argparse.Namespace) -> int:
    from pytest_forkd.archives.archive import import_archive

    project = _project_dir(args.project) if args.project is not None else None
    info = import_archive(
        args.archive, store=args.store or paths.snapshots_dir(), replace=args.replace, name=args.name, project=project
    )
    assert info.snapshot is not None
    print(
        f"imported {info.snapshot.tag!r} into {info.snapshot.path.parent} from {info.path} "
        f"(recipe {info.manifest.get('recipe_hash') or '-'}, image {info.manifest['image']['key']}) "
        f"in {info.seconds:.1f} s"
    )
    return 0


def run_build(args: argparse.Namespace) -> int:
    with _builder(args) as builder:
        for name in args.names:
            snapshot = builder.get(name)
            event = builder.events[-1]
            print(
                f"{snapshot.tag}: {event.action} (recipe {snapshot.extra.get('recipe_hash') or '-'}) "
                f"in {snapshot.path.parent}"
            )
    return 0


def run_key(args: argparse.Namespace) -> int:
    from pytest_forkd.project.snapshot_builder import recipe_key

    with _builder(args) as builder:
        print(recipe_key(builder, args.names))
    return 0


@contextmanager
def _builder(args: argparse.Namespace) -> Iterator[SnapshotBuilder]:
    """A snapshot builder for the project file and store the arguments name; closes its VMs after."""
    from pytest_forkd.core.factory import VMFactory
    from pytest_forkd.project.config import EMPTY_PROJECT, PROJECT_FILE, load_project
    from pytest_forkd.project.snapshot_builder import SnapshotBuilder

    folder = _project_dir(args.project) if args.project is not None else _current_project()
    config = args.config or (folder / PROJECT_FILE if folder is not None else None)
    project = load_project(config) if config is not None else EMPTY_PROJECT
    root = (
        SnapshotStore(args.store)
        if args.store
        else (SnapshotStore(project.settings["store"]) if project.settings.get("store") else SnapshotStore.persistent())
    )
    store = lifecycle.project_store(root, project.root) if project.root is not None else root
    factory = VMFactory(accel=args.accel, progress=lambda line: print(line, file=sys.stderr))
    try:
        yield SnapshotBuilder(
            factory, store, project, shared_store=root, progress=lambda line: print(line, file=sys.stderr)
        )
    finally:
        factory.close()


def run_verify(args: argparse.Namespace) -> int:
    store = _store(args)
    snapshots = [store.get(tag) for tag in args.tags] if args.tags else store.list()
    damaged = []
    for snapshot in snapshots:
        if snapshot.status != "ready":
            print(f"{snapshot.tag}: {snapshot.status}, not checked")
            continue
        found = integrity.problems(snapshot, full=not args.quick)
        unrecorded = "" if snapshot.files else " (sizes only: stored before checksums were recorded)"
        if found:
            damaged.append(snapshot.tag)
            print(f"{snapshot.tag}: DAMAGED: {'; '.join(found)}")
        else:
            print(f"{snapshot.tag}: ok{unrecorded}")
    for entry in [] if args.tags else store.broken():
        damaged.append(entry.tag)
        print(f"{entry.tag}: DAMAGED: {entry.problem}")
    if damaged:
        command = store._rm_command(damaged[0]).replace(damaged[0], "TAG")
        print(
            f"{len(damaged)} damaged snapshot(s): {', '.join(damaged)}; remove each with `{command}` and take it "
            "again (snapshots declared in forkd.yaml are rebuilt by the next run)",
            file=sys.stderr,
        )
        return 1
    return 0


def _store(args: argparse.Namespace) -> SnapshotStore:
    root = SnapshotStore(args.store or paths.snapshots_dir())
    project = getattr(args, "project", None)
    if project is None:
        return root
    return lifecycle.project_store(root, _project_dir(project))


def _project_dir(path: Path) -> Path:
    if not path.is_dir():
        raise ConfigError(f"--project {path}: no such directory; name the directory that holds forkd.yaml")
    return path


def _current_project() -> Path | None:
    return lifecycle.current_project()


def _listed_stores(args: argparse.Namespace) -> list[tuple[str | None, SnapshotStore]]:
    """What ``ls`` shows: every namespace (--all), else the shared snapshots and one project's."""
    root = SnapshotStore(args.store or paths.snapshots_dir())
    if args.all:
        return list(lifecycle.namespaces(root))
    project = _project_dir(args.project) if args.project is not None else _current_project()
    stores: list[tuple[str | None, SnapshotStore]] = [(None, root)]
    if project is not None:
        stores.append((lifecycle.project_id(project), lifecycle.project_store(root, project)))
    return stores


def run_gc(args: argparse.Namespace) -> int:
    root = SnapshotStore(args.store or paths.snapshots_dir())
    settings = _project_settings(args)
    keep = (
        lifecycle.parse_count(args.keep_failed_count, "--keep-failed-count")
        if args.keep_failed_count is not None
        else settings.get("keep_failed_count", lifecycle.DEFAULT_KEEP_FAILED_COUNT)
    )
    age = (
        lifecycle.parse_age(args.keep_failed_age, "--keep-failed-age")
        if args.keep_failed_age is not None
        else settings.get("keep_failed_age", lifecycle.DEFAULT_KEEP_FAILED_AGE_S)
    )
    cap = (
        lifecycle.parse_size(args.max_size, "--max-size")
        if args.max_size is not None
        else settings.get("store_max_size")
    )
    removals = lifecycle.gc(root, keep_failed=keep, keep_failed_age_s=age, max_bytes=cap, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for removal in removals:
        where = f" (project {removal.project})" if removal.project else ""
        print(f"{verb} {removal.tag}{where}, {_human_bytes(removal.bytes)}: {removal.reason}")
    freed = sum(removal.bytes for removal in removals)
    print(
        f"{len(removals)} snapshot(s), {_human_bytes(freed)} {'would be ' if args.dry_run else ''}freed; "
        f"the store now holds {_human_bytes(lifecycle.total_bytes(root))}"
    )
    return 0


def _project_settings(args: argparse.Namespace) -> dict[str, Any]:
    """forkd.yaml's validated ``settings:`` of --project DIR, else of the current project (none: empty)."""
    from pytest_forkd.project.config import PROJECT_FILE, load_project

    folder = _project_dir(args.project) if args.project is not None else _current_project()
    if folder is None or not (folder / PROJECT_FILE).is_file():
        return {}
    return dict(load_project(folder / PROJECT_FILE).settings)


def _human_bytes(count: int) -> str:
    if count < 1024:
        return f"{count} B"
    size = count / 1024
    unit = 0
    while size >= 1024 and unit < len(_SIZE_UNITS) - 1:
        size /= 1024
        unit += 1
    return f"{size:.1f} {_SIZE_UNITS[unit]}"


def _format_created(created: str) -> str:
    try:
        return datetime.fromisoformat(created).strftime("%Y-%m-%d %H:%M:%S")
    except ValueError:  # written by hand or by another tool: show it as it is
        return created


def _milliseconds(value: float | None) -> str | None:
    return None if value is None else f"{value:.1f} ms"
