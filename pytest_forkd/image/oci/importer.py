"""Copying an image source into the local store with skopeo, and checking what arrived.

``skopeo inspect --raw`` reads the source's manifest first: a manifest list is
resolved to its linux/amd64 entry here (an image without one is refused
with the platforms it offers, before anything is downloaded), and the layer
sizes give the progress lines their totals. That is the one time a tag is
read: from a registry, ``skopeo copy`` then copies the image by the digest
the tag had, so a tag that moves meanwhile cannot give a manifest of one
image and the blobs of another. The copy goes into the store's layout, while
its half-written blob files are measured for progress; the store lock is
held throughout, so pulls of several processes run one at a time and never
write the layout together. Whoever waits for the lock says so, naming the
pid that holds it (:class:`.store.StoreLock`), and a copy that makes no
progress for :data:`STALL_SECONDS` is stopped, so the lock is never held
without bound. Last, forkd hashes the manifest, the config and every layer
(each blob once: see :func:`.store.verify_blob`), and only then enters the
image in the index.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ... import private
from ...errors import DigestMismatch, ImageError, NoMatchingPlatform, RegistryUnreachable
from . import skopeo, store
from .store import PulledImage

__all__ = ["Progress", "import_image"]

Progress = Callable[[str], None]

INDEX_MEDIA_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)
PLATFORM = ("linux", "amd64")
#: How often a running copy is looked at, and how often it is reported at most.
POLL_SECONDS = 0.25
REPORT_SECONDS = 1.0
#: Name prefix of the files skopeo writes a blob into before renaming it into blobs/.
SKOPEO_TEMPORARY_PREFIX = "oci-put-blob"
INSPECT_TIMEOUT = 120
#: A copy that shows no progress (no byte written, no blob finished) this long is stopped.
STALL_SECONDS = 300.0


def _quiet(_line: str) -> None:
    return None


def import_image(
    source: str,
    key: str,
    *,
    registry: str | None = None,
    plain_http: bool = False,
    pinned: str | None = None,
    stamp: str | None = None,
    progress: Progress = _quiet,
) -> PulledImage:
    """Copy skopeo ``source`` into the store, verify it, and enter it in the index under ``key``."""
    private.make_dir(store.store_dir())
    tls = [f"--tls-verify={'false' if plain_http else 'true'}"] if registry else []
    top = _inspect_raw(source, tls, key=key, registry=registry)
    if pinned and "sha256:" + hashlib.sha256(top).hexdigest() != pinned:
        raise DigestMismatch(f"digest mismatch pulling {key}: the manifest the source sent does not hash to {pinned}")
    manifest, source_digest = _platform_manifest(source, top, tls, key=key, registry=registry)
    # The tag is read once: from a registry, the copy asks for the digest it had, not for the tag again.
    resolved = _with_digest(source, source_digest) if registry is not None else source
    layers = [entry for entry in manifest.get("layers", []) if isinstance(entry, dict)] if manifest else []
    with store.StoreLock(f"pulling {key}", progress=progress) as lock:
        image = _current(key, stamp, source_digest, lock)
        if image is None:
            image = _copy_verified(
                resolved, tls, key=key, registry=registry, layers=layers, progress=progress, lock=lock
            )
            image = dataclasses.replace(image, source_digest=source_digest or image.digest)
        image = store.record(key, image, stamp=stamp)
    progress(f"pulled {key}: {image.digest} ({len(image.layers)} layers, {image.size / 2**20:.1f} MiB)")
    return image


def _current(key: str, stamp: str | None, source_digest: str, lock: store.StoreLock) -> PulledImage | None:
    """The stored image of ``key`` when it is what the source has now, verified; else None (copy it)."""
    stored = store.lookup(key, stamp=stamp)
    if stored is None or not source_digest or stored.source_digest != source_digest:
        return None
    try:
        checked = store.load(stored.digest, key, verify=True, alive=lock.alive)
        return dataclasses.replace(checked, source_digest=source_digest)
    except DigestMismatch:
        return None  # a damaged blob, now removed: copy it again


def _copy_verified(
    source: str,
    tls: list[str],
    *,
    key: str,
    registry: str | None,
    layers: list[dict[str, Any]],
    progress: Progress,
    lock: store.StoreLock,
) -> PulledImage:
    """Copy, then hash every blob. skopeo reuses a blob the layout already has, so a damaged one
    (now removed by the check) is copied once more before the mismatch counts."""
    for attempt in (1, 2):
        digest = _copy(source, tls, key=key, registry=registry, layers=layers, progress=progress, lock=lock)
        try:
            return store.load(digest, key, verify=True, alive=lock.alive)
        except DigestMismatch:
            if attempt == 2:
                raise
            progress(f"pulling {key}: a stored blob was damaged; copying it again")
    raise AssertionError("unreachable")


def _inspect_raw(source: str, tls: list[str], *, key: str, registry: str | None) -> bytes:
    status, output, errors = skopeo.run(["inspect", "--raw", *tls, source], store.store_dir(), timeout=INSPECT_TIMEOUT)
    if status != 0:
        raise skopeo.classify(errors, source=key, registry=registry, store=store.store_dir())
    return output


def _platform_manifest(
    source: str, top: bytes, tls: list[str], *, key: str, registry: str | None
) -> tuple[dict[str, Any] | None, str]:
    """The linux/amd64 image manifest (None when it cannot be read ahead) and its digest at the source."""
    try:
        document = json.loads(top)
    except ValueError:
        raise ImageError(f"{key}: the source's manifest is not JSON; is it an image?") from None
    if not isinstance(document, dict):
        raise ImageError(f"{key}: the source's manifest is not a JSON object; is it an image?")
    if document.get("mediaType") not in INDEX_MEDIA_TYPES and "manifests" not in document:
        return document, "sha256:" + hashlib.sha256(top).hexdigest()
    entries = [entry for entry in document.get("manifests") or [] if isinstance(entry, dict)]
    for entry in entries:
        platform = entry.get("platform") or {}
        if isinstance(platform, dict) and (platform.get("os"), platform.get("architecture")) == PLATFORM:
            digest = str(entry.get("digest", ""))
            if registry is None:
                return None, digest  # a local index: skopeo picks the entry; no sizes ahead of the copy
            status, output, _errors = skopeo.run(
                ["inspect", "--raw", *tls, _with_digest(source, digest)], store.store_dir(), timeout=INSPECT_TIMEOUT
            )
            try:
                manifest = json.loads(output) if status == 0 else None
            except ValueError:
                manifest = None
            return (manifest if isinstance(manifest, dict) else None), digest
    offered = sorted({skopeo.platform_of(entry) for entry in entries} - {"unknown/unknown"})
    raise NoMatchingPlatform(
        f"{key} has no linux/amd64 image (it offers {', '.join(offered) or 'no platform'}); "
        "forkd guests run linux/amd64 images: choose a tag built for amd64",
        platforms=offered,
    )


def _with_digest(source: str, digest: str) -> str:
    """``docker://registry/repository:tag`` -> ``docker://registry/repository@digest``."""
    name = source[len("docker://") :].split("@", 1)[0]
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        name = name[:colon]
    return f"docker://{name}@{digest}"


