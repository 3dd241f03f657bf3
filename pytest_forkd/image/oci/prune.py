"""Removing what no pulled image uses from the container image store: layer blobs and image disks.

A pull of a moved tag replaces its index entry, and the blobs only the old
image had stay in the layout; an interrupted pull leaves the blobs it had
finished. Those go here: every blob that no indexed image's manifest names
(manifest, config, layers), and every disk ``disks/<hex>.ext4`` whose digest
no indexed image has, unless the caller keeps it (a disk a published guest
image still boots from). The layout's own ``index.json`` keeps only the
entries of indexed references. All of it under the store lock, so no pull
writes meanwhile.

Then what this store's Dockerfile builds left in the builders' own storage
(see :mod:`.builder_storage`): the images tagged ``localhost/forkd-build/...``
and the base images a build made the builder pull, each removed with the
builder's ``rmi`` (an image something else still uses stays).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from .importer import layout_name, remove_temporaries
from .store import disks_dir, layout_dir, read_index, referenced_blobs, store_dir, store_lock

__all__ = ["PruneResult", "prune_store", "store_dir"]

DISK_NAME = re.compile(r"([0-9a-f]{64})\.ext4")
REF_NAME_ANNOTATION = "org.opencontainers.image.ref.name"


@dataclass
class PruneResult:
    removed: list[tuple[Path, int]] = field(default_factory=list)  # (path, size in bytes)
    blobs: int = 0
    disks: int = 0
    builder_images: list[tuple[str, str]] = field(default_factory=list)
    """(builder, image name) removed from a builder's storage (or, in a dry run, that would be)."""

    @property
    def freed(self) -> int:
        return sum(size for _path, size in self.removed)


def prune_store(*, keep_disks_of: Iterable[str] = (), dry_run: bool = False, builders: bool = True) -> PruneResult:
    """Remove (or with ``dry_run`` only list) unused blobs and disks; ``keep_disks_of`` are digests to keep.

    ``builders``: also what forkd's builds left in the builders' storage.
    """
    result = PruneResult()
    if not store_dir().is_dir():
        return result
    if builders:
        from .builder_storage import remove_leftovers

        result.builder_images = [(left.builder, left.image) for left in remove_leftovers(dry_run=dry_run)]
    with store_lock():
        index = read_index()
        digests = {entry["digest"] for entry in index.values()}
        kept_blobs: set[str] = set()
        for digest in digests:
            kept_blobs |= referenced_blobs(digest)
        blobs = layout_dir() / "blobs" / "sha256"
        if blobs.is_dir():
            for blob in sorted(blobs.iterdir()):
                if f"sha256:{blob.name}" not in kept_blobs and blob.is_file():
                    result.removed.append((blob, blob.stat().st_size))
                    result.blobs += 1
        kept_disks = digests | set(keep_disks_of)
        if disks_dir().is_dir():
            for disk in sorted(disks_dir().iterdir()):
                match = DISK_NAME.fullmatch(disk.name)
                if match and f"sha256:{match.group(1)}" not in kept_disks and disk.is_file():
                    result.removed.append((disk, disk.stat().st_size))
                    result.disks += 1
        if not dry_run:
            for path, _size in result.removed:
                path.unlink(missing_ok=True)
            remove_temporaries(layout_dir())
            _tidy_layout_index({layout_name(reference) for reference in index})
    return result


def _tidy_layout_index(names: set[str]) -> None:
    """Keep only the layout index.json entries of indexed references (written to a temporary name, renamed)."""
    path = layout_dir() / "index.json"
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    entries = document.get("manifests") if isinstance(document, dict) else None
    if not isinstance(entries, list):
        return
    kept = [
        entry
        for entry in entries
        if isinstance(entry, dict) and (entry.get("annotations") or {}).get(REF_NAME_ANNOTATION) in names
    ]
    if len(kept) == len(entries):
        return
    document["manifests"] = kept
    fd, temporary = tempfile.mkstemp(prefix=".index-", suffix=".tmp", dir=layout_dir())
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(document, handle)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
