"""Portable snapshots: one archive that another host imports and forks from.

An archive is a tar stream compressed with zstd (``zstd -dc FILE | tar -tv``
lists it)::

    manifest.json            first: everything import checks before reading any data
    snapshot/snapshot.json   the snapshot record
    snapshot/state.bin       device state
    snapshot/memory.ram      guest memory, packed: only its non-zero pages (offsets in the manifest)
    image/...                the guest image the snapshot was taken with

The manifest names what a restore depends on (QEMU version, machine and CPU
model, accelerator, memory size, image key, recipe hash) and the size and
checksum of every file: the content checksums the store records with every
snapshot (:mod:`pytest_forkd.storage.integrity`), reused as they are for the
snapshot's data files, so an export does not checksum guest memory again and
an import checks it once, when the store records the imported files. Import
refuses an archive of a newer format, one made for another QEMU or machine, a
``-cpu host`` KVM snapshot from another CPU, and any file whose size or
checksum differs (a corrupt or truncated archive).

Guest memory is mostly holes and zero pages, so only the non-zero pages are
stored and import writes them back into a sparse file: a 256 MiB snapshot
moves as a few tens of MiB. The image travels too (kernel, initramfs, stubs):
a restored child needs the image's files, and a test session needs the image
itself to recognise an imported snapshot as built from its recipe, so a
fresh cache forks from an import without building anything.

Nothing half-imported ever shows: the snapshot is assembled in the store's
temporary directory and the image in a temporary directory of the image
cache, both verified completely, then published with one rename each.
"""

from __future__ import annotations

import io
import json
import os
import platform
import secrets
import shutil
import tarfile
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any, Final

from filelock import FileLock

from pytest_forkd import paths, private, zstdio
from pytest_forkd.engine import memory, space
from pytest_forkd.engine.cpu import host_cpu, host_cpu_id
from pytest_forkd.engine.host import find_qemu, has_network_card, machine_record, machine_record_of_hash, tsc_khz
from pytest_forkd.engine.network import network_from_record
from pytest_forkd.errors import ArchiveError, DamagedSnapshot, ForkdError, IncompatibleSnapshot, SnapshotError
from pytest_forkd.image.catalog import MANIFEST_FILE as IMAGE_MANIFEST
from pytest_forkd.image.catalog import image_directory, is_published, key_of, point_name, read_manifest
from pytest_forkd.storage import integrity, namespaces
from pytest_forkd.storage.backend import MEMORY_FILE
from pytest_forkd.storage.local_copy import write_flat_memory
from pytest_forkd.storage.snapshot import SNAPSHOT_FILE, Snapshot
from pytest_forkd.storage.store import DEFAULT_STALE_AGE_S, SnapshotStore
from pytest_forkd.version import __version__

ARCHIVE_FORMAT: Final = "pytest-forkd-snapshot-archive"
#: Bump when the archive layout changes; import refuses archives of a higher version.
ARCHIVE_VERSION: Final = 1
MANIFEST_NAME: Final = "manifest.json"
SNAPSHOT_DIR: Final = "snapshot"
IMAGE_DIR: Final = "image"
SUFFIX: Final = ".forkd.tar.zst"

_PAGE: Final = 4096
_CHUNK: Final = 1 << 20
_ZEROS: Final = bytes(_CHUNK)
_MAX_MANIFEST_BYTES: Final = 16 << 20


@dataclass(frozen=True)
class ArchiveInfo:
    """What an export or import did: the archive, its manifest, sizes and time taken."""

    path: Path
    manifest: Mapping[str, Any]
    seconds: float
    archive_bytes: int
    snapshot: Snapshot | None = None
    """The imported snapshot (None after an export)."""

    @property
    def memory_bytes(self) -> int:
        """Apparent size of the snapshot's memory file (its guest RAM)."""
        return sum(entry["size"] for entry in self.manifest["files"] if entry.get("extents") is not None)

    @property
    def stored_memory_bytes(self) -> int:
        """Non-zero bytes of guest memory actually carried, before compression."""
        return sum(entry["stored"] for entry in self.manifest["files"] if entry.get("extents") is not None)


