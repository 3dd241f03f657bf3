"""The local store of container images: one OCI image layout, and an index of what was pulled.

Layout under the forkd cache (``paths.cache_dir() / "oci"``)::

    layout/             one OCI image layout (oci-layout, index.json, blobs/sha256/<hex>)
                        that every pull copies into: blobs are stored once by digest and
                        shared by every image that has them
    images.json         the index: canonical reference -> manifest digest, pulled time
    disks/<hex>.ext4    read-only disks, one per image digest (built from the layers)
    verified/<hex>      a blob's stat when it was last hashed (see below)
    .store.lock         held while anything writes the layout or the index
    .store.lock.owner   who holds it: pid, since when, what for (for the processes that wait)

Only the index says what is pulled: a reference is listed once its manifest,
config and every layer are in the layout and have been hashed against their
digests, and the index is replaced in one rename. A pull that fails or is
interrupted may leave verified blobs behind (the next pull reuses them,
``forkd image prune`` removes them), but never an entry: nothing half-pulled
is listed or used. Everything is private to its owner (directories 0700,
files 0600), as the rest of the cache is.

The lock is waited for with a deadline and a progress line naming the
process that holds it (:class:`StoreLock`); its holder marks its progress on
the owner file, and a holder that shows none for :data:`LOCK_STALL_SECONDS`
is given up on, with the pid to stop.

Blobs are content-addressed and written once (skopeo renames a complete
blob into place), so a blob hashed once need not be hashed again while it is
the same file: :func:`verify_blob` remembers, in this process and in
``verified/<hex>`` for the next ones (each pytest-xdist worker), the size,
modification and change times (nanoseconds), inode and device of the file it
hashed, and trusts them while they match. Writing into a blob changes its
change time, which no user can set back; replacing it changes its inode. A
stat taken in the same clock tick as the blob's last change proves nothing
(a write in that tick would keep the time), so such a blob is hashed again
next time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Literal, get_args

from filelock import FileLock, Timeout

from ... import paths, private, processes
from ...errors import DigestMismatch, ImageError, ImageStoreFull, InvalidArgument, NoMatchingPlatform, WaitTimeout
from ...filesystems import Remedy, is_read_only, unwritable_text
from ...waiting import poll_until

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
OWNER_FILE = ".store.lock.owner"
VERIFIED = "verified"
#: How long a process waits for the store lock at most, however its holder progresses.
LOCK_TIMEOUT: Final = 2 * 3600.0
#: How long a holder may show no progress before a waiting process gives up on it.
LOCK_STALL_SECONDS: Final = 600.0
#: How often a waiting process says again that it waits.
LOCK_REPORT_SECONDS: Final = 30.0
#: A stat this close to a blob's last change (file times move by clock ticks of up to 10 ms) is not trusted.
RACY_NS: Final = 50_000_000
#: What to do when the image store's filesystem is full or read-only.
STORE_REMEDY: Final = Remedy(
    room="free space there (`forkd image prune` removes unused layers and disks) or set FORKD_CACHE_DIR to a "
    "folder with more room, and try again",
    elsewhere="set FORKD_CACHE_DIR to a folder on a writable filesystem, and try again",
)
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


def unwritable_error(failure: BaseException | str, folder: Path, doing: str) -> ImageError | None:
    """The error for a write into the image store that found no room (ImageStoreFull) or a read-only filesystem
    (ImageError), naming ``folder`` and the fix; None for any other failure (``failure`` is an exception or what
    a tool printed)."""
    text = unwritable_text(failure, folder, doing, STORE_REMEDY)
    if text is None:
        return None
    return ImageError(text) if is_read_only(failure) else ImageStoreFull(text)


@contextmanager
def disk_full_as_error(folder: Path, what: str) -> Iterator[None]:
    """Turn ENOSPC, EDQUOT and EROFS while writing into the one-line error naming ``folder`` and the fix."""
    try:
        yield
    except OSError as exc:
        error = unwritable_error(exc, folder, what)
        if error is None:
            raise
        raise error from None


#: How a lock holder that has not written its name yet is named.
UNKNOWN_HOLDER: Final = "another process"
#: How long a waiter gives a holder that has just taken the lock to write who it is (seconds).
OWNER_GRACE_SECONDS: Final = 1.0


class StoreLock:
    """The lock every writer of the layout or the index holds, taken with a deadline and a line for who waits.

    Used as a context manager. When another process holds it, ``progress``
    hears ``waiting for the image store lock held by PID N (pulling REF, for
    12 s)`` at once and every :data:`LOCK_REPORT_SECONDS` after; the wait
    ends in an ImageError when the holder shows no progress
    (:meth:`alive`) for :data:`LOCK_STALL_SECONDS`, or after ``timeout``.
    """

    def __init__(
        self,
        doing: str = "writing the image store",
        *,
        progress: Callable[[str], None] | None = None,
        timeout: float = LOCK_TIMEOUT,
    ) -> None:
        self.doing = doing
        self.progress = progress or (lambda _line: None)
        self.timeout = timeout
        folder = private.make_dir(store_dir())
        self.owner = folder / OWNER_FILE
        self.lock = FileLock(str(folder / LOCK_FILE), mode=private.FILE_MODE)

    def __enter__(self) -> StoreLock:
        self.acquire()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.release()

    def acquire(self) -> None:
        if not self._try():
            self._wait()
        self._write_owner()

    def release(self) -> None:
        self.owner.unlink(missing_ok=True)
        self.lock.release()

    def alive(self) -> None:
        """Mark progress (bytes copied, a blob hashed): processes waiting for the lock keep waiting."""
        try:
            os.utime(self.owner)
        except OSError:
            pass

    def _try(self) -> bool:
        try:
            self.lock.acquire(timeout=0)
        except Timeout:
            return False
        return True

    def _holder(self) -> tuple[str, float]:
        """Who holds the lock, in words, and when it last showed progress (0: unknown)."""
        try:
            text = self.owner.read_text()
            shown = self.owner.stat().st_mtime
        except OSError:
            return UNKNOWN_HOLDER, 0.0
        pid, _, rest = text.partition(" ")
        started, _, doing = rest.partition(" ")
        if not pid.isdigit() or not processes.is_alive(int(pid)):
            return UNKNOWN_HOLDER, 0.0
        try:
            since = f", for {time.time() - float(started):.0f} s"
        except ValueError:
            since = ""
        return f"PID {pid} ({doing.strip() or 'writing the image store'}{since})", shown

    def _named_holder(self) -> str | None:
        """Who holds the lock, giving a holder that took it a moment ago that moment to write its name.

        None when the lock was free meanwhile (and is now ours).
        """
        found: dict[str, str | None] = {}

        def named() -> bool:
            if self._try():
                found["holder"] = None
                return True
            found["holder"] = self._holder()[0]
            return found["holder"] != UNKNOWN_HOLDER

        try:
            poll_until(named, timeout=OWNER_GRACE_SECONDS, what="the lock holder's name")
        except WaitTimeout:
            pass  # a holder that never says who it is: named as unknown
        return found["holder"]

    def _wait(self) -> None:
        holder = self._named_holder()
        if holder is None:
            return
        self.progress(f"waiting for the image store lock held by {holder}")
        state = {"reported": time.monotonic()}

        def taken() -> bool:
            if self._try():
                return True
            holder, shown = self._holder()
            if shown and time.time() - shown > LOCK_STALL_SECONDS:
                raise ImageError(
                    f"the image store lock {self.lock.lock_file} is held by {holder}, which has shown no progress "
                    f"for {LOCK_STALL_SECONDS:.0f} s; if that process is stuck, stop it and try again"
                )
            if time.monotonic() - state["reported"] >= LOCK_REPORT_SECONDS:
                state["reported"] = time.monotonic()
                self.progress(f"still waiting for the image store lock held by {holder}")
            return False

        def timed_out(message: str) -> ImageError:
            return ImageError(
                f"{message} (the image store lock {self.lock.lock_file}, held by {self._holder()[0]}); if that "
                "process is stuck, stop it and try again"
            )

        poll_until(
            taken,
            timeout=self.timeout,
            what=f"the image store lock to {self.doing}",
            interval=0.05,
            backoff=1.0,
            error=timed_out,
        )

    def _write_owner(self) -> None:
        temporary = self.owner.with_name(f"{OWNER_FILE}.{os.getpid()}.tmp")
        try:
            private.write_bytes(temporary, f"{os.getpid()} {time.time():.3f} {self.doing}\n".encode())
            os.replace(temporary, self.owner)
        except OSError:
            temporary.unlink(missing_ok=True)  # only the waiting line loses its pid


def store_lock(doing: str = "writing the image store", progress: Callable[[str], None] | None = None) -> StoreLock:
    """The lock every writer of the layout or the index holds (pulls of several workers run one at a time)."""
    return StoreLock(doing, progress=progress)


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


#: digest -> the stat of the blob this process hashed (see :func:`verify_blob`).
_HASHED_HERE: dict[str, str] = {}


def _stat_key(status: os.stat_result) -> str:
    return f"{status.st_size}:{status.st_mtime_ns}:{status.st_ctime_ns}:{status.st_ino}:{status.st_dev}"


def verified_dir() -> Path:
    """Where each hashed blob's stat is kept: ``verified/<hex>``."""
    return store_dir() / VERIFIED


