"""The local store of container images: one OCI image layout, and an index of what was pulled.

Layout under the forkd cache (``paths.cache_dir() / "oci"``)::

    layout/             one OCI image layout (oci-layout, index.json, blobs/sha256/<hex>)
                        that every pull copies into: blobs are stored once by digest and
                        shared by every image that has them
    images.json         the index: canonical reference -> manifest digest, pulled time
    disks/<hex>.ext4    read-only disks, one per image digest (built from the layers)
    .store.lock         held while anything writes the layout or the index

Only the index says what is pulled: a reference is listed once its manifest,
config and every layer are in the layout and have been hashed against their
digests, and the index is replaced in one rename. A pull that fails or is
interrupted may leave verified blobs behind (the next pull reuses them,
``forkd image prune`` removes them), but never an entry: nothing half-pulled
is listed or used. Everything is private to its owner (directories 0700,
files 0600), as the rest of the cache is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, get_args

from filelock import FileLock

from ... import paths, private
from ...errors import DigestMismatch, ImageError, ImageStoreFull, InvalidArgument, NoMatchingPlatform

__all__ = [
    "ImageConfig",
    "Layer",
    "PulledImage",
    "blob_path",
    "disks_dir",
    "layout_dir",
    "list_pulled",
    "lookup",
    "store_dir",
    "verify",
]

INDEX_FORMAT = 1
INDEX_FILE = "images.json"
LOCK_FILE = ".store.lock"
LAYOUT = "layout"
DISKS = "disks"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
#: Layer media types the layers are read in (OCI and Docker v2; uncompressed, gzip, zstd).
LAYER_MEDIA_TYPES = frozenset(
    {
        "application/vnd.oci.image.layer.v1.tar",
        "application/vnd.oci.image.layer.v1.tar+gzip",
        "application/vnd.oci.image.layer.v1.tar+zstd",
        "application/vnd.oci.image.layer.nondistributable.v1.tar",
        "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
        "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd",
        "application/vnd.docker.image.rootfs.diff.tar",
        "application/vnd.docker.image.rootfs.diff.tar.gzip",
        "application/vnd.docker.image.rootfs.diff.tar.zstd",
    }
)
_HASH_CHUNK = 1 << 20

#: Docker's pull policies: ``missing`` (the default) uses what the store has, ``always`` asks the source
#: again, ``never`` only uses the store.
PullPolicy = Literal["missing", "always", "never"]
PULL_POLICIES: tuple[str, ...] = get_args(PullPolicy)


def check_policy(policy: object, where: str = "pull policy") -> PullPolicy:
    """``policy`` if it is one of missing/always/never, else InvalidArgument."""
    if policy not in PULL_POLICIES:
        raise InvalidArgument(f"{where} {policy!r} is not one of {', '.join(PULL_POLICIES)} (missing is the default)")
    return policy  # type: ignore[return-value]


@dataclass(frozen=True)
class ImageConfig:
    """What an image's config asks of the processes run in it."""

    env: tuple[str, ...] = ()  # "KEY=VALUE" as in the image config's Env
    working_dir: str = ""  # "" means "/"
    user: str = ""  # "", "name", "uid", "uid:gid", "name:group"
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()


@dataclass(frozen=True)
class Layer:
    """One layer blob of an image, verified against its digest, in the store (never modified)."""

    digest: str  # "sha256:<hex>" of the (compressed) blob
    media_type: str  # OCI or Docker v2 layer media type (tar, tar+gzip, tar+zstd)
    size: int
    path: Path


@dataclass(frozen=True)
class PulledImage:
    """An image in the local store: its canonical reference, manifest digest, config and layers."""

    reference: str  # canonical reference text (never credentials)
    digest: str  # manifest digest "sha256:<hex>" of the linux/amd64 manifest, as stored
    config: ImageConfig
    layers: tuple[Layer, ...]
    size: int  # sum of layer sizes
    pulled: str = ""  # when it was pulled, ISO 8601 UTC
    source_digest: str = ""  # the manifest digest at the source (a registry's, before any media type conversion)


def store_dir() -> Path:
    return paths.cache_dir() / "oci"


def layout_dir() -> Path:
    return store_dir() / LAYOUT


def disks_dir() -> Path:
    """Where the read-only image disks live: ``<hex of the manifest digest>.ext4``."""
    return store_dir() / DISKS


def blob_path(digest: str) -> Path:
    algorithm, _, hexdigest = digest.partition(":")
    if algorithm != "sha256" or len(hexdigest) != 64 or not all(c in "0123456789abcdef" for c in hexdigest):
        raise DigestMismatch(f"malformed digest {digest[:80]!r} in the image store: expected sha256:<64 hex digits>")
    return layout_dir() / "blobs" / "sha256" / hexdigest