# --- export ----------------------------------------------------------------------------------------------


def export_snapshot(
    snapshot: Snapshot | str, destination: Path | str, *, store: SnapshotStore | Path | str | None = None
) -> ArchiveInfo:
    """Write ``snapshot`` (a record, or a tag in ``store``) and its image into the archive ``destination``.

    A diff snapshot is flattened onto its base on the way (the archive stands
    alone). The archive appears under its name only once complete.
    """
    started = time.perf_counter()
    if isinstance(snapshot, str):
        snapshot = _store(store).get(snapshot)
    snapshot = snapshot.wait_ready()
    destination = Path(destination)
    if destination.is_dir():
        raise ArchiveError(
            f"{destination} is a directory; give the archive's file name, e.g. {destination / (snapshot.tag + SUFFIX)}"
        )
    image_key = snapshot.fingerprint.get("image")
    if not image_key or not is_published(image_key):
        raise ArchiveError(
            f"snapshot {snapshot.tag!r} needs image {image_key or '<not recorded>'}, which is not in "
            f"{paths.images_dir()}; export it on the host (or with the cache) where it was taken"
        )
    SnapshotStore(snapshot.path.parent, clean=False).check_restorable(snapshot)  # no damaged file leaves
    image_dir = image_directory(image_key)
    image_manifest = read_manifest(image_dir)
    container = image_manifest.get("container")
    if container:
        raise ArchiveError(
            f"snapshot {snapshot.tag!r} runs on container image {container.get('reference')}, whose disk an "
            "archive does not carry yet; on the other host, pull the image (forkd image pull REF) and build the "
            "snapshot there from the same forkd.yaml"
        )
    machine = _machine_of(snapshot, tuple(image_manifest.get("kernel_args", ())))  # as recorded, or derived
    with tempfile.TemporaryDirectory(prefix="forkd-export-", dir=_scratch_root(snapshot.memory_mib << 20)) as scratch:
        try:
            files = _snapshot_files(snapshot, Path(scratch))
        except OSError as exc:
            if not space.is_no_space(exc):
                raise
            raise ArchiveError(
                space.no_space_text(
                    exc, scratch, f"flattening snapshot {snapshot.tag!r} for export", "free space there and try again"
                )
            ) from None
        files += [
            (f"{IMAGE_DIR}/{name}", image_dir / name, False, None)
            for name in sorted(os.listdir(image_dir))
            if (image_dir / name).is_file() and not name.startswith(".")
        ]
        entries = [_scan(path, name, sparse, checksum) for name, path, sparse, checksum in files]
        manifest = {
            "format": ARCHIVE_FORMAT,
            "format_version": ARCHIVE_VERSION,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "pytest_forkd": _version(),
            "snapshot": snapshot.tag,
            "recipe_hash": snapshot.extra.get("recipe_hash"),
            "backend": snapshot.backend,
            "image": {
                "name": snapshot.image,
                "key": image_key,
                "kernel_args": list(image_manifest.get("kernel_args", [])),
            },
            **machine,
            "memory_mib": snapshot.memory_mib,
            "vcpus": snapshot.vcpus,
            # a project's own snapshot (forkd.yaml) or a shared one (base): where an import puts it
            "scope": "project" if snapshot.path.parent.parent.name == namespaces.PROJECTS_DIR else "shared",
            "host": {"node": platform.node(), "cpu": host_cpu(), "tsc_khz": tsc_khz()},
            "host_cpu": snapshot.fingerprint.get("host_cpu"),  # the CPU a KVM snapshot was taken on
            "files": [entry.to_json() for entry in entries],
        }
        partial = destination.with_name(f".{destination.name}.{os.getpid()}-{secrets.token_hex(4)}.partial")
        try:
            with (
                zstdio.compressing(partial, error=ArchiveError) as raw,
                tarfile.open(fileobj=raw, mode="w|", format=tarfile.PAX_FORMAT) as tar,
            ):
                _add_bytes(tar, MANIFEST_NAME, (json.dumps(manifest, indent=2) + "\n").encode())
                for entry in entries:
                    info = tarfile.TarInfo(entry.name)
                    info.size, info.mode, info.mtime = entry.stored, 0o600, int(time.time())
                    with open(entry.source, "rb") as stream:
                        tar.addfile(info, _Packed(stream, entry.extents) if entry.extents is not None else stream)
            os.replace(partial, destination)
        except OSError as exc:
            if space.is_no_space(exc):
                raise ArchiveError(
                    space.no_space_text(
                        exc,
                        destination.parent,
                        f"exporting snapshot {snapshot.tag!r}",
                        "free space there or export elsewhere, and try again",
                    )
                ) from None
            raise ArchiveError(f"cannot write {destination}: {exc.strerror or exc}") from None
        finally:
            partial.unlink(missing_ok=True)
    return ArchiveInfo(destination, manifest, time.perf_counter() - started, destination.stat().st_size)


