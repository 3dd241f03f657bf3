"""Guest images: the kernel and initramfs every forkd VM boots.

Build one with :func:`build_image` (``forkd image build``), find built ones
with :func:`load_image` and :func:`list_images`; :func:`ensure_image` is what
a session calls to get a bootable image, building the default on first use.
A container image (``docker://…``, ``oci:…``, ``dockerfile:…``) becomes one
through :func:`ensure_container_image` (``container.py``, ``oci/``).

Layer 1 of docs/ARCHITECTURE.md, beside guest. May import: the foundation
(errors, paths, private, processes, sizes, tables, version, waiting) and
guest. Never engine or anything above (checked by tests/unit/test_layers.py).
"""

from __future__ import annotations

from .builder import build_image, image_key
from .catalog import Image, list_images, load_image
from .recipe import Recipe, load_default_recipe, load_recipe

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .container import ensure_container_image, ensure_image


def __getattr__(name: str) -> object:
    """The container-image entry points, imported on first use: most sessions never pull an image."""
    if name in ("ensure_image", "ensure_container_image"):
        from . import container

        return getattr(container, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Image",
    "Recipe",
    "build_image",
    "ensure_container_image",
    "ensure_image",
    "image_key",
    "list_images",
    "load_default_recipe",
    "load_image",
    "load_recipe",
]