def layout_name(key: str) -> str:
    """The image name a reference gets in the layout's own index.json (forkd reads its images.json instead)."""
    return "forkd-" + hashlib.sha256(key.encode()).hexdigest()[:32]


def make_private(layout: Path) -> None:
    """Narrow what skopeo wrote to its owner: it makes blobs 0644 whatever the umask (the folders are 0700 anyway)."""
    for folder, _folders, files in os.walk(layout):
        for name in files:
            path = os.path.join(folder, name)
            if os.lstat(path).st_mode & 0o077:
                os.chmod(path, private.FILE_MODE)


def remove_temporaries(layout: Path) -> None:
    """Remove the blob files an interrupted skopeo left half-written (the caller holds the store lock)."""
    if layout.is_dir():
        for leftover in layout.glob(f"{SKOPEO_TEMPORARY_PREFIX}*"):
            leftover.unlink(missing_ok=True)


def _copy(
    source: str,
    tls: list[str],
    *,
    key: str,
    registry: str | None,
    layers: list[dict[str, Any]],
    progress: Progress,
    lock: store.StoreLock,
) -> str:
    """``skopeo copy`` into the layout, reporting bytes done; returns the stored manifest digest."""
    root = store.store_dir()
    layout = private.make_dir(store.layout_dir())
    remove_temporaries(layout)
    source_tls = [option.replace("--tls-verify", "--src-tls-verify") for option in tls]
    with tempfile.TemporaryDirectory(prefix=".pull-", dir=root) as scratch:
        digest_file = Path(scratch) / "digest"
        stderr_file = Path(scratch) / "stderr"
        arguments = [
            "copy",
            "--quiet",
            "--retry-times",
            "2",
            "--remove-signatures",
            "--override-os",
            PLATFORM[0],
            "--override-arch",
            PLATFORM[1],
            "--digestfile",
            str(digest_file),
            *source_tls,
            source,
            f"oci:{layout}:{layout_name(key)}",
        ]
        reporter = _Reporter(key, layout, layers, progress)
        with store.disk_full_as_error(root, f"pulling {key}"):
            process = skopeo.start(arguments, root, stderr_file)
            try:
                while True:
                    try:
                        process.wait(timeout=POLL_SECONDS)
                        break
                    except subprocess.TimeoutExpired:
                        if reporter.poll():
                            lock.alive()
                        elif registry is not None and reporter.idle() > STALL_SECONDS:
                            raise RegistryUnreachable(
                                f"pulling {key} from {registry} made no progress for {STALL_SECONDS:.0f} s (skopeo "
                                "wrote nothing); it was stopped: check the network and the registry, and try again"
                            ) from None
            finally:
                if process.poll() is None:
                    process.kill()
                    process.wait()
                    remove_temporaries(layout)
        if process.returncode != 0:
            remove_temporaries(layout)
            raise skopeo.classify(stderr_file.read_text(errors="replace"), source=key, registry=registry, store=root)
        reporter.poll(final=True)
        digest = digest_file.read_text().strip()
    make_private(layout)
    if not digest.startswith("sha256:"):
        raise ImageError(f"pulling {key}: skopeo reported no manifest digest ({digest[:80]!r})")
    return digest


