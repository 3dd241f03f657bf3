"""A code-interpreter image as E2B's ``code-interpreter-v1`` is one: Debian's python3 with numpy and Pillow.

smolagents' ``E2BExecutor`` sends its tools' source as its first cell, and
that source imports ``numpy`` and ``PIL`` at the top (smolagents lifts the
imports out of the ``final_answer`` tool's methods, where they sit in
``try``/``except ImportError``). E2B's own code-interpreter template has
both; forkd's default guest has neither, and no network to install them. So
the smolagents test maps ``code-interpreter-v1`` to this image: Debian
bookworm packages (``python3-numpy``, ``python3-pil`` and what they depend
on), downloaded from the Debian mirror forkd's own image comes from (and
cached as its packages are), unpacked into one uncompressed layer and written
once as an OCI layout under the tests' cache. The image's root is a
read-only disk, so its size costs the guest no memory.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import filelock
import pytest
from consumers_env import OFFLINE, cache_root
from oci_images import DEFAULT_PATH, ImageConfigSpec, LayerTar, write_layout

from pytest_forkd.errors import ForkdError

#: The image's Debian packages (dependencies resolved as apt would).
PACKAGES = ("bash", "coreutils", "python3-minimal", "libpython3-stdlib", "python3-numpy", "python3-pil")
TAG = "code-interpreter"
#: Bumped when what goes into the image changes: the archive's name changes with it, so no store keeps the old one.
IMAGE_REVISION = 3


def debian_root(root: Path) -> None:
    """:data:`PACKAGES` and their dependencies unpacked into ``root`` (merged /usr, python3 and sh linked)."""
    from pytest_forkd import paths
    from pytest_forkd.image.debian import select_packages, unpack
    from pytest_forkd.image.recipe import load_default_recipe
    from pytest_forkd.image.rootfs import make_merged_usr

    recipe = load_default_recipe()
    selection = select_packages(
        recipe.release, recipe.kernel, PACKAGES, ("dpkg", "debconf", "tzdata"), paths.debs_dir(), lambda line: None
    )
    make_merged_usr(root)
    for deb in selection.package_debs():
        unpack(deb, root)
    sh = root / "usr" / "bin" / "sh"
    sh.unlink(missing_ok=True)
    sh.symlink_to("bash")
    python = root / "usr" / "bin" / "python3"
    if not python.exists():
        python.symlink_to(sorted(path.name for path in (root / "usr" / "bin").glob("python3.*"))[-1])
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (root / "etc" / "group").write_text("root:x:0:\n")
    # What update-alternatives would link at install time (no maintainer script runs here): numpy loads
    # libblas.so.3 and liblapack.so.3 by these names.
    libraries = root / "usr" / "lib" / "x86_64-linux-gnu"
    for alternative in ("blas", "lapack"):
        for library in sorted((libraries / alternative).glob("lib*.so.3")):
            link = libraries / library.name
            if not link.exists():
                link.symlink_to(f"{alternative}/{library.name}")
    for folder in ("root", "tmp", "home"):
        (root / folder).mkdir(exist_ok=True)
    (root / "tmp").chmod(0o1777)


def code_interpreter_image() -> str:
    """The image's ``oci:DIR:TAG`` reference, written on first use (the same packages give the same digest)."""
    folder = cache_root() / "images"
    folder.mkdir(parents=True, exist_ok=True)
    inputs = hashlib.sha256(repr((IMAGE_REVISION, PACKAGES)).encode()).hexdigest()[:12]
    layout = folder / f"code-interpreter-{inputs}"
    with filelock.FileLock(str(layout) + ".lock", timeout=900):
        if not layout.exists():
            with tempfile.TemporaryDirectory(prefix="forkd-code-interpreter-image-", dir=folder) as scratch:
                root = Path(scratch) / "root"
                root.mkdir()
                try:
                    debian_root(root)
                except ForkdError as exc:
                    if OFFLINE.search(str(exc)):
                        pytest.skip(
                            f"the code-interpreter image's Debian packages: not cached, mirror unreachable ({exc})"
                        )
                    raise
                layer = LayerTar().tree(root)
                partial = Path(scratch) / "layout"
                config = ImageConfigSpec(env=(f"PATH={DEFAULT_PATH}", "LANG=C.UTF-8"), cmd=("bash",))
                write_layout(partial, [(layer, "none")], config=config, tag=TAG)
                partial.rename(layout)
    return f"oci:{layout}:{TAG}"
