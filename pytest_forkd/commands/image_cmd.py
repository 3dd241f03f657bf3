"""``forkd image``: build guest images and list the built ones."""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

from ..image import Image, build_image, list_images


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "image",
        help="build and list guest images",
        description="Guest images are built from the host's Debian packages (kernel, busybox, Python) "
        "and cached by content; the default image is also built on first use.",
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
    build.set_defaults(run=run_build)

    listing = actions.add_parser("ls", help="list built images", description="List built guest images.")
    listing.set_defaults(run=run_ls)

    prune = actions.add_parser(
        "prune", help="remove images that no name and no stored snapshot uses",
        description="Remove superseded images: those no image name points to and no snapshot in the "
        "snapshot store was taken with.")
    prune.add_argument("--store", type=Path, metavar="DIR", help="snapshot store to respect (default: the user cache)")
    prune.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    prune.set_defaults(run=run_prune)


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def run_build(args: argparse.Namespace) -> int:
    started = time.time()
    image = build_image(args.recipe, name=args.name, force=args.force)
    manifest = image.manifest
    cached = manifest["created_unix"] < started
    status = "cached, nothing to build" if cached else f"built in {manifest['build_seconds']} s"
    print(f"image {image.name}: {status}")
    print(f"  key     {image.key}")
    print(f"  kernel  {_mib(image.kernel.stat().st_size):>10}  {image.kernel}")
    print(f"  initrd  {_mib(image.initrd.stat().st_size):>10}  {image.initrd}")
    print(f"  path    {image.path}")
    return 0


def run_ls(args: argparse.Namespace) -> int:
    images = list_images()
    if not images:
        print("no images built yet; build the default one with `forkd image build`")
        return 0
    rows = [("NAME", "KEY", "INITRD", "CREATED")] + [_row(image) for image in images]
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


def _row(image: Image) -> tuple[str, str, str, str]:
    return (image.name, image.key[:12], _mib(image.initrd.stat().st_size), image.manifest["created"])


def run_prune(args: argparse.Namespace) -> int:
    from ..image.catalog import unused_image_directories
    from ..store import SnapshotStore

    store = SnapshotStore(args.store) if args.store else SnapshotStore.persistent()
    in_use = {snapshot.fingerprint.get("image", "") for snapshot in store.list()}
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

