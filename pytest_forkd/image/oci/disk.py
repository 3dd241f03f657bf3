"""A pulled image's merged layers as one read-only ext4 disk, built once per image digest, without root.

The disk holds the image's root under ``rootfs/`` and, beside it,
``forkd/image.json`` (the digest, the config a guest runs commands with, and
the reference with any host path left out: the guest runs the agent under
evaluation, which has no business knowing the host's folders). The guest
mounts it read-only under an overlay, so the
image's files are never in guest RAM until read, and every VM of the image
shares the one file.

ext4 is written by e2fsprogs, as a non-root user can: ``mke2fs -d`` copies a
directory into a new filesystem, and one ``debugfs -w`` run then gives every
inode what an unprivileged copy cannot carry: the image's owners (any uid,
none of which need exist on the host), setuid/setgid bits, extended
attributes (``security.capability``), device nodes and fifos, and hard links
between symlinks or devices. Debian 12's e2fsprogs (1.47.0) reads only a
directory with ``-d`` (tar input came in 1.47.1). The directory is written
from the merged model of :mod:`.layers`, inside the build's own directory,
with modes that let this user read it: its special bits, owners and devices
exist only on the disk. Times are kept to the second (``mke2fs -d`` drops
nanoseconds).

Disks live under ``<cache>/oci/disks/<digest hex>.ext4``, built under a file
lock (pytest-xdist workers build once) in a private directory next to them,
renamed into place when complete and made read-only (0444): a published disk
is never modified, and a failed build leaves nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Protocol

from filelock import FileLock, Timeout

from ... import private
from ...errors import ForkdError, ImageError, ImageToolMissing
from .layers import LayerBlob, flatten
from .reference import parse_reference
from .store import disks_dir, unwritable_error
from .tree import MergedTree, Node

__all__ = [
    "DISK_CONFIG",
    "DISK_FORMAT",
    "DISK_LABEL",
    "DISK_ROOT",
    "DiskError",
    "build_disk",
    "disk_path",
    "disks_dir",
    "ensure_disk",
]

#: The image's root filesystem inside the disk.
DISK_ROOT: Final = "rootfs"
#: Beside it: {"format", "reference", "digest", "config": {env, working_dir, user, entrypoint, cmd}}; the
#: reference without any host path (:func:`guest_reference`).
DISK_CONFIG: Final = "forkd/image.json"
#: The ext4 label of every image disk.
DISK_LABEL: Final = "forkd-image"
#: Bump when the disk's layout or content changes meaning (the guest can read it from image.json).
#: 2: image.json's reference has no host path.
DISK_FORMAT: Final = 2

BLOCK: Final = 4096
INODE_SIZE: Final = 256
#: Inodes one block group can hold (one bitmap block of 4096 * 8 bits).
INODES_PER_GROUP: Final = BLOCK * 8
BLOCKS_PER_GROUP: Final = BLOCK * 8
#: debugfs reads its command file with fgets(BUFSIZ): a longer line would be cut into two commands.
MAX_SCRIPT_LINE: Final = 8000
_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")

Progress = Callable[[str], None]

_TYPE_BITS: Final = {"file": 0o100000, "dir": 0o040000, "symlink": 0o120000, "char": 0o020000, "block": 0o060000}
_FIFO_BITS: Final = 0o010000


class DiskError(ImageError):
    """An image's disk could not be written (a tool failed, or an entry cannot be expressed on it)."""


class ImageConfigSource(Protocol):
    """The image config fields a guest runs commands with (``pull.ImageConfig`` has them)."""

    @property
    def env(self) -> Sequence[str]: ...

    @property
    def working_dir(self) -> str: ...

    @property
    def user(self) -> str: ...

    @property
    def entrypoint(self) -> Sequence[str]: ...

    @property
    def cmd(self) -> Sequence[str]: ...


class ImageSource(Protocol):
    """What a disk is built from (``pull.PulledImage`` has it)."""

    @property
    def reference(self) -> str: ...

    @property
    def digest(self) -> str: ...

    @property
    def config(self) -> ImageConfigSource: ...

    @property
    def layers(self) -> Sequence[LayerBlob]: ...


def print_progress(message: str) -> None:
    """Default progress sink: one line per step on stderr."""
    print(f"forkd: {message}", file=sys.stderr, flush=True)


