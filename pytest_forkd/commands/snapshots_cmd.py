"""``forkd snapshots ls|info|rm``: inspect and prune a snapshot store."""

from __future__ import annotations

import argparse
import json
from datetime import datetime
from pathlib import Path
from typing import Any

from .. import paths
from ..store import SnapshotStore

_SIZE_UNITS = ("KiB", "MiB", "GiB", "TiB")


def add_parser(subparsers: Any) -> None:
    store_option = argparse.ArgumentParser(add_help=False)
    store_option.add_argument(
        "--store",
        type=Path,
        metavar="DIR",
        default=None,
        help="snapshot store directory (default: $FORKD_STORE, else 'snapshots' in the user cache)",
    )
    p = subparsers.add_parser("snapshots", help="list, inspect and remove stored snapshots")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)

    actions.add_parser("ls", parents=[store_option], help="list the snapshots in a store")
    info = actions.add_parser("info", parents=[store_option], help="show everything about one snapshot")
    info.add_argument("tag", metavar="TAG")
    rm = actions.add_parser("rm", parents=[store_option], help="remove a snapshot")
    rm.add_argument("tag", metavar="TAG")
    rm.add_argument("--cascade", action="store_true", help="also remove the snapshots that depend on it")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    actions = {"ls": run_ls, "info": run_info, "rm": run_rm}
    return actions[args.action](args)


def run_ls(args: argparse.Namespace) -> int:
    store = _store(args)
    snapshots = store.list()
    broken = store.broken()
    if not snapshots and not broken:
        print(f"no snapshots in {store.root}")
        return 0
    rows = [("TAG", "BACKEND", "STATUS", "MEMORY", "ON DISK", "BASE", "CREATED (UTC)")]
    for snapshot in snapshots:
        rows.append(
            (
                snapshot.tag,
                snapshot.backend,
                snapshot.status,
                f"{snapshot.memory_mib} MiB",
                _human_bytes(store.disk_usage(snapshot.tag).allocated_bytes),
                snapshot.base or "-",
                _format_created(snapshot.created),
            )
        )
    for entry in broken:
        rows.append(
            (entry.tag, "-", "broken", "-", _human_bytes(store.disk_usage(entry.tag).allocated_bytes), "-", "-")
        )
    _print_table(rows)
    for entry in broken:
        print(f"\n{entry.tag}: {entry.problem}")
    return 0


def run_info(args: argparse.Namespace) -> int:
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


def _store(args: argparse.Namespace) -> SnapshotStore:
    return SnapshotStore(args.store or paths.snapshots_dir())


def _print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


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