def _snapshot_files(snapshot: Snapshot, scratch: Path) -> list[tuple[str, Path, bool, str | None]]:
    """(name in the archive, file, is guest memory, known checksum) of the snapshot.

    A diff is flattened into ``scratch``. The record written into the archive
    lists its files' sizes and checksums (the ones the store recorded, or new
    ones for flattened memory), which the importing store checks them against.
    """
    files: dict[str, dict[str, Any]] = {}
    state_entry = snapshot.files.get(snapshot.state_file)
    files[snapshot.state_file] = (
        dict(state_entry) if state_entry is not None else integrity.record_file(snapshot.state_path).to_json()
    )
    memory_entry = snapshot.files.get(snapshot.memory_file) if snapshot.memory_file else None
    if snapshot.memory_path is not None:
        memory_path = snapshot.memory_path
    else:
        memory_path = scratch / MEMORY_FILE
        write_flat_memory(snapshot, memory_path)
    files[MEMORY_FILE] = (
        dict(memory_entry) if memory_entry is not None else integrity.record_file(memory_path).to_json()
    )
    for entry in files.values():
        entry.pop("mtime_ns", None)  # a property of this host's copy, not of the content
    record = snapshot.replace(
        path=scratch,
        owner=None,
        status="ready",
        error=None,
        writer_pid=None,
        writer_host=None,
        files=files,
        memory_file=MEMORY_FILE,
        diff_file=None,
        base=None,
        extra={key: value for key, value in snapshot.extra.items() if key != "base_dir"},
    )
    record.save_to(scratch)
    return [
        (f"{SNAPSHOT_DIR}/{SNAPSHOT_FILE}", scratch / SNAPSHOT_FILE, False, None),
        (f"{SNAPSHOT_DIR}/{snapshot.state_file}", snapshot.state_path, False, files[snapshot.state_file]["checksum"]),
        (f"{SNAPSHOT_DIR}/{MEMORY_FILE}", memory_path, True, files[MEMORY_FILE]["checksum"]),
    ]


def _machine_of(snapshot: Snapshot, kernel_args: tuple[str, ...]) -> dict[str, Any]:
    """QEMU version, machine, CPU model, accelerator and arguments the snapshot was taken with.

    A record keeps them (``Snapshot.machine``). Records written before it
    was kept have only their hash: the machine arguments are found again by
    hashing the candidates (both accelerators) with the recorded QEMU version.
    """
    if snapshot.machine is not None and {"machine", "cpu_model", "accel", "machine_args"} <= set(snapshot.machine):
        return {
            **snapshot.machine,
            "qemu_version": snapshot.fingerprint.get("qemu", snapshot.machine.get("qemu_version")),
        }
    recorded = snapshot.fingerprint.get("machine")
    versions = [snapshot.fingerprint.get("qemu")]
    try:
        versions.append(find_qemu().version)
    except ForkdError:
        pass
    found = machine_record_of_hash(
        recorded,
        [version for version in versions if version],
        memory_mib=snapshot.memory_mib,
        vcpus=snapshot.vcpus,
        kernel_args=kernel_args,
        network_card=network_from_record(snapshot.network).has_card,
    )
    if found is not None:
        return {**found, "qemu_version": snapshot.fingerprint.get("qemu", found["qemu_version"])}
    raise ArchiveError(
        f"cannot tell which machine snapshot {snapshot.tag!r} was taken on (its machine fingerprint {recorded!r} "
        "matches no QEMU command line of this pytest-forkd version); export it with the pytest-forkd version "
        "that took it, or take it again"
    )