def store_lock() -> FileLock:
    """The lock every writer of the layout or the index holds (pulls of several workers run one at a time)."""
    private.make_dir(store_dir())
    return FileLock(str(store_dir() / LOCK_FILE), mode=private.FILE_MODE)


@contextmanager
def disk_full_as_error(folder: Path, what: str) -> Iterator[None]:
    """Turn ENOSPC/EDQUOT while writing into ImageStoreFull naming ``folder``."""
    try:
        yield
    except OSError as exc:
        if exc.errno in (28, 122):  # ENOSPC, EDQUOT
            raise ImageStoreFull(
                f"no space left in {folder} while {what}; free some space (or run `forkd image prune`) and retry"
            ) from None
        raise


# --- the index ----------------------------------------------------------------------------


def read_index() -> dict[str, dict[str, Any]]:
    """Canonical reference -> entry ({reference, digest, source_digest, pulled, pulled_unix, stamp})."""
    index = store_dir() / INDEX_FILE
    try:
        document = json.loads(index.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ImageError(f"the image store index {index} is unreadable ({exc}); delete it and pull again") from None
    if not isinstance(document, dict) or document.get("format") != INDEX_FORMAT:
        raise ImageError(f"the image store index {index} is of another format; delete it and pull again")
    images = document.get("images", {})
    return {key: value for key, value in images.items() if isinstance(value, dict) and "digest" in value}


def write_index(images: Mapping[str, Mapping[str, Any]]) -> None:
    """Replace the index in one rename (the caller holds :func:`store_lock`)."""
    folder = private.make_dir(store_dir())
    data = json.dumps({"format": INDEX_FORMAT, "images": dict(sorted(images.items()))}, indent=1).encode() + b"\n"
    with disk_full_as_error(folder, "writing the image index"):
        fd, temporary = tempfile.mkstemp(prefix=".images-", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, folder / INDEX_FILE)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise


def record(reference: str, image: PulledImage, *, stamp: str | None = None) -> PulledImage:
    """Enter ``image`` in the index under ``reference`` (the caller holds :func:`store_lock`)."""
    now = time.time()
    pulled = datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds")
    images = read_index()
    images[reference] = {
        "reference": reference,
        "digest": image.digest,
        "source_digest": image.source_digest,
        "pulled": pulled,
        "pulled_unix": now,
        **({"stamp": stamp} if stamp is not None else {}),
    }
    write_index(images)
    return dataclasses.replace(image, reference=reference, pulled=pulled)


def forget(references: list[str]) -> None:
    """Remove entries from the index (the caller holds :func:`store_lock`)."""
    images = read_index()
    for reference in references:
        images.pop(reference, None)
    write_index(images)


# --- blobs and images ---------------------------------------------------------------------


def verify_blob(digest: str, size: int | None = None) -> Path:
    """The blob of ``digest`` after hashing it; a blob whose content does not match is deleted and refused."""
    path = blob_path(digest)
    hasher = hashlib.sha256()
    length = 0
    try:
        with path.open("rb") as handle:
            while chunk := handle.read(_HASH_CHUNK):
                hasher.update(chunk)
                length += len(chunk)
    except FileNotFoundError:
        raise ImageError(
            f"blob {digest} is missing from the image store {layout_dir()}; pull the image again"
        ) from None
    actual = "sha256:" + hasher.hexdigest()
    if actual != digest or (size is not None and length != size):
        path.unlink(missing_ok=True)  # corrupt: the next pull must fetch it again, not reuse it
        found = actual if actual != digest else f"{length} bytes instead of {size}"
        raise DigestMismatch(
            f"digest mismatch for blob {digest} (its content hashes to {found}): the layer was tampered with or "
            "corrupted; it was removed from the store, pull again"
        )
    return path


def _read_json_blob(digest: str, size: int | None, *, verify: bool, what: str) -> dict[str, Any]:
    path = verify_blob(digest, size) if verify else blob_path(digest)
    try:
        document = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise ImageError(f"the {what} {digest} is missing from the image store {layout_dir()}; pull again") from None
    except ValueError:
        raise ImageError(f"the {what} {digest} in the image store is not JSON; pull again") from None
    if not isinstance(document, dict):
        raise ImageError(f"the {what} {digest} in the image store is not a JSON object; pull again")
    return document


def _strings(value: object) -> tuple[str, ...]:
    if isinstance(value, list):
        return tuple(str(item) for item in value)
    if isinstance(value, str):  # a shell-form Cmd stored as one string by some builders
        return ("/bin/sh", "-c", value)
    return ()


def image_config(document: Mapping[str, Any]) -> ImageConfig:
    """The runtime part of an OCI or Docker image config JSON."""
    config = document.get("config") or {}
    if not isinstance(config, dict):
        config = {}
    return ImageConfig(
        env=tuple(str(item) for item in config.get("Env") or () if isinstance(item, str)),
        working_dir=str(config.get("WorkingDir") or ""),
        user=str(config.get("User") or ""),
        entrypoint=_strings(config.get("Entrypoint")),
        cmd=_strings(config.get("Cmd")),
    )


def load(digest: str, reference: str, *, verify: bool = False, entry: Mapping[str, Any] | None = None) -> PulledImage:
    """The image of manifest ``digest`` in the layout; ``verify`` hashes every blob, else sizes are checked."""
    manifest = _read_json_blob(digest, None, verify=verify, what="manifest")
    media_type = manifest.get("mediaType", OCI_MANIFEST)
    if media_type not in (OCI_MANIFEST, DOCKER_MANIFEST) or "layers" not in manifest:
        raise ImageError(f"{reference}: the stored manifest {digest} is of type {media_type!r}, not an image manifest")
    config_descriptor = manifest.get("config") or {}
    config = _read_json_blob(
        str(config_descriptor.get("digest", "")), config_descriptor.get("size"), verify=verify, what="image config"
    )
    architecture, os_name = config.get("architecture"), config.get("os")
    if (architecture, os_name) != ("amd64", "linux"):
        raise NoMatchingPlatform(
            f"{reference} has no linux/amd64 image (it offers {os_name}/{architecture}); "
            "forkd guests run linux/amd64 images: choose a tag built for amd64",
            platforms=[f"{os_name}/{architecture}"],
        )
    layers = []
    for descriptor in manifest.get("layers") or []:
        layer_digest, size, layer_type = (
            descriptor.get("digest", ""),
            descriptor.get("size"),
            descriptor.get("mediaType", ""),
        )
        if layer_type not in LAYER_MEDIA_TYPES:
            raise ImageError(
                f"{reference}: layer {layer_digest} has the media type {layer_type!r}, which forkd cannot unpack"
            )
        if not isinstance(size, int) or size < 0:
            raise ImageError(f"{reference}: layer {layer_digest} has no valid size in its manifest")
        if verify:
            path = verify_blob(layer_digest, size)
        else:
            path = blob_path(layer_digest)
            try:
                actual = path.stat().st_size
            except FileNotFoundError:
                raise ImageError(
                    f"{reference}: layer {layer_digest} is missing from the image store; pull it again"
                ) from None
            if actual != size:
                raise DigestMismatch(
                    f"{reference}: layer {layer_digest} in the image store is {actual} bytes, not {size}; pull it again"
                )
        layers.append(Layer(digest=layer_digest, media_type=layer_type, size=size, path=path))
    entry = entry or {}
    return PulledImage(
        reference=reference,
        digest=digest,
        config=image_config(config),
        layers=tuple(layers),
        size=sum(layer.size for layer in layers),
        pulled=str(entry.get("pulled", "")),
        source_digest=str(entry.get("source_digest", "")),
    )


def verify(image: PulledImage) -> PulledImage:
    """Hash ``image``'s manifest, config and layers again (before a disk is built from them).

    A blob that does not match is removed from the store and DigestMismatch
    names it; pulling again fetches it anew.
    """
    checked = load(image.digest, image.reference, verify=True)
    return dataclasses.replace(checked, pulled=image.pulled, source_digest=image.source_digest)


def referenced_blobs(digest: str) -> set[str]:
    """The digests an image manifest keeps alive: itself, its config and its layers (missing blobs skipped)."""
    kept = {digest}
    try:
        manifest = json.loads(blob_path(digest).read_bytes())
    except (OSError, ValueError, ImageError):
        return kept
    for descriptor in [manifest.get("config") or {}, *(manifest.get("layers") or [])]:
        if isinstance(descriptor, dict) and isinstance(descriptor.get("digest"), str):
            kept.add(descriptor["digest"])
    return kept


def lookup(reference: str, *, stamp: str | None = None) -> PulledImage | None:
    """The stored image of a canonical reference, or None (not pulled, blobs gone, or its source changed)."""
    entry = read_index().get(reference)
    if entry is None or (stamp is not None and entry.get("stamp") != stamp):
        return None
    try:
        return load(entry["digest"], reference, entry=entry)
    except ImageError:
        return None  # a blob went missing or changed size: as good as not pulled


def list_pulled() -> list[PulledImage]:
    """Every image in the index whose blobs are all there, newest pull first."""
    images = []
    for reference, entry in read_index().items():
        try:
            images.append(load(entry["digest"], reference, entry=entry))
        except ImageError:
            continue
    return sorted(images, key=lambda image: image.pulled, reverse=True)
