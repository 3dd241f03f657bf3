"""Build guest images: recipe -> packages -> root tree -> initramfs, cached by content key.

The key hashes everything that decides an image's content (the normalised
recipe, the guest agent, its wire module, /init and :data:`BUILDER_VERSION`),
so a second build of the same thing is instant and needs no network, and any
change to the agent yields a new image instead of a stale one.

Builds of one key are serialised with a file lock: pytest-xdist workers or
two terminals asking for the same image build it once, the others wait and
reuse it. A build happens in a private directory next to the published ones
and is renamed into place only when complete, so a crash or an error never
leaves a half-written image behind.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import stat
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from filelock import FileLock, Timeout

from .. import paths
from ..errors import ConfigError
from . import debian
from .catalog import (
    BZIMAGE_FILE,
    INITRD_FILE,
    KERNEL_FILE,
    MANIFEST_FILE,
    STUB_INITRD_FILE,
    STUB_KERNEL_FILE,
    Image,
    image_at,
    image_directory,
    is_published,
    key_of,
    load_image,
    point_name,
)
from .cpio import CpioWriter, write_empty_archive
from .kernel import cached_kernel
from .recipe import Recipe, load_default_recipe, load_recipe
from .rootfs import assemble_root, guest_files

# Bump when the builder changes what it puts into an image, to invalidate cached images.
BUILDER_VERSION = 9
DEFAULT_NAME = "default"
# Restored children never boot: the head of the kernel and an empty archive
# are enough for QEMU to start and cost far less memory per child (DESIGN.md 3).
STUB_KERNEL_BYTES = 64 * 1024
STUB_INITRD_BYTES = 4096

Progress = Callable[[str], None]


def print_progress(message: str) -> None:
    """Default progress sink: one line per step on stderr."""
    print(f"forkd: {message}", file=sys.stderr, flush=True)


def image_key(recipe: Recipe) -> str:
    """The content key of the image ``recipe`` describes, given the installed guest files."""
    material = {
        "builder": BUILDER_VERSION,
        "recipe": recipe.normalized(),
        "guest": {name: hashlib.sha256(path.read_bytes()).hexdigest() for name, path in sorted(guest_files().items())},
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:16]


def build_image(
    recipe: Path | None = None,
    *,
    name: str | None = None,
    progress: Progress | None = None,
    force: bool = False,
) -> Image:
    """Build the image of ``recipe`` (the built-in default when None), or reuse it when already built.

    ``name`` defaults to the recipe's ``name`` field, then to the recipe
    file's stem; the name ``default`` belongs to the built-in recipe.
    ``force`` rebuilds even when an image with the same key exists.
    """
    progress = progress or print_progress
    loaded = load_recipe(recipe) if recipe is not None else load_default_recipe()
    if name is None:
        name = loaded.name or (Path(recipe).stem if recipe is not None else DEFAULT_NAME)
    paths.validate_tag(name, "image name")
    if recipe is not None and name == DEFAULT_NAME:
        raise ConfigError(
            f"the image name {DEFAULT_NAME!r} is reserved for the built-in recipe; "
            f"give {Path(recipe).name} another name (--name or the recipe's name field)"
        )

    return build_recipe(loaded, name=name, progress=progress, force=force)


def build_recipe(recipe: Recipe, *, name: str, progress: Progress | None = None, force: bool = False) -> Image:
    """Build the image of an already loaded ``recipe`` under ``name`` (reused when its key is built).

    For recipes assembled in code (forkd.yaml's ``images:`` section) rather
    than read from a file.
    """
    progress = progress or print_progress
    paths.validate_tag(name, "image name")
    key = image_key(recipe)
    if force or not is_published(key):
        _build_locked(recipe, name, key, progress, force)
    if key_of(name) != key:
        point_name(name, key)
    return image_at(name, image_directory(key))


def ensure_image(name: str = DEFAULT_NAME, progress: Progress | None = None) -> Image:
    """The image to boot for ``name``.

    For ``default`` this builds the built-in recipe when its current key is
    missing (first use, or an upgraded agent), which costs nothing once
    built; any other name must have been built with ``forkd image build``.
    """
    if name == DEFAULT_NAME:
        return build_image(None, name=DEFAULT_NAME, progress=progress)
    return load_image(name)


def _build_locked(recipe: Recipe, name: str, key: str, progress: Progress, force: bool) -> None:
    images = paths.images_dir()
    (images / ".locks").mkdir(parents=True, exist_ok=True)
    lock = FileLock(images / ".locks" / f"{key}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        progress(f"waiting for another build of image {key} to finish")
        lock.acquire()
    try:
        if is_published(key) and not force:
            return  # built by whoever held the lock before us
        for stale in images.glob(f".build-{key}-*"):  # left by a build that was killed; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        workdir = Path(tempfile.mkdtemp(dir=images, prefix=f".build-{key}-"))
        try:
            output = _run_pipeline(recipe, name, key, workdir, progress)
            _publish(output, image_directory(key), workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    finally:
        lock.release()


def _publish(output: Path, destination: Path, workdir: Path) -> None:
    """Rename the finished image into place; a forced rebuild moves the old one out first."""
    if destination.exists():
        destination.rename(workdir / "replaced")
    output.rename(destination)


def _run_pipeline(recipe: Recipe, name: str, key: str, workdir: Path, progress: Progress) -> Path:
    """Produce a complete image directory inside ``workdir`` and return it."""
    started = time.monotonic()
    selection = debian.select_packages(
        recipe.release, recipe.kernel, recipe.packages, recipe.exclude, paths.debs_dir(), progress
    )
    kernel_package = selection.kernel.name

    progress(f"taking the kernel from {kernel_package}")
    kernel = cached_kernel(selection.kernel_deb, paths.debs_dir() / "kernels")
    root = workdir / "root"
    assemble_root(
        root,
        selection.package_debs(),
        kernel,
        recipe.files,
        recipe.env,
        progress,
        python_version=selection.python,
    )

    output = workdir / "image"
    output.mkdir()
    progress("writing the initramfs")
    entries = write_initramfs(root, output / INITRD_FILE)
    shutil.copyfile(kernel.boot_image, output / KERNEL_FILE)
    if kernel.boot_image != kernel.vmlinuz:
        shutil.copyfile(kernel.vmlinuz, output / BZIMAGE_FILE)
    with kernel.vmlinuz.open("rb") as source:
        (output / STUB_KERNEL_FILE).write_bytes(source.read(STUB_KERNEL_BYTES))
    write_empty_archive(output / STUB_INITRD_FILE, STUB_INITRD_BYTES)
    sizes = {
        filename: (output / filename).stat().st_size
        for filename in (KERNEL_FILE, INITRD_FILE, STUB_KERNEL_FILE, STUB_INITRD_FILE, BZIMAGE_FILE)
        if (output / filename).is_file()
    }
    build_seconds = round(time.monotonic() - started, 1)
    progress(
        f"initramfs {sizes[INITRD_FILE] / 2**20:.1f} MiB ({entries} entries), "
        f"kernel {sizes[KERNEL_FILE] / 2**20:.1f} MiB, built in {build_seconds} s"
    )
    manifest: dict[str, Any] = {
        "name": name,
        "key": key,
        "builder_version": BUILDER_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "created_unix": time.time(),
        "build_seconds": build_seconds,
        "recipe": {**recipe.normalized(), "source": str(recipe.source) if recipe.source else None},
        "debian": {
            "release": selection.release,
            "version": selection.release_version,
            "mirror": selection.mirror.url,
        },
        "python": selection.python,
        "kernel": {
            "package": kernel_package,
            "version": selection.kernel.version,
            "release": kernel.release,
            "entry": "pvh" if kernel.boot_image != kernel.vmlinuz else "bzimage",
            "modules": [module.stem for module in kernel.modules],
            "builtin": list(kernel.builtin),
        },
        "packages": {package.name: package.version for package in selection.packages},
        "kernel_args": list(recipe.kernel_args),
        "env": dict(recipe.env),
        "sizes": sizes,
    }
    (output / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return output


def write_initramfs(root: Path, destination: Path) -> int:
    """Archive ``root`` plus the device nodes the kernel needs before /dev is mounted; return the entry count.

    /dev/console must exist in the initramfs for the kernel to give init a
    console on fds 0-2 when the machine has one.
    """
    with destination.open("wb") as stream, CpioWriter(stream) as writer:
        writer.add_tree(root)
        writer.add_device("dev/console", stat.S_IFCHR, 5, 1, 0o600)
        writer.add_device("dev/null", stat.S_IFCHR, 1, 3, 0o666)
        return writer.entries
