"""Container images as guest images: a pulled OCI image becomes an :class:`Image` with a disk.

A VM of a container image boots forkd's own default image (its kernel, its
initramfs with busybox, Python and the agent) with the container image's root
filesystem attached as a read-only disk (``oci/disk.py``). /init mounts that
disk under an overlay whose writable layer is guest memory, and the agent runs
its commands chrooted there. So the image never occupies guest RAM (a 1 GiB
image boots in a 256 MiB guest), snapshots stay memory-only, and every storage
backend works unchanged; the disk is built once per image digest and shared by
every VM of the image.

Each (default image, container image digest) pair is published as an image
directory like any other (:mod:`.catalog`), keyed by both: the kernel and
initramfs are hard links to the default image's files, the manifest names the
disk and the reference. Snapshots record that key, so a tag that moved and was
pulled again yields a new key, and the snapshots built on the old one rebuild.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from filelock import FileLock

from .. import paths
from ..errors import UnknownImage
from .builder import DEFAULT_NAME, build_image
from .builder import ensure_image as ensure_named_image
from .catalog import MANIFEST_FILE, Image, image_at, image_directory, is_published, point_name
from .oci.reference import ImageReference, names_container_image, parse_reference

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .oci.pull import PullPolicy

#: Put on the kernel command line of a VM with an image disk: /init then mounts it as the root.
IMAGE_KERNEL_ARG = "forkd.image"
# Bump when what a container image's directory holds changes.
CONTAINER_FORMAT = 1
Progress = Callable[[str], None]


def ensure_image(name: str = DEFAULT_NAME, progress: Progress | None = None) -> Image:
    """The image to boot for ``name``: a container reference (``docker://…``, ``oci:…``, …) or an image name.

    A reference is pulled with the default policy (a reference pulled before
    is used from the cache, without the network); a bare one
    (``127.0.0.1:5000/app:1``) means ``docker://``, as Docker reads it. A plain
    word is an image name, what :func:`.builder.ensure_image` gives.
    """
    if names_container_image(name):
        return ensure_container_image(name, progress=progress)
    try:
        return ensure_named_image(name, progress=progress)
    except UnknownImage as exc:
        if name == DEFAULT_NAME:
            raise
        raise UnknownImage(f"{exc}; for the container image of that name write docker://{name}") from None


def container_image_name(reference: ImageReference, digest: str) -> str:
    """A valid image name for ``reference``: its repository's last part, tag and digest prefix."""
    last = reference.location.rstrip("/").rsplit("/", 1)[-1] or reference.transport
    stem = paths.sanitize_tag(f"{last}-{reference.tag}" if reference.tag else last)[:48]
    return f"{stem}-{digest.split(':')[-1][:12]}"


def ensure_container_image(
    reference: str | ImageReference,
    *,
    policy: "PullPolicy" = "missing",
    insecure_registries: Sequence[str] = (),
    progress: Progress | None = None,
) -> Image:
    """The guest image of a container image: pulled (per ``policy``), its disk built, published once.

    ``reference`` is ``docker://…``, ``oci:…``, ``oci-archive:…``,
    ``docker-archive:…`` or ``dockerfile:…``; a bare one means ``docker://``.
    """
    # Pulling and unpacking are imported here: sessions of forkd's own image never need them.
    from .oci.disk import disk_path, ensure_disk
    from .oci.pull import pull_image
    from .oci.store import verify

    parsed = parse_reference(reference) if isinstance(reference, str) else reference
    pulled = pull_image(parsed, policy=policy, progress=progress, insecure_registries=insecure_registries)
    base = build_image(None, name=DEFAULT_NAME, progress=progress)
    key = hashlib.sha256(json.dumps([CONTAINER_FORMAT, base.key, pulled.digest]).encode()).hexdigest()[:16]
    name = container_image_name(parsed, pulled.digest)
    if not is_published(key):
        if not disk_path(pulled.digest).is_file():
            verify(pulled)  # a cached pull checked sizes only: every blob is hashed before a disk is made of it
        disk = ensure_disk(pulled, progress=progress)
        _publish(key, name, base, disk, pulled.reference, pulled.digest, pulled.size)
    point_name(name, key)
    return image_at(name, image_directory(key))


def _publish(key: str, name: str, base: Image, disk: Path, reference: str, digest: str, size: int) -> None:
    """Write the image directory of ``key`` (links to the base image's files, a manifest), atomically."""
    images = paths.images_dir()
    (images / ".locks").mkdir(parents=True, exist_ok=True)
    with FileLock(images / ".locks" / f"{key}.lock"):
        if is_published(key):
            return
        workdir = Path(tempfile.mkdtemp(dir=images, prefix=f".build-{key}-"))
        try:
            output = workdir / "image"
            output.mkdir()
            for source in sorted(base.path.iterdir()):
                if source.name == MANIFEST_FILE or not source.is_file():
                    continue
                try:
                    os.link(source, output / source.name)
                except OSError:  # another filesystem, or links not allowed: a copy does as well
                    shutil.copyfile(source, output / source.name)
            manifest: dict[str, Any] = {
                **base.manifest,
                "name": name,
                "key": key,
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "created_unix": time.time(),
                "kernel_args": [*base.kernel_args, IMAGE_KERNEL_ARG],
                "env": {},
                "base_key": base.key,
                "container": {"reference": reference, "digest": digest, "disk": str(disk), "size": size},
            }
            (output / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
            output.rename(image_directory(key))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