class _Reporter:
    """Progress lines of one copy: bytes done of total, from the sizes of the blobs skopeo writes."""

    def __init__(self, key: str, layout: Path, layers: list[dict[str, Any]], progress: Progress) -> None:
        self.key = key
        self.layout = layout
        self.progress = progress
        self.sizes = {str(entry.get("digest")): int(entry.get("size") or 0) for entry in layers}
        self.total = sum(self.sizes.values())
        self.present = {digest for digest in self.sizes if self._has(digest)}
        self.cached = sum(self.sizes[digest] for digest in self.present)
        self.last_report = 0.0
        self.last_done = -1
        self.seen = -1  # bytes done at the last poll
        self.moved = time.monotonic()  # when they last changed
        if self.sizes:
            fresh = len(self.sizes) - len(self.present)
            progress(
                f"pulling {key}: {len(self.sizes)} layers, {_mib(self.total)} MiB"
                + (f" ({len(self.present)} already in the store)" if self.present else "")
                + ("" if fresh else ", nothing to download")
            )
        else:
            progress(f"pulling {key}")

    def _has(self, digest: str) -> bool:
        try:
            return store.blob_path(digest).is_file()
        except ImageError:
            return False

    def idle(self) -> float:
        """Seconds since the copy last wrote a byte or finished a blob."""
        return time.monotonic() - self.moved

    def poll(self, *, final: bool = False) -> bool:
        """Report what was copied since the last poll; True when anything was."""
        finished = [digest for digest in self.sizes if digest not in self.present and self._has(digest)]
        self.present.update(finished)
        in_flight = 0
        for temporary in self.layout.glob(f"{SKOPEO_TEMPORARY_PREFIX}*"):
            try:
                in_flight += temporary.stat().st_size
            except FileNotFoundError:
                continue
        done = sum(self.sizes[digest] for digest in self.present) + in_flight
        written = done + len(self.present)  # what moves while skopeo works, unclamped
        if self.total:
            done = min(done, self.total)
        now = time.monotonic()
        total = f" of {_mib(self.total)} MiB" if self.total else " MiB"
        for digest in finished:
            self.progress(f"pulling {self.key}: layer {digest[:19]}… {_mib(done)}{total}")
            self.last_report, self.last_done = now, done
        if not finished and not final and done != self.last_done and now - self.last_report >= REPORT_SECONDS:
            self.progress(f"pulling {self.key}: {_mib(done)}{total}")
            self.last_report, self.last_done = now, done
        moved = written != self.seen
        if moved:
            self.seen, self.moved = written, now
        return moved


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f}"
