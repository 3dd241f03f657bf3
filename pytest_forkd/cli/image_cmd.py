"""``forkd image``: build guest images and list the built ones."""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

from pytest_forkd.image import Image, build_image, list_images
from pytest_forkd.private import private_umask
from pytest_forkd.tables import render_table


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "image",
        help="build and list guest images",
        description="Guest images are built from a pinned Debian release (kernel, busybox, Python) read "
        "from a Debian mirror and cached by content; the default image is also built on first use.",
    )
    actions = p.add_subparsers(dest="image_command", metavar="ACTION", required=True)

    build = actions.add_parser(
        "build",
        help="build an image from a recipe (the built-in default when none is given)",
        description="Build a guest image. Nothing is rebuilt when an image with the same content exists, "
        "unless --force is given. Example: forkd image build --recipe tools.yaml --name tools",
    )
    build.add_argument("--recipe", type=Path, metavar="FILE", help="YAML recipe (extends the default one)")
    build.add_argument("--name", help="image name (default: the recipe's name, or its file name)")
    build.add_argument("--force", action="store_true", help="rebuild even when the image is already built")
    build.add_argument(
        "--mirror",
        metavar="URL",
        help="Debian mirror to download from (default: $FORKD_DEBIAN_MIRROR, settings.debian_mirror of "
        "./forkd.yaml, else the host's apt sources)",
    )
    build.set_defaults(run=run_build)

    listing = actions.add_parser("ls", help="list built images", description="List built guest images.")
    listing.set_defaults(run=run_ls)

    prune = actions.add_parser(
        "prune",
        help="remove images that no name and no stored snapshot uses",
        description="Remove superseded images: those no image name points to and no snapshot in the "
        "snapshot store was taken with.",
    )
    prune.add_argument("--store", type=Path, metavar="DIR", help="snapshot store to respect (default: the user cache)")
    prune.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    prune.set_defaults(run=run_prune)


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def run_build(args: argparse.Namespace) -> int:
    _choose_mirror(args.mirror)
    started = time.time()
    with private_umask():  # the image store is private: directories 0700, files 0600
        image = build_image(args.recipe, name=args.name, force=args.force)
    manifest = image.manifest
    cached = manifest["created_unix"] < started
    status = "cached, nothing to build" if cached else f"built in {manifest['build_seconds']} s"
    print(f"image {image.name}: {status}")
    print(f"  key     {image.key}")
    print(f"  kernel  {_mib(image.kernel.stat().st_size):>10}  {image.kernel}")
    if image.bzimage is not None:
        print(f"  bzImage {_mib(image.bzimage.stat().st_size):>10}  {image.bzimage}  (booted on QEMU 8 and later)")
    print(f"  initrd  {_mib(image.initrd.stat().st_size):>10}  {image.initrd}")
    print(f"  path    {image.path}")
    return 0


def _choose_mirror(explicit: str | None) -> None:
    """Apply --mirror (over everything) and ./forkd.yaml's settings.debian_mirror (under the environment)."""
    from pytest_forkd.image.mirror import MIRROR_ENV, check_url, use_project_mirror
    from pytest_forkd.project.config import PROJECT_FILE, load_project

    if explicit:
        os.environ[MIRROR_ENV] = check_url(explicit, "--mirror")
    project_file = Path(PROJECT_FILE)
    if project_file.is_file():
        project = load_project(project_file)
        use_project_mirror(project.settings.get("debian_mirror"), f"{project.origin} settings.debian_mirror")


def run_ls(args: argparse.Namespace) -> int:
    images = list_images()
    if not images:
        print("no images built yet; build the default one with `forkd image build`")
        return 0
    print(render_table([_row(image) for image in images], ("NAME", "KEY", "INITRD", "CREATED")))
    return 0


def _row(image: Image) -> tuple[str, str, str, str]:
    return (image.name, image.key[:12], _mib(image.initrd.stat().st_size), image.manifest["created"])


def run_prune(args: argparse.Namespace) -> int:
    from pytest_forkd.image.catalog import unused_image_directories
    from pytest_forkd.storage.store import SnapshotStore

    store = SnapshotStore(args.store) if args.store else SnapshotStore.persistent()
    from pytest_forkd.project.lifecycle import namespaces

    # Every project's snapshots too: their names are per project, their images are not.
    in_use = {
        snapshot.fingerprint.get("image", "")
        for _project, namespace in namespaces(store)
        for snapshot in namespace.list()
    }
    unused = unused_image_directories(keep=in_use)
    freed = 0
    for directory in unused:
        size = sum(entry.stat().st_size for entry in directory.iterdir() if entry.is_file())
        freed += size
        print(f"{'would remove' if args.dry_run else 'removed'} {directory.name}  {_mib(size)}")
        if not args.dry_run:
            shutil.rmtree(directory)
    print(f"{len(unused)} unused image(s), {_mib(freed)}" + (" (dry run)" if args.dry_run else " freed"))
    return 0
