"""Pulling container images into the local store, with Docker's pull policies.

Every transport ends in the same place: ``skopeo copy`` copies the
linux/amd64 image of a reference (``docker://``, ``oci:``, ``oci-archive:``,
``docker-archive:``; ``dockerfile:`` builds first, see :mod:`.builders`)
into the store's one OCI layout, where blobs are kept by digest and shared
between images (skopeo does not download a blob the layout already has).
From a registry, a tag is read once and the copy asks for the digest it
named, so a tag that moves meanwhile cannot mix two images (:mod:`.importer`).
Then forkd hashes the manifest, the config and every layer itself (each blob
once, whatever the number of processes) before the image is entered in the
index (see :mod:`.store`).

Pull policies, as in Docker: ``missing`` (the default) uses an image pulled
before without any network access; ``always`` asks the source again (a moved
tag gets the new image, unchanged blobs are not downloaded again); ``never``
only uses the store. A local file or layout (``oci:``...) counts as changed
when its size or modification time changed, and is then imported again.

Registries are spoken to over HTTPS, except those on this machine
(``localhost``, 127.0.0.0/8, ``::1``) and the ones listed in
``insecure_registries``, which may be plain HTTP, as Docker allows.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from pathlib import Path

from ...errors import ImageNotFound, ImageNotPulled
from . import store
from .importer import Progress, import_image
from .reference import ImageReference, parse_reference
from .store import PULL_POLICIES, PulledImage, PullPolicy, check_policy

__all__ = ["PULL_POLICIES", "PullPolicy", "check_policy", "list_pulled", "plain_http_allowed", "pull_image"]


list_pulled = store.list_pulled


def plain_http_allowed(registry: str, insecure_registries: Sequence[str] = ()) -> bool:
    """True for a registry on this machine (localhost, 127.0.0.0/8, ::1) or listed in ``insecure_registries``.

    A listed entry is ``host`` (any port) or ``host:port``.
    """
    if registry.startswith("["):
        host = registry[1 : registry.find("]")]
    else:
        host = registry.rsplit(":", 1)[0] if registry.count(":") == 1 else registry
    if host == "localhost":
        return True
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
    return any(entry.strip() in (registry, host) for entry in insecure_registries)


def pull_image(
    reference: str | ImageReference,
    *,
    policy: PullPolicy = "missing",
    progress: Progress | None = None,
    insecure_registries: Sequence[str] = (),
) -> PulledImage:
    """The linux/amd64 image of ``reference`` in the local store, pulled or imported as ``policy`` says.

    A bare name means ``docker://`` (``python:3.12-slim``). Errors are
    one-line ImageError subclasses (unknown repository or tag, authentication
    required, no linux/amd64 image, registry unreachable, digest mismatch,
    disk full, skopeo missing) or InvalidArgument for a malformed reference.
    """
    ref = reference if isinstance(reference, ImageReference) else parse_reference(reference)
    check_policy(policy)
    progress = progress or (lambda _line: None)
    if ref.transport == "dockerfile":
        from .builders import build_dockerfile

        return build_dockerfile(Path(ref.location), policy=policy, progress=progress, pinned=ref.digest)
    key = str(ref)
    stamp = source_stamp(ref) if ref.is_local and policy != "never" else None
    if policy != "always":
        cached = store.lookup(key, stamp=stamp)
        if cached is not None:
            return cached
        if policy == "never":
            raise ImageNotPulled(
                f"{key} is not in the local image store and the pull policy is 'never'; "
                f"pull it with `forkd image pull {key}` or use the pull policy 'missing'"
            )
    registry = ref.registry
    return import_image(
        skopeo_source(ref),
        key,
        registry=registry,
        plain_http=registry is not None and plain_http_allowed(registry, insecure_registries),
        pinned=ref.digest,
        stamp=stamp,
        progress=progress,
    )


def skopeo_source(ref: ImageReference) -> str:
    """The reference as skopeo reads it (a pinned digest wins over a tag: skopeo refuses both)."""
    if ref.transport == "docker":
        return f"docker://{ref.location}" + (f"@{ref.digest}" if ref.digest else f":{ref.tag}")
    if ref.transport in ("oci", "oci-archive") and ref.tag:
        return f"{ref.transport}:{ref.location}:{ref.tag}"
    return f"{ref.transport}:{ref.location}"


def source_stamp(ref: ImageReference) -> str:
    """Size, modification time and inode of a local source (an OCI layout's index.json): it changed when this did."""
    path = Path(ref.location)
    if ref.transport == "oci":
        path = path / "index.json"
    try:
        info = path.stat()
    except FileNotFoundError:
        what = "OCI image layout" if ref.transport == "oci" else "file"
        raise ImageNotFound(f"{ref}: no {what} at {ref.location}; check the path") from None
    except OSError as exc:
        raise ImageNotFound(f"{ref}: cannot read {path} ({exc.strerror})") from None
    return f"{info.st_size}:{info.st_mtime_ns}:{info.st_ino}"