# --- import ----------------------------------------------------------------------------------------------


def import_archive(
    path: Path | str,
    *,
    store: SnapshotStore | Path | str | None = None,
    replace: bool = False,
    name: str | None = None,
    project: Path | str | None = None,
) -> ArchiveInfo:
    """Check and unpack an archive: the snapshot into ``store``, its image into the image cache.

    Refuses an existing snapshot of the same name unless ``replace``;
    ``name`` imports it under another name. A snapshot that belonged to a
    project (declared in its forkd.yaml) goes into the namespace of
    ``project`` (default: the project around the working directory), as a
    run there looks it up; a shared one (``base``) into the store itself.
    :func:`pytest_forkd.import_snapshot` is this plus the factory to fork from.
    """
    started = time.perf_counter()
    path = Path(path)
    if not path.is_file():
        raise ArchiveError(f"no snapshot archive at {path}; give the file `forkd snapshots export` wrote")
    root = _store(store)
    done = _import(path, root, project, replace, name, known=None)
    if done is None:  # repacked by hand, the manifest is not first: find it, then unpack
        done = _import(path, root, project, replace, name, known=read_archive_manifest(path))
    assert done is not None
    snapshot, manifest = done
    return ArchiveInfo(path, manifest, time.perf_counter() - started, path.stat().st_size, snapshot)


def _import(
    path: Path,
    root: SnapshotStore,
    project: Path | str | None,
    replace: bool,
    name: str | None,
    known: dict[str, Any] | None,
) -> tuple[Snapshot, dict[str, Any]] | None:
    """One pass over the archive; None when the manifest is not its first file and ``known`` is None."""
    with zstdio.decompressing(path, error=ArchiveError) as raw:
        try:
            tar = tarfile.open(fileobj=raw, mode="r|")
            members = _files(tar)
            manifest = known
            if manifest is None:
                first = next(members, None)
                if first is None or first.name != MANIFEST_NAME:
                    return None
                manifest = _read_manifest(path, _read_member(tar, first, _MAX_MANIFEST_BYTES))
            store = _target_store(root, manifest, project)
            tag = paths.validate_tag(name or manifest["snapshot"])
            problem = store.read_only_reason()
            if problem is not None:
                raise SnapshotError(
                    f"cannot import {path} into the snapshot store {store.root}: {problem}; "
                    "import into a writable store (--store DIR) and share that"
                )
            if store.exists(tag) and not replace:
                raise SnapshotError(
                    f"snapshot {tag!r} already exists in {store.root}; import with --replace "
                    "(Python: replace=True) to overwrite it, or import it under another name with --name"
                )
            check_host(manifest, tag)
            return _unpack(path, tar, members, manifest, store, tag, replace), manifest
        except tarfile.TarError as exc:
            raise ArchiveError(f"{path} is corrupt or truncated ({exc}); export it again") from None
        except EOFError:
            raise ArchiveError(f"{path} is truncated; export it again") from None


