"""Project namespaces in a snapshot store: where a project's own snapshots live.

Two projects that both declare a snapshot ``web`` must not overwrite each
other's, so a project's snapshots live in a store of its own under
``<store>/.projects/<project id>/``; the id comes from the real path of the
directory holding forkd.yaml (:func:`project_id`). Shared snapshots (the
built-in ``base``, ``shared: true`` ones, runs without forkd.yaml) live in
the store root. This is the store's layout, so it sits in the storage layer:
archives and the CLI find a project's snapshots without the project layer.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from pytest_forkd.paths import PROJECT_FILE
from pytest_forkd.storage.store import SnapshotStore

#: Directory of the store root that holds one namespace (a store) per project.
PROJECTS_DIR: Final = ".projects"

__all__ = ["PROJECTS_DIR", "current_project", "namespaces", "project_id", "project_store"]


def project_id(project_dir: Path | str) -> str:
    """The namespace of the project rooted at ``project_dir``: its name and a hash of its real path.

    The real path, so a project reached through a symlink is the same
    project; the name, so ``forkd snapshots ls --all`` is readable.
    """
    real = os.path.realpath(project_dir)
    name = re.sub(r"[^A-Za-z0-9_-]+", "_", os.path.basename(real)).strip("_")[:40] or "project"
    return f"{name}-{hashlib.sha256(real.encode()).hexdigest()[:12]}"


def project_store(root: SnapshotStore | Path | str, project_dir: Path | str) -> SnapshotStore:
    """The namespace of the project at ``project_dir`` inside the store at ``root``."""
    root_path = root.root if isinstance(root, SnapshotStore) else Path(root)
    return SnapshotStore(root_path / PROJECTS_DIR / project_id(project_dir))


def namespaces(root: SnapshotStore) -> Iterator[tuple[str | None, SnapshotStore]]:
    """The store root (``None``) and every project namespace in it, as (project id, store)."""
    yield None, root
    projects = root.root / PROJECTS_DIR
    if projects.is_dir():
        for entry in sorted(os.scandir(projects), key=lambda entry: entry.name):
            if entry.is_dir(follow_symlinks=False):
                yield entry.name, SnapshotStore(Path(entry.path))


def current_project(start: Path | None = None) -> Path | None:
    """The directory of the forkd.yaml in ``start`` (default: the working directory) or its nearest parent."""
    here = (start or Path.cwd()).absolute()
    for folder in (here, *here.parents):
        if (folder / PROJECT_FILE).is_file():
            return folder
    return None