def disk_path(digest: str) -> Path:
    """The published disk of the image whose manifest digest is ``digest`` (it may not exist yet)."""
    match = _DIGEST.fullmatch(digest)
    if match is None:
        raise ImageError(f"image digest {digest!r} is not of the form sha256:<64 hex digits>")
    return disks_dir() / f"{match.group(1)}.ext4"


def ensure_disk(image: ImageSource, *, progress: Progress | None = None) -> Path:
    """The read-only ext4 disk of ``image``, built on first use; every later call returns it at once."""
    destination = disk_path(image.digest)
    if destination.is_file():
        return destination
    progress = progress or print_progress
    folder = destination.parent
    key = destination.stem
    try:
        private.make_dir(folder / ".locks")
    except OSError as exc:
        raise _os_failure(exc, folder, "creating the disk folder") from None
    lock = FileLock(folder / ".locks" / f"{key}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        progress(f"waiting for another build of the disk of {image.reference} to finish")
        lock.acquire()
    try:
        if destination.is_file():
            return destination  # built by whoever held the lock before us
        for stale in folder.glob(f".build-{key}-*"):  # left by a build that was killed; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        workdir = Path(tempfile.mkdtemp(dir=folder, prefix=f".build-{key}-"))
        try:
            output = workdir / "disk.ext4"
            build_disk(image, output, workdir, progress)
            os.chmod(output, 0o444)
            os.rename(output, destination)
        except OSError as exc:
            raise _os_failure(exc, folder, f"building the disk of {image.reference}") from None
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    finally:
        lock.release()
    return destination


def build_disk(image: ImageSource, output: Path, workdir: Path, progress: Progress) -> None:
    """Write the disk of ``image`` to ``output``, using the private, empty-enough directory ``workdir``.

    ``output`` is complete when this returns; on an error it is left for the
    caller to delete with ``workdir``.
    """
    for tool in ("mke2fs", "debugfs"):
        if _tool(tool) is None:
            raise ImageToolMissing(
                f"{tool} is not installed and container images need it to write their disks; "
                "install e2fsprogs (`sudo apt-get install e2fsprogs`)"
            )
    folder = workdir.parent  # what a full-disk error names: the build's own directory is temporary
    contents = workdir / "contents"
    contents.mkdir()
    tree = flatten(image.layers, contents, progress, folder=folder)
    stage = workdir / "stage"
    staged = _Stager(stage).stage(tree, _config_json(image))
    progress(f"writing the disk: {staged.names:,} files, {staged.content / 2**20:.1f} MiB")
    blocks, inodes = _filesystem_size(staged)
    _make_filesystem(output, stage, blocks, inodes, folder)
    script = workdir / "fixups.debugfs"
    _write_script(script, staged, workdir / "xattrs")
    _run_debugfs(output, script, folder)


def _config_json(image: ImageSource) -> bytes:
    config = image.config
    document = {
        "format": DISK_FORMAT,
        "reference": guest_reference(image.reference),
        "digest": image.digest,
        "config": {
            "env": list(config.env),
            "working_dir": config.working_dir,
            "user": config.user,
            "entrypoint": list(config.entrypoint),
            "cmd": list(config.cmd),
        },
    }
    return (json.dumps(document, indent=2) + "\n").encode()


#: What stands for a host path in the reference a guest is shown.
LOCAL: Final = "<local>"


def guest_reference(reference: str) -> str:
    """``reference`` as the guest may see it: a registry's as it is, a local one without its host path.

    ``oci:/home/me/layouts/app:v1`` becomes ``oci:<local>:v1`` and
    ``dockerfile:/home/me/task/Dockerfile`` ``dockerfile:<local>``: the agent
    under evaluation learns the transport and the tag, never the host's
    folders. Anything unreadable gives ``<local>`` alone.
    """
    try:
        parsed = parse_reference(reference)
    except ForkdError:
        return LOCAL
    if parsed.transport == "docker":
        return str(parsed)
    return f"{parsed.transport}:{LOCAL}" + (f":{parsed.tag}" if parsed.tag else "")


# ---------------------------------------------------------------------------------------------- staging


@dataclass
class _Copied:
    """An inode ``mke2fs -d`` copies from the stage, and the mode and owner its copy there has."""

    disk: str  # its path on the disk
    node: Node
    mode: int  # with the type bits
    uid: int = 0
    gid: int = 0


@dataclass
class _Staged:
    """The staged directory and what the debugfs pass must still do to make the disk exact."""

    #: Every inode mke2fs copies, parents first.
    copied: list[_Copied] = field(default_factory=list)
    #: Devices and fifos, made by debugfs: (disk path, node), each node once.
    special: list[tuple[str, Node]] = field(default_factory=list)
    #: Further names of symlinks, devices and fifos (mke2fs links only regular files): (first, other).
    links: list[tuple[str, str]] = field(default_factory=list)
    #: Directories debugfs adds names to, by disk path, to put their mtimes back afterwards.
    touched: dict[str, Node] = field(default_factory=dict)
    directories: list[Node] = field(default_factory=list)
    names: int = 0
    inodes: int = 0
    content: int = 0


class _Stager:
    """Writes the merged tree as a plain directory this user can read: content, names, links and times.

    Special bits, owners, xattrs and devices are left to debugfs: the stage
    never holds a setuid file or a device, whoever builds.
    """

    def __init__(self, stage: Path) -> None:
        self.directory = stage

    def host(self, disk: str) -> str:
        return os.path.join(self.directory, disk.lstrip("/"))

    def stage(self, tree: MergedTree, config: bytes) -> _Staged:
        staged = _Staged()
        os.mkdir(self.directory, 0o700)
        os.chmod(self.directory, 0o755)  # the disk's "/" (mke2fs copies the mode, root_owner the owner)
        first: dict[int, str] = {}  # id(node) -> its first disk path, for hard links
        directories: list[tuple[str, Node]] = []
        symlinks: list[tuple[str, Node]] = []
        for path, node in tree.walk():
            disk = f"/{DISK_ROOT}/{path}" if path else f"/{DISK_ROOT}"
            host = self.host(disk)
            staged.names += 1
            earlier = first.get(id(node))
            if earlier is not None:
                if node.kind == "file":
                    os.link(self.host(earlier), host)
                else:
                    staged.links.append((earlier, disk))
                    staged.touched[_parent(disk)] = self._parent_node(tree, path)
                continue
            first[id(node)] = disk
            staged.inodes += 1
            if node.kind == "dir":
                os.mkdir(host, 0o700)
                directories.append((host, node))
                staged.directories.append(node)
            elif node.kind == "file":
                if node.blob is not None:
                    os.rename(node.blob, host)
                    node.blob = None
                else:
                    os.close(os.open(host, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
                os.chmod(host, _staged_mode(node))
                os.utime(host, (node.mtime, node.mtime))
                staged.content += node.size
            elif node.kind == "symlink":
                symlinks.append((disk, node))
                continue
            else:
                staged.special.append((disk, node))
                staged.touched[_parent(disk)] = self._parent_node(tree, path)
                continue
            staged.copied.append(_Copied(disk, node, _TYPE_BITS[node.kind] | _staged_mode(node)))
        # Symlinks last: until now no directory of the stage had one, so no write above went through one.
        for disk, node in symlinks:
            os.symlink(node.target, self.host(disk))
            os.utime(self.host(disk), (node.mtime, node.mtime), follow_symlinks=False)
            staged.copied.append(_Copied(disk, node, 0o120777))
        os.mkdir(self.host(os.path.dirname(DISK_CONFIG)), 0o755)
        with open(os.open(self.host(DISK_CONFIG), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "wb") as out:
            out.write(config)
        forkd_dir, config_file = Node("dir", 0o755, 0, 0, 0), Node("file", 0o644, 0, 0, 0)
        staged.copied.append(_Copied(f"/{os.path.dirname(DISK_CONFIG)}", forkd_dir, 0o040755))
        staged.copied.append(_Copied(f"/{DISK_CONFIG}", config_file, 0o100644))
        staged.inodes += 2
        # Directory modes and times last, deepest first: adding names to them changed their mtimes.
        for host, node in reversed(directories):
            os.chmod(host, _staged_mode(node))
            os.utime(host, (node.mtime, node.mtime))
        for copied in staged.copied:  # the owner mke2fs copies: this user's, or a setgid parent's group
            status = os.lstat(self.host(copied.disk))
            copied.uid, copied.gid = status.st_uid, status.st_gid
        staged.copied.append(_Copied("/", Node("dir", 0o755, 0, 0, 0), 0o040755))  # root_owner=0:0
        return staged

    @staticmethod
    def _parent_node(tree: MergedTree, path: str) -> Node:
        node = tree.root
        for part in path.split("/")[:-1]:
            node = node.entries[part]
        return node


def _parent(disk: str) -> str:
    return disk.rsplit("/", 1)[0] or "/"


def _staged_mode(node: Node) -> int:
    """The mode of ``node``'s copy on the host: its permissions, no special bits, and readable (writable) by us."""
    if node.kind == "dir":
        return (node.mode & 0o777) | 0o700
    return (node.mode & 0o777) | 0o400


# ---------------------------------------------------------------------------------------------- the filesystem


def _filesystem_size(staged: _Staged) -> tuple[int, int]:
    """Blocks and inodes for the staged tree: what it needs, plus room for the debugfs pass and some slack."""
    data = 0
    for copied in staged.copied:
        node = copied.node
        if node.kind == "file":
            data += -(-node.size // BLOCK) + node.size // (128 << 20)  # an extent per 128 MiB, roughly
        elif node.kind == "symlink" and len(os.fsencode(node.target)) >= 60:
            data += 1  # shorter targets live in the inode
    for node in staged.directories:
        entries = 24 + sum(8 + ((len(os.fsencode(name)) + 3) & ~3) for name in node.entries)
        blocks = -(-entries // (BLOCK - 12))
        data += blocks + (blocks // 64 + 1 if blocks > 1 else 0)  # an htree index past one block
    with_xattrs = sum(1 for copied in staged.copied if copied.node.xattrs)
    with_xattrs += sum(1 for _, node in staged.special if node.xattrs)
    data += with_xattrs + 16  # lost+found, the root, slack for small trees
    inodes = staged.inodes + 16  # reserved inodes, lost+found
    inodes += inodes // 20 + 64
    table = -(-inodes * INODE_SIZE // BLOCK)
    blocks = data + table
    groups = max(-(-blocks // BLOCKS_PER_GROUP), -(-inodes // INODES_PER_GROUP))
    blocks += groups * 8  # bitmaps, group descriptors, backup superblocks
    blocks = blocks + blocks // 10 + 2048  # slack: 10% and 8 MiB
    blocks = max(blocks, groups * BLOCKS_PER_GROUP if groups > 1 else 0, 4096)
    return blocks, inodes


def _make_filesystem(output: Path, stage: Path, blocks: int, inodes: int, folder: Path) -> None:
    """``mke2fs -d stage`` into ``output``: sparse, journal-less (it is read-only), room for the inodes."""
    for attempt in range(3):
        command = [
            _tool("mke2fs") or "mke2fs",
            "-q",
            "-F",
            "-t",
            "ext4",
            "-O",
            "^has_journal,^resize_inode,^metadata_csum",
            "-b",
            str(BLOCK),
            "-I",
            str(INODE_SIZE),
            "-N",
            str(inodes),
            "-m",
            "0",
            "-L",
            DISK_LABEL,
            "-E",
            "root_owner=0:0",
            "-d",
            str(stage),
            str(output),
            str(blocks),
        ]
        output.unlink(missing_ok=True)
        result = subprocess.run(command, capture_output=True, stdin=subprocess.DEVNULL)
        if result.returncode == 0:
            return
        said = _said(result.stderr)
        unwritable = unwritable_error(said, folder, "writing an image disk")
        if unwritable is not None:
            raise unwritable
        if attempt < 2 and any(
            hint in said.lower() for hint in ("allocate", "no free space", "too big", "too many", "space")
        ):
            blocks, inodes = blocks * 2, inodes * 2  # the estimate was short: try roomier
            continue
        raise DiskError(f"mke2fs could not write the image disk {output.name}: {said}")


# ---------------------------------------------------------------------------------------------- debugfs


def _quote(disk_path: str) -> bytes:
    """``disk_path`` as one debugfs argument: in double quotes, a quote doubled (debugfs reads it back so)."""
    return b'"' + os.fsencode(disk_path).replace(b'"', b'""') + b'"'


def _write_script(script: Path, staged: _Staged, xattr_dir: Path) -> None:
    """The debugfs commands that give the disk what the stage could not: owners, special bits, devices, xattrs."""
    xattr_dir.mkdir()
    values = 0
    lines: list[bytes] = []

    def emit(shown: str, *words: bytes) -> None:
        line = b" ".join(words)
        if b"\n" in line or b"\r" in line or b"\0" in line:  # refused with the layer already: never two commands
            raise DiskError(f"entry {shown!r} cannot be written by debugfs (a line break in a name)")
        if len(line) > MAX_SCRIPT_LINE:
            raise DiskError(
                f"entry {shown.removeprefix('/' + DISK_ROOT + '/')!r} has a path too long for the disk writer "
                f"(debugfs takes lines of at most {MAX_SCRIPT_LINE} bytes); the image is refused"
            )
        lines.append(line + b"\n")

    def set_inode(disk: str, node: Node, mode: int | None, uid: int | None, gid: int | None) -> None:
        quoted = _quote(disk)
        wanted = _TYPE_BITS.get(node.kind, _FIFO_BITS) | node.mode
        if node.kind == "symlink":
            wanted = 0o120777  # Linux has no symlink modes
        if mode != wanted:
            emit(disk, b"sif", quoted, b"mode", b"0%o" % wanted)
        if uid != node.uid:
            emit(disk, b"sif", quoted, b"uid", b"%d" % node.uid)
        if gid != node.gid:
            emit(disk, b"sif", quoted, b"gid", b"%d" % node.gid)

    def set_xattrs(disk: str, node: Node) -> None:
        nonlocal values
        for name, value in node.xattrs:  # sorted by name
            values += 1
            value_file = xattr_dir / str(values)
            value_file.write_bytes(value)
            emit(disk, b"ea_set", b"-f", _quote(str(value_file)), _quote(disk), _quote(name))

    for copied in staged.copied:
        set_inode(copied.disk, copied.node, copied.mode, copied.uid, copied.gid)
        set_xattrs(copied.disk, copied.node)
    directory = ""
    for disk, node in staged.special:
        parent, name = _parent(disk), disk.rsplit("/", 1)[1]
        if parent != directory:
            emit(disk, b"cd", _quote(parent))  # mknod with a path links under the wrong name in 1.47.0
            directory = parent
        if node.kind == "fifo":
            emit(disk, b"mknod", _quote(name), b"p")
        else:
            kind = b"c" if node.kind == "char" else b"b"
            major, minor = node.device
            if major <= 0xFFFF and minor <= 0xFFFF:
                emit(disk, b"mknod", _quote(name), kind, b"%d" % major, b"%d" % minor)
            else:  # beyond what debugfs's mknod parses: store the kernel's new encoding in the inode itself
                emit(disk, b"mknod", _quote(name), kind, b"0", b"0")
                encoded = (minor & 0xFF) | (major << 8) | ((minor & ~0xFF) << 12)
                emit(disk, b"sif", _quote(disk), b"block[1]", b"%d" % encoded)
        set_inode(disk, node, None, None, None)
        emit(disk, b"sif", _quote(disk), b"mtime", b"@%d" % node.mtime)
        set_xattrs(disk, node)
    counts: dict[str, int] = {}
    for first, other in staged.links:
        emit(other, b"ln", _quote(first), _quote(other))
        counts[first] = counts.get(first, 1) + 1
    for first, count in counts.items():
        emit(first, b"sif", _quote(first), b"links_count", b"%d" % count)
    for disk, node in staged.touched.items():
        emit(disk, b"sif", _quote(disk), b"mtime", b"@%d" % node.mtime)
    with open(os.open(script, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), "wb") as out:
        out.writelines(lines)


def _run_debugfs(output: Path, script: Path, folder: Path) -> None:
    """Run the script in one debugfs; debugfs exits 0 whatever fails, so any complaint on stderr is a failure."""
    result = subprocess.run(
        [_tool("debugfs") or "debugfs", "-w", "-f", str(script), str(output)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    complaints = [
        line
        for line in result.stderr.decode(errors="replace").splitlines()
        if line.strip() and not line.startswith("debugfs ")  # the version banner
    ]
    if result.returncode != 0 or complaints:
        said = " ".join((complaints or [f"exit status {result.returncode}"])[0].split())[:300]
        unwritable = unwritable_error(said, folder, "writing an image disk")
        if unwritable is not None:
            raise unwritable
        where = ""
        match = re.match(rf'"?/{DISK_ROOT}/(.*?)"?: ', said)
        if match:
            where = f" at entry {match.group(1)!r}"
        raise DiskError(f"writing the image disk failed{where}: debugfs says {said}")


def _said(stderr: bytes) -> str:
    text = " ".join(stderr.decode(errors="replace").split())
    return text[-300:] or "nothing"


def _tool(name: str) -> str | None:
    """``name`` on PATH or in the sbin directories a non-root user's PATH often lacks."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def _os_failure(exc: OSError, folder: Path, doing: str) -> ImageError:
    return unwritable_error(exc, folder, doing) or ImageError(f"{doing} failed in {folder}: {exc.strerror or exc}")