def _unpack(
    path: Path,
    tar: tarfile.TarFile,
    members: Iterator[tarfile.TarInfo],
    manifest: Mapping[str, Any],
    store: SnapshotStore,
    tag: str,
    replace: bool,
) -> Snapshot:
    entries = {entry["path"]: entry for entry in manifest["files"]}
    image = manifest["image"]
    image_key = paths.validate_tag(image["key"], "image key")
    image_staging = None if is_published(image_key) else _ImageStaging(image_key)
    try:
        with store.begin(tag, replace=replace) as pending:
            seen: set[str] = set()
            for member in members:
                if member.name == MANIFEST_NAME:
                    continue
                entry = entries.get(member.name)
                if entry is None or member.name in seen:
                    raise ArchiveError(f"{path} is corrupt: unexpected member {member.name!r}; export it again")
                seen.add(member.name)
                folder, _, filename = member.name.partition("/")
                if folder == SNAPSHOT_DIR:
                    target: Path | None = pending.dir / filename
                else:
                    target = image_staging.dir / filename if image_staging is not None else None
                data_file = folder == SNAPSHOT_DIR and filename != SNAPSHOT_FILE
                try:
                    _extract(path, tar, member, entry, target, verify=not data_file)
                except OSError as exc:
                    if not space.is_no_space(exc) or target is None:
                        raise
                    where = store.root if folder == SNAPSHOT_DIR else paths.images_dir()
                    raise ArchiveError(
                        space.no_space_text(exc, where, f"importing {path.name} as snapshot {tag!r}")
                        + "; nothing was left behind"
                    ) from None
            missing = sorted(set(entries) - seen)
            if missing:
                raise ArchiveError(f"{path} is truncated: {', '.join(missing)} missing; export it again")
            record = Snapshot.load_from(pending.dir, remedy="export the snapshot again")
            for name in integrity.data_files(record):
                listed = entries.get(f"{SNAPSHOT_DIR}/{name}")
                recorded = record.files.get(name)
                if listed is None or recorded is None or recorded["checksum"] != listed["checksum"]:
                    raise ArchiveError(
                        f"{path} is inconsistent: its snapshot record and its manifest disagree "
                        f"about {name}; export it again"
                    )
            if record.fingerprint.get("image") != image_key:
                raise ArchiveError(
                    f"{path} is inconsistent: its snapshot needs image "
                    f"{record.fingerprint.get('image')!r}, its manifest carries {image_key!r}"
                )
            extra = {
                **record.extra,
                "imported": {
                    "archive": path.name,
                    "from_host": manifest["host"].get("node"),
                    "exported": manifest.get("created"),
                },
            }
            record = record.replace(tag=tag, path=pending.dir, extra=extra)
            try:
                published = pending.publish(record)  # the store checksums the data files against the record
            except DamagedSnapshot as exc:
                raise ArchiveError(
                    f"{path} is corrupt: {', '.join(exc.problems)} (checksum of the unpacked file "
                    "differs from the archive's manifest); export it again"
                ) from None
            # The image (verified while unpacked) goes in only once the snapshot is known to be intact.
            try:
                if image_staging is not None:
                    image_staging.publish()
                if key_of(image["name"]) is None:
                    point_name(image["name"], image_key)
            except BaseException:
                store.remove(tag)
                raise
            return published
    finally:
        if image_staging is not None:
            image_staging.abort()


