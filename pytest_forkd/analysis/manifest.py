"""Filesystem manifests of a guest: what exists, recorded cheaply, compared on the host.

A manifest lists every path of the guest (except the pseudo filesystems and
forkd's own files under /run) with the metadata that tells whether it may have
changed: type and mode, owner, size, inode, ctime (in nanoseconds) and the
target of a symlink. No content is read when it is taken, which is what keeps
it within a second for a 20,000-file tree under TCG emulation: one ``lstat``
per path, nothing more. ctime is used rather than mtime because nothing in the
guest can set it back: any write, chmod, chown or rename of a file moves it.

The walk runs in the guest as a ``python3 -c`` script (the image's standard
library suffices; no change to the guest agent) and writes the manifest into a
file under /run/forkd, which the host then reads in one transfer (1.4 MB for
21,000 paths reads in ~25 ms). Content is hashed only later, and only for files
whose metadata changed while their size did not (see :mod:`pytest_forkd.analysis.changes`).
"""

from __future__ import annotations

import stat
from dataclasses import dataclass

#: Trees never recorded: kernel pseudo filesystems, and /run, where forkd keeps its own files.
DEFAULT_EXCLUDES: tuple[str, ...] = ("/proc", "/sys", "/dev", "/run")
#: Where the guest keeps manifests (under /run, so they never show up as changes).
GUEST_DIR = "/run/forkd"
GUEST_MANIFESTS = f"{GUEST_DIR}/manifests"
MAGIC = "forkd-manifest"
VERSION = 1

# The walk: one lstat per path, written as NUL-separated fields, one path per line.
# Paths with a newline in their name are skipped (the format is line-based).
WALK_SCRIPT = r"""
import os, sys
out_path, header = sys.argv[1], sys.argv[2]
skip = set(sys.argv[3:])
out = [header]
app = out.append
stack = ["/"]
pop = stack.pop; push = stack.append
listdir = os.listdir; lstat = os.lstat; readlink = os.readlink
while stack:
    d = pop()
    try:
        names = listdir(d)
    except OSError:
        continue
    pre = d + "/" if d != "/" else "/"
    for n in names:
        p = pre + n
        if p in skip or "\n" in p:
            continue
        try:
            st = lstat(p)
        except OSError:
            continue
        m, i, _, _, u, g, z, _, _, _ = st  # the tuple part: cheaper than attributes under emulation
        kind = m & 0o170000
        if kind == 0o040000:
            push(p); t = ""
        elif kind == 0o120000:
            try:
                t = readlink(p)
            except OSError:
                t = ""
        else:
            t = ""
        app(f"{p}\0{m}\0{u}\0{g}\0{z}\0{i}\0{st.st_ctime_ns}\0{t}")
os.makedirs(os.path.dirname(out_path), exist_ok=True)
tmp = out_path + ".tmp"
with open(tmp, "wb") as fh:
    fh.write("\n".join(out).encode("utf-8", "surrogateescape"))
os.rename(tmp, out_path)
print(len(out) - 1)
"""


@dataclass(frozen=True)
class Entry:
    """What the manifest says about one path."""

    path: str
    mode: int
    """Type and permission bits (``st_mode``)."""
    uid: int
    gid: int
    size: int
    inode: int
    ctime_ns: int
    target: str = ""
    """Where a symlink points ('' for anything else)."""

    @property
    def kind(self) -> str:
        if stat.S_ISDIR(self.mode):
            return "dir"
        if stat.S_ISLNK(self.mode):
            return "symlink"
        if stat.S_ISREG(self.mode):
            return "file"
        return "special"

    @property
    def permissions(self) -> int:
        return stat.S_IMODE(self.mode)


class ManifestFormatError(ValueError):
    """A manifest could not be parsed (written by another version, or truncated)."""


@dataclass(frozen=True)
class Manifest:
    """All paths of a guest at one moment, by path."""

    label: str
    entries: dict[str, Entry]

    @classmethod
    def parse(cls, data: bytes) -> Manifest:
        text = data.decode("utf-8", "surrogateescape")
        header, _, body = text.partition("\n")
        parts = header.split(" ", 2)
        if len(parts) != 3 or parts[0] != MAGIC or parts[1] != str(VERSION):
            raise ManifestFormatError(f"not a version {VERSION} {MAGIC}: header {header[:80]!r}")
        entries: dict[str, Entry] = {}
        for line in body.split("\n") if body else ():
            fields = line.split("\0")
            if len(fields) != 8:
                raise ManifestFormatError(f"malformed manifest line {line[:120]!r}")
            path, mode, uid, gid, size, inode, ctime_ns, target = fields
            entries[path] = Entry(path, int(mode), int(uid), int(gid), int(size), int(inode), int(ctime_ns), target)
        return cls(parts[2], entries)

    def __len__(self) -> int:
        return len(self.entries)


def walk_command(out_path: str, label: str, excludes: tuple[str, ...] = DEFAULT_EXCLUDES) -> list[str]:
    """The guest argv that writes a manifest of the whole tree to ``out_path``."""
    if " " in label or "\n" in label:
        raise ValueError(f"a manifest label has no spaces or newlines: {label!r}")
    return ["python3", "-S", "-c", WALK_SCRIPT, out_path, f"{MAGIC} {VERSION} {label}", *excludes]


def hash_command() -> list[str]:
    """The guest argv that prints ``<sha256>  <path>`` for each NUL-separated path read on stdin.

    busybox, not python3: hashing runs in a freshly restored child of the
    checkpoint, where a first Python start costs ~0.5 s of code translation
    under TCG and busybox a few milliseconds.
    """
    return ["xargs", "-0", "-r", "sha256sum", "--"]
