"""``code-interpreter-v1`` with no configuration: a guest image with numpy and Pillow, built and kept like ``base``.

E2B's SDK for the code interpreter creates its sandboxes from the template
``code-interpreter-v1``, whose image has Python's data stack; agents rely on
it (smolagents' ``E2BExecutor`` imports numpy and PIL in its first cell). So
unless a ``--template code-interpreter-v1=REF`` mapping or a forkd.yaml
snapshot of that name says otherwise, forkd serves the name from a snapshot
of its own image: the default image plus Debian's ``python3-numpy`` and
``python3-pil`` from the same pinned release (the recipe
``code-interpreter.yaml`` beside this module), booted with
:data:`MEMORY_MIB` of memory because the guest's root lives in its RAM.

The image and the snapshot are built on first use, with progress lines, by
the project's own builders, and kept like ``base``: the image in forkd's
image cache under its content key, the snapshot in the shared snapshot store
under its recipe hash; every later server, test run or project reuses them,
offline. Nothing of it touches ``base``: the default image's key is its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Final

from pytest_forkd.project.config import IMAGE_PREFIX, Project, ProjectImage, SnapshotRecipe

if TYPE_CHECKING:
    from pytest_forkd.project.session import ForkdSession
    from pytest_forkd.project.snapshot_builder import SnapshotBuilder
    from pytest_forkd.storage.snapshot import Snapshot

#: The recipe of the template's guest image: the default one plus numpy and Pillow.
RECIPE: Final = Path(__file__).with_name("code-interpreter.yaml")
IMAGE_NAME: Final = "e2b-code-interpreter"
#: The snapshot's name in the shared store.
SNAPSHOT_NAME: Final = "e2b-code-interpreter-v1"
#: Guest memory: the image's root takes about 113 MiB of it (the default image's 46 MiB), and a cell's
#: arrays and images the rest; 256 MiB, the default, would leave a sandbox less room than ``base`` has.
MEMORY_MIB: Final = 512
#: Run once in the snapshot's VM before it is saved. Debian links ``libblas.so.3`` and ``liblapack.so.3``
#: (which numpy loads by those names) through update-alternatives at install time, and the image builder
#: unpacks packages without running their scripts; then the imports are checked, so that an image that
#: cannot run them fails its build, naming the error, rather than a sandbox's first cell.
SETUP: Final = (
    "cd /usr/lib/x86_64-linux-gnu && for library in blas/libblas.so.3 lapack/liblapack.so.3; do "
    'ln -sf "$library" "${library#*/}"; done',
    "python3 -c 'import numpy, PIL.Image; numpy.linalg.inv(numpy.eye(2)); PIL.Image.new(\"RGB\", (1, 1))'",
)

#: What ``forkd e2b ls`` says the template is.
DESCRIPTION: Final = (
    f"snapshot {SNAPSHOT_NAME}: forkd's image with numpy and Pillow, {MEMORY_MIB} MiB (built on first use)"
)

PROJECT: Final = Project(
    images={IMAGE_NAME: ProjectImage(name=IMAGE_NAME, recipe=RECIPE)},
    snapshots={
        SNAPSHOT_NAME: SnapshotRecipe(
            name=SNAPSHOT_NAME, source=IMAGE_PREFIX + IMAGE_NAME, memory_mib=MEMORY_MIB, setup=SETUP, shared=True
        )
    },
)
"""What the template is, as a forkd.yaml would declare it (a project without a file: its snapshots are shared)."""


class CodeInterpreterSnapshots:
    """Builds (once) and hands out the template's snapshot for one session (blocking; call it off the loop)."""

    def __init__(self, session: ForkdSession, progress: Callable[[str], None]) -> None:
        self._session = session
        self._progress = progress
        self._builder: SnapshotBuilder | None = None
        self._lock = threading.Lock()

    def snapshot(self) -> Snapshot:
        """The template's snapshot, built first (image, boot, setup) if this machine has none of it yet."""
        from pytest_forkd.project.snapshot_builder import SnapshotBuilder

        session = self._session
        with self._lock, session.timings.running_test(None):  # a session's cost, as building base is
            if self._builder is None:
                self._builder = SnapshotBuilder(
                    session.factory,
                    session.store,
                    PROJECT,
                    progress=self._progress,
                    shared_store=session.shared_store,
                    max_store_bytes=session.settings.store_max_size,
                    pull_policy=session.settings.pull,
                )
            return self._builder.get(SNAPSHOT_NAME)