class _ImageStaging:
    """An image being imported: written next to the published images, renamed into place when verified."""

    def __init__(self, key: str) -> None:
        self.key = key
        root = private.make_dir(paths.images_dir())  # private like every image directory
        for stale in root.glob(".import-*"):  # left by an import that was killed
            try:
                if time.time() - stale.stat().st_mtime > DEFAULT_STALE_AGE_S:
                    shutil.rmtree(stale, ignore_errors=True)
            except FileNotFoundError:
                pass
        self.dir = Path(tempfile.mkdtemp(dir=root, prefix=f".import-{key}-"))

    def publish(self) -> None:
        locks = private.make_dir(paths.images_dir() / ".locks")
        with FileLock(locks / f"{self.key}.lock", mode=private.FILE_MODE):  # the lock image builds of this key take
            if is_published(self.key):
                return  # built or imported meanwhile: the same key is the same image
            if not (self.dir / IMAGE_MANIFEST).is_file():
                raise ArchiveError(f"the archive's image {self.key} has no {IMAGE_MANIFEST}; export it again")
            destination = image_directory(self.key)
            if destination.exists():  # a damaged leftover without a manifest
                shutil.rmtree(destination)
            os.rename(self.dir, destination)

    def abort(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _extract(
    archive: Path,
    tar: tarfile.TarFile,
    member: tarfile.TarInfo,
    entry: Mapping[str, Any],
    target: Path | None,
    *,
    verify: bool,
) -> None:
    """Write one member to ``target`` (None: skip it), checking its layout and, with ``verify``, its checksum.

    Guest memory is written back sparse: only its stored extents. The
    snapshot's data files are not checksummed here: publishing them into the
    store does that against the record (once).
    """
    if member.size != entry["stored"]:
        raise ArchiveError(
            f"{archive} is corrupt: {member.name} holds {member.size} bytes, its manifest says "
            f"{entry['stored']}; export it again"
        )
    if target is None:
        return  # the stream skips the member's data
    stream = tar.extractfile(member)
    assert isinstance(stream, io.BufferedReader)  # tarfile's ExFileObject: a regular member
    extents = entry.get("extents")
    layout = [(0, entry["size"])] if extents is None else [tuple(extent) for extent in extents]
    descriptor = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(descriptor, entry["size"])
        position = 0
        buffer = bytearray(_CHUNK)
        for offset, length in layout:
            if offset < position or offset + length > entry["size"]:
                raise ArchiveError(f"{archive} is corrupt: bad extent ({offset}, {length}) in {member.name}")
            done = 0
            while done < length:
                view = memoryview(buffer)[: min(_CHUNK, length - done)]
                got = stream.readinto(view)
                if not got:
                    raise ArchiveError(f"{archive} is truncated inside {member.name}; export it again")
                os.pwrite(descriptor, view[:got], offset + done)
                done += got
            position = offset + length
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    if verify and integrity.checksum(target) != entry["checksum"]:
        raise ArchiveError(
            f"{archive} is corrupt: {member.name} does not match its checksum in the manifest; export it again"
        )


# --- compatibility ---------------------------------------------------------------------------------------


def check_host(manifest: Mapping[str, Any], tag: str | None = None) -> None:
    """Raise IncompatibleSnapshot, naming the difference, unless this host can restore the archive.

    Children must run the same QEMU version with the same machine arguments;
    a KVM snapshot taken with ``-cpu host`` also needs the same CPU.
    """
    tag = tag or manifest["snapshot"]
    local = find_qemu()
    if manifest["qemu_version"] != local.version:
        raise IncompatibleSnapshot(
            f"snapshot {tag!r} was made with QEMU {manifest['qemu_version']} and this host runs QEMU "
            f"{local.version} ({local.binary}); a snapshot restores only on the QEMU version that took it: "
            f"import it on a host with QEMU {manifest['qemu_version']}, or rebuild it here"
        )
    if manifest["accel"] == "kvm" and manifest["cpu_model"] == "host":
        theirs, ours = manifest.get("host_cpu") or _cpu_text(manifest["host"].get("cpu")), host_cpu_id()
        if theirs != ours:
            raise IncompatibleSnapshot(
                f"snapshot {tag!r} is a KVM snapshot taken with -cpu host on {theirs!r} and this host's CPU is "
                f"{ours!r}; it restores only on the same CPU (model and flags): rebuild it here, or take it "
                "under TCG (--forkd-accel=tcg), whose CPU model is fixed"
            )
    here = machine_record(
        local,
        accel=manifest["accel"],
        memory_mib=manifest["memory_mib"],
        vcpus=manifest["vcpus"],
        kernel_args=tuple(manifest["image"].get("kernel_args", ())),
        network_card=has_network_card(list(manifest.get("machine_args", []))),
    )
    if here["machine_fingerprint"] != manifest["machine_fingerprint"]:
        args = here["machine_args"]
        their_args = list(manifest.get("machine_args", []))
        changed = [f"{a} -> {b}" for a, b in zip(their_args, args) if a != b] or ["kernel arguments or other details"]
        raise IncompatibleSnapshot(
            f"snapshot {tag!r} was taken with other machine arguments than this pytest-forkd uses "
            f"({'; '.join(changed)}); import it with the pytest-forkd version that exported it "
            f"({manifest.get('pytest_forkd')}), or rebuild it here"
        )


def read_archive_manifest(path: Path | str) -> dict[str, Any]:
    """The manifest of an archive, without unpacking anything else (``forkd snapshots import --check``)."""
    path = Path(path)
    if not path.is_file():
        raise ArchiveError(f"no snapshot archive at {path}")
    manifest = None
    with zstdio.decompressing(path, error=ArchiveError) as raw:
        try:
            tar = tarfile.open(fileobj=raw, mode="r|")
            for member in _files(tar):  # read to the end, so damage anywhere shows
                if member.name == MANIFEST_NAME and manifest is None:
                    manifest = _read_manifest(path, _read_member(tar, member, _MAX_MANIFEST_BYTES))
        except tarfile.TarError as exc:
            raise ArchiveError(f"{path} is corrupt or truncated ({exc}); export it again") from None
    if manifest is None:
        raise ArchiveError(
            f"{path} is not a pytest-forkd snapshot archive: it has no {MANIFEST_NAME}; give a "
            "file written by `forkd snapshots export`"
        )
    return manifest


def _files(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    """The regular files of a tar stream, named without a leading ``./`` (archives repacked with tar -C DIR .)."""
    for member in tar:
        if member.isdir():
            continue
        member.name = member.name.removeprefix("./")
        if not member.isfile():
            raise ArchiveError(
                f"the archive holds {member.name!r}, which is not a regular file; it is not one "
                "`forkd snapshots export` wrote"
            )
        yield member


_REQUIRED: Final = {
    "snapshot": str,
    "qemu_version": str,
    "accel": str,
    "cpu_model": str,
    "machine": str,
    "machine_fingerprint": str,
    "memory_mib": int,
    "vcpus": int,
    "image": dict,
    "host": dict,
    "files": list,
}


def _read_manifest(path: Path, data: bytes) -> dict[str, Any]:
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ArchiveError(f"{path} is corrupt: its {MANIFEST_NAME} is not JSON ({exc}); export it again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != ARCHIVE_FORMAT:
        raise ArchiveError(
            f"{path} is not a pytest-forkd snapshot archive (no format {ARCHIVE_FORMAT!r} in {MANIFEST_NAME})"
        )
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ArchiveError(f"{path} is corrupt: format_version {version!r} is not a number")
    if version > ARCHIVE_VERSION:
        raise ArchiveError(
            f"{path} has archive format {version}, newer than this pytest-forkd reads ({ARCHIVE_VERSION}); "
            f"it was written by pytest-forkd {manifest.get('pytest_forkd', '(newer)')}: upgrade pytest-forkd here"
        )
    for field, kind in _REQUIRED.items():
        if not isinstance(manifest.get(field), kind) or isinstance(manifest.get(field), bool):
            raise ArchiveError(
                f"{path} is corrupt: {MANIFEST_NAME} field {field!r} is missing or not a {kind.__name__}"
            )
    for index, entry in enumerate(manifest["files"]):
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("path"), str)
            and isinstance(entry.get("size"), int)
            and isinstance(entry.get("stored"), int)
            and isinstance(entry.get("checksum"), str)
            and entry["checksum"].startswith(f"{integrity.ALGORITHM}:")
            and entry["path"].partition("/")[0] in (SNAPSHOT_DIR, IMAGE_DIR)
            and "/" not in entry["path"].partition("/")[2]
            and not entry["path"].endswith(("/", "/."))
            and ".." not in entry["path"].split("/")
        ):
            raise ArchiveError(f"{path} is corrupt: {MANIFEST_NAME} files[{index}] is malformed")
    if not isinstance(manifest["image"].get("key"), str) or not isinstance(manifest["image"].get("name"), str):
        raise ArchiveError(f"{path} is corrupt: {MANIFEST_NAME} image needs a key and a name")
    return manifest


# --- helpers ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    name: str
    source: Path
    size: int
    checksum: str
    """The file's content checksum, as the store records it (:func:`pytest_forkd.storage.integrity.checksum`)."""
    extents: list[tuple[int, int]] | None
    """Non-zero page runs stored (guest memory), or None: the whole file is stored."""

    @property
    def stored(self) -> int:
        return self.size if self.extents is None else sum(length for _offset, length in self.extents)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"path": self.name, "size": self.size, "stored": self.stored, "checksum": self.checksum}
        if self.extents is not None:
            data["extents"] = [list(extent) for extent in self.extents]
        return data


