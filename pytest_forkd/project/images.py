"""Guest images declared in forkd.yaml (``images:``), built when a snapshot boots one.

An entry names a base recipe (the built-in default, or a recipe file) and
adds Debian packages and files to it; the result is an ordinary image
:class:`~pytest_forkd.image.Recipe`, handed to the image builder, which
caches images by the hash of their content. So the first run that needs the
image builds it (with progress lines), every later run and every other
project that declares the same content reuses it, and editing the packages
or a copied file yields a new image (and rebuilds the snapshots booted from
it, whose recipe hash includes the image key).

The entry's ``setup`` commands are not part of the image (an initramfs is
assembled on the host, where guest commands cannot run): they run in the
guest right after it boots, before the booting snapshot's own setup, and
they are part of that snapshot's recipe hash.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from pytest_forkd.errors import ConfigError, ImageError
from pytest_forkd.image import Image, Recipe, load_default_recipe, load_recipe
from pytest_forkd.image.builder import build_recipe
from pytest_forkd.image.recipe import FileSpec
from pytest_forkd.project.config import ProjectImage


def image_recipe(image: ProjectImage) -> Recipe:
    """The image recipe ``image`` describes: its base recipe plus its packages and files."""
    base = load_recipe(image.recipe) if image.recipe is not None else load_default_recipe()
    packages = tuple(dict.fromkeys(base.packages + image.packages))
    files = base.files + tuple(
        FileSpec(src=copy.host_path, dest=copy.guest_path, mode=copy.host_path.stat().st_mode & 0o7777)
        for copy in image.files
    )
    return dataclasses.replace(base, name=image.name, packages=packages, files=files)


def ensure_project_image(
    image: ProjectImage, *, progress: Callable[[str], None] | None = None, origin: str = "forkd.yaml"
) -> Image:
    """Build ``image`` unless an image with the same content is built already; return it.

    A bad recipe (ConfigError) or a build that fails, such as a package the
    Debian index does not know (ImageError), names the ``images.NAME`` entry.
    """
    recipe = image_recipe(image)
    say = progress or (lambda line: None)

    def report(line: str) -> None:
        say(f"forkd: image {image.name!r}: {line}")

    try:
        return build_recipe(recipe, name=image.name, progress=report)
    except (ConfigError, ImageError) as exc:
        raise type(exc)(f"{origin}: images.{image.name}: {exc}") from None
