"""Container images (OCI and Docker) as forkd guests: references, pulls, the local store, builds.

:func:`pull_image` brings the linux/amd64 image of a reference
(``docker://python:3.12-slim``, ``oci:DIR:TAG``, ``oci-archive:FILE``,
``docker-archive:FILE``, ``dockerfile:PATH``; a bare name means Docker Hub)
into one local OCI layout under the forkd cache, verified blob by blob;
:func:`list_pulled` lists what is there. The layers are then flattened into a
read-only disk per image digest, which a guest mounts below a tmpfs.

Layer 1 of docs/ARCHITECTURE.md, beside guest. May import: the foundation
(errors, filesystems, paths, private, processes, sizes, tables, version,
waiting, zstdio) and guest. Never engine or anything above (checked by
tests/unit/test_layers.py).
"""

from __future__ import annotations

from .pull import PULL_POLICIES, PullPolicy, plain_http_allowed, pull_image
from .reference import TRANSPORTS, ImageReference, is_reference, parse_reference
from .store import ImageConfig, Layer, PulledImage, list_pulled

__all__ = [
    "PULL_POLICIES",
    "TRANSPORTS",
    "ImageConfig",
    "ImageReference",
    "Layer",
    "PullPolicy",
    "PulledImage",
    "is_reference",
    "list_pulled",
    "parse_reference",
    "plain_http_allowed",
    "pull_image",
]