def _scan(path: Path, name: str, sparse: bool, checksum: str | None) -> _Entry:
    """Size and checksum of ``path`` (``checksum`` when the store recorded it) and, for memory, its non-zero pages."""
    runs: list[tuple[int, int]] = []
    descriptor = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(descriptor).st_size
        if sparse:
            buffer = bytearray(_CHUNK)
            for offset, length in memory.data_extents(descriptor):
                done = 0
                while done < length:
                    view = memoryview(buffer)[: min(_CHUNK, length - done)]
                    got = os.preadv(descriptor, [view], offset + done)
                    if got <= 0:
                        raise ArchiveError(f"{path} shrank while it was being exported")
                    _non_zero_pages(view[:got], offset + done, runs)
                    done += got
    finally:
        os.close(descriptor)
    return _Entry(name, path, size, checksum or integrity.checksum(path), runs if sparse else None)


def _non_zero_pages(chunk: memoryview, start: int, runs: list[tuple[int, int]]) -> None:
    """Append the non-zero page runs of ``chunk`` (at file offset ``start``) to ``runs``, merging neighbours."""
    if chunk == _ZEROS[: len(chunk)]:
        return
    for page in range(0, len(chunk), _PAGE):
        piece = chunk[page : page + _PAGE]
        if piece == _ZEROS[: len(piece)]:
            continue
        offset = start + page
        if runs and runs[-1][0] + runs[-1][1] == offset:
            runs[-1] = (runs[-1][0], runs[-1][1] + len(piece))
        else:
            runs.append((offset, len(piece)))