def _stamped(digest: str) -> str | None:
    try:
        return (verified_dir() / digest.partition(":")[2]).read_text().strip()
    except OSError:
        return None


def _stamp(digest: str, key: str) -> None:
    """Record that the blob of ``digest`` hashed right with the stat ``key`` (renamed into place: all or nothing)."""
    folder = verified_dir()
    name = digest.partition(":")[2]
    temporary = folder / f".{name}.{os.getpid()}.tmp"
    try:
        private.make_dir(folder)
        private.write_bytes(temporary, key.encode())
        os.replace(temporary, folder / name)
    except OSError:
        temporary.unlink(missing_ok=True)  # the next process hashes it again, nothing worse


def verify_blob(digest: str, size: int | None = None) -> Path:
    """The blob of ``digest`` after hashing it; a blob whose content does not match is deleted and refused.

    A blob this process or an earlier one hashed is not hashed again while its
    stat is the one it had then (see the module's doc).
    """
    path = blob_path(digest)
    try:
        handle = path.open("rb")
    except FileNotFoundError:
        raise ImageError(
            f"blob {digest} is missing from the image store {layout_dir()}; pull the image again"
        ) from None
    with handle:
        looked = time.time_ns()
        before = os.fstat(handle.fileno())
        key = _stat_key(before)
        if size is not None and before.st_size != size:
            actual, length = None, before.st_size
        elif key in (_HASHED_HERE.get(digest), _stamped(digest)):
            return path
        else:
            hasher = hashlib.sha256()
            length = 0
            while chunk := handle.read(_HASH_CHUNK):
                hasher.update(chunk)
                length += len(chunk)
            actual = "sha256:" + hasher.hexdigest()
            after = os.fstat(handle.fileno())
    if actual != digest or (size is not None and length != size):
        path.unlink(missing_ok=True)  # corrupt: the next pull must fetch it again, not reuse it
        _HASHED_HERE.pop(digest, None)
        found = actual if actual not in (None, digest) else f"{length} bytes instead of {size}"
        raise DigestMismatch(
            f"digest mismatch for blob {digest} (its content hashes to {found}): the layer was tampered with or "
            "corrupted; it was removed from the store, pull again"
        )
    if _stat_key(after) == key and looked - before.st_ctime_ns > RACY_NS:
        _HASHED_HERE[digest] = key
        _stamp(digest, key)
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


def load(
    digest: str,
    reference: str,
    *,
    verify: bool = False,
    entry: Mapping[str, Any] | None = None,
    alive: Callable[[], None] | None = None,
) -> PulledImage:
    """The image of manifest ``digest`` in the layout; ``verify`` hashes every blob, else sizes are checked.

    ``alive`` is called after each layer is checked (a lock holder's :meth:`StoreLock.alive`).
    """
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
            if alive is not None:
                alive()
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
