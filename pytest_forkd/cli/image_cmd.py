"""``forkd image``: build guest images, pull container images, list and prune both."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from pytest_forkd import paths
from pytest_forkd.errors import ForkdError
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

    pull = actions.add_parser(
        "pull",
        help="pull a container image into the local store",
        description="Pull the linux/amd64 image of a container reference into the local image store, as "
        "`docker pull` does: docker://NAME[:TAG|@DIGEST] (a bare NAME means Docker Hub), oci:DIR[:TAG], "
        "oci-archive:FILE[:TAG], docker-archive:FILE, or dockerfile:PATH (built with podman, docker or buildah). "
        "Credentials come from `skopeo login`, `docker login` or `podman login`. "
        "Example: forkd image pull docker://python:3.12-slim",
    )
    pull.add_argument("reference", metavar="REF", help="the image reference")
    pull.add_argument(
        "--policy",
        choices=("always", "missing", "never"),
        default="always",
        help="always (the default here): ask the source again, downloading only what changed; "
        "missing: use the store when it has the image; never: only check the store",
    )
    pull.add_argument(
        "--insecure-registry",
        action="append",
        default=[],
        metavar="HOST[:PORT]",
        help="a registry that may be reached over plain HTTP (registries on this machine always may); repeatable",
    )
    pull.set_defaults(run=run_pull)

    listing = actions.add_parser(
        "ls",
        help="list built images and pulled container images",
        description="List built guest images, then the container images in the local store with their digest, "
        "size and the snapshots that use them.",
    )
    listing.add_argument(
        "--store", type=Path, metavar="DIR", help="snapshot store to read snapshots from (default: the user cache)"
    )
    listing.set_defaults(run=run_ls)

    prune = actions.add_parser(
        "prune",
        help="remove images, layers and disks that nothing uses",
        description="Remove superseded images: those no image name points to and no snapshot in the "
        "snapshot store was taken with; then the container image layers no pulled image has, and the image "
        "disks of digests no pulled image and no remaining image has.",
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


def run_pull(args: argparse.Namespace) -> int:
    from pytest_forkd.image.oci import pull_image

    with private_umask():
        image = pull_image(
            args.reference,
            policy=args.policy,
            progress=lambda line: print(line, file=sys.stderr),
            insecure_registries=args.insecure_registry,
        )
    print(f"{image.reference}")
    print(f"  digest  {image.digest}")
    print(f"  layers  {len(image.layers)}, {_mib(image.size)}")
    print(f"  pulled  {image.pulled}")
    return 0


def run_ls(args: argparse.Namespace) -> int:
    images = list_images()
    containers = _container_rows(getattr(args, "store", None))
    if not images:
        print("no images built yet; build the default one with `forkd image build`")
    else:
        print(render_table([_row(image) for image in images], ("NAME", "KEY", "INITRD", "CREATED")))
    if containers:
        print()
        print(render_table(containers, ("REFERENCE", "DIGEST", "SIZE", "PULLED", "SNAPSHOTS")))
    return 0


def _container_rows(store_dir: Path | None) -> list[tuple[str, str, str, str, str]]:
    """One row per pulled container image, with the snapshots taken on guest images made from it."""
    from pytest_forkd.image.oci import list_pulled

    pulled = list_pulled()
    if not pulled:
        return []
    keys_by_digest: dict[str, set[str]] = {}
    for key, manifest in _published_manifests():
        container = manifest.get("container")
        if isinstance(container, dict) and isinstance(container.get("digest"), str):
            keys_by_digest.setdefault(container["digest"], set()).add(key)
    tags_by_key: dict[str, list[str]] = {}
    for project, snapshot in _all_snapshots(store_dir):
        tag = f"{project}/{snapshot.tag}" if project else snapshot.tag
        tags_by_key.setdefault(str(snapshot.fingerprint.get("image", "")), []).append(tag)
    rows = []
    for image in pulled:
        tags = sorted(tag for key in keys_by_digest.get(image.digest, ()) for tag in tags_by_key.get(key, ()))
        rows.append((image.reference, image.digest[:19], _mib(image.size), image.pulled or "-", ", ".join(tags) or "-"))
    return rows


def _published_manifests() -> list[tuple[str, dict[str, Any]]]:
    """(key, manifest) of every published guest image directory, named or not."""
    from pytest_forkd.image.catalog import read_manifest

    root = paths.images_dir()
    found = []
    if root.is_dir():
        for entry in sorted(root.iterdir()):
            if entry.is_dir() and not entry.name.startswith(".") and (entry / "manifest.json").is_file():
                try:
                    found.append((entry.name, read_manifest(entry)))
                except (OSError, ValueError, ForkdError):
                    continue
    return found


def _all_snapshots(store_dir: Path | None) -> list[tuple[str | None, Any]]:
    """(project id or None, snapshot) of every snapshot in the store, every project's too."""
    from pytest_forkd.project.lifecycle import namespaces
    from pytest_forkd.storage.store import SnapshotStore

    store = SnapshotStore(store_dir) if store_dir else SnapshotStore.persistent()
    return [(project, snapshot) for project, namespace in namespaces(store) for snapshot in namespace.list()]


def _row(image: Image) -> tuple[str, str, str, str]:
    return (image.name, image.key[:12], _mib(image.initrd.stat().st_size), image.manifest["created"])


def run_prune(args: argparse.Namespace) -> int:
    from pytest_forkd.image.catalog import unused_image_directories

    # Every project's snapshots too: their names are per project, their images are not.
    in_use = {snapshot.fingerprint.get("image", "") for _project, snapshot in _all_snapshots(args.store)}
    unused = unused_image_directories(keep=in_use)
    freed = 0
    for directory in unused:
        size = sum(entry.stat().st_size for entry in directory.iterdir() if entry.is_file())
        freed += size
        print(f"{'would remove' if args.dry_run else 'removed'} {directory.name}  {_mib(size)}")
        if not args.dry_run:
            shutil.rmtree(directory)
    print(f"{len(unused)} unused image(s), {_mib(freed)}" + (" (dry run)" if args.dry_run else " freed"))
    _prune_container_store(args.dry_run, removed_images={directory.name for directory in unused})
    return 0


def _prune_container_store(dry_run: bool, removed_images: set[str]) -> None:
    """Remove the layers no pulled image has, and the disks of digests no pulled or remaining image has."""
    from pytest_forkd.image.oci import prune

    kept_digests = {
        manifest["container"]["digest"]
        for key, manifest in _published_manifests()
        if key not in removed_images
        and isinstance(manifest.get("container"), dict)
        and isinstance(manifest["container"].get("digest"), str)
    }
    result = prune.prune_store(keep_disks_of=kept_digests, dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    for path, size in result.removed:
        print(f"{verb} {path.relative_to(prune.store_dir())}  {_mib(size)}")
    print(
        f"{result.blobs} unused layer blob(s), {result.disks} unused disk(s), {_mib(result.freed)}"
        + (" (dry run)" if dry_run else " freed")
    )
    for builder, image in result.builder_images:  # forkd's build tags and the bases its builds pulled
        print(f"{verb} {image} from {builder}'s storage")