class _Packed(io.RawIOBase):
    """The bytes of ``extents`` of a file, one after the other: what the archive stores for memory."""

    def __init__(self, stream: IO[bytes], extents: list[tuple[int, int]]) -> None:
        self._fd = stream.fileno()
        self._extents = iter(extents)
        self._current: tuple[int, int] | None = next(self._extents, None)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        """Fill ``buffer`` completely unless the extents run out (tarfile treats a short read as the end)."""
        view = memoryview(buffer).cast("B")
        filled = 0
        while self._current is not None and filled < len(view):
            offset, length = self._current
            if length == 0:
                self._current = next(self._extents, None)
                continue
            got = os.preadv(self._fd, [view[filled : filled + min(len(view) - filled, length)]], offset)
            if got <= 0:
                raise ArchiveError("a memory file shrank while it was being exported")
            self._current = (offset + got, length - got)
            filled += got
        return filled


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o600, int(time.time())
    tar.addfile(info, io.BytesIO(data))


def _read_member(tar: tarfile.TarFile, member: tarfile.TarInfo, limit: int) -> bytes:
    if member.size > limit:
        raise ArchiveError(f"{member.name} is {member.size} bytes, more than a manifest can be; the archive is corrupt")
    stream = tar.extractfile(member)
    assert stream is not None
    data = stream.read()
    if len(data) != member.size:
        raise ArchiveError(f"the archive is truncated inside {member.name}")
    return data


def _target_store(root: SnapshotStore, manifest: Mapping[str, Any], project: Path | str | None) -> SnapshotStore:
    """The store root, or for a project's snapshot the namespace of ``project`` (else the current project)."""
    if manifest.get("scope") != "project":
        return root
    folder = project if project is not None else namespaces.current_project()
    return namespaces.project_store(root, folder) if folder is not None else root


def _store(store: SnapshotStore | Path | str | None) -> SnapshotStore:
    if isinstance(store, SnapshotStore):
        return store
    return SnapshotStore(store) if store is not None else SnapshotStore.persistent()


def _scratch_root(need: int) -> str | None:
    """Where a diff is flattened during an export: RAM when /dev/shm has room for it, else the temporary directory."""
    if not (os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)):
        return None
    return "/dev/shm" if space.room_problem("/dev/shm", need, "flattening") is None else None


def _cpu_text(cpu: object) -> str:
    """A manifest's ``host.cpu`` in the form of :func:`host_cpu_id`."""
    cpu = cpu if isinstance(cpu, Mapping) else {}
    return f"{cpu.get('model', 'an unrecorded CPU')} (flags {cpu.get('flags_sha256', '?')})"


def _version() -> str:
    return __version__
