"""Making and comparing file trees: what a copy must keep (kinds, modes, contents, link targets, mtimes)."""

from __future__ import annotations

import hashlib
import os
import random
import stat
from pathlib import Path
from typing import NamedTuple


class Entry(NamedTuple):
    kind: str  # "dir", "file" or "link"
    mode: int  # permission bits (0 for links: Linux has none)
    size: int
    digest: str  # sha256 of a file's contents, a link's target text, "" for a directory
    mtime_ns: int


def listing(root: Path | str) -> dict[str, Entry]:
    """Every path under ``root`` (``"."`` is root itself) with what a faithful copy keeps of it."""
    root = Path(root)
    result: dict[str, Entry] = {".": _entry(root)}
    for folder, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            path = Path(folder) / name
            result[str(path.relative_to(root))] = _entry(path)
    return result


def _entry(path: Path) -> Entry:
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode):
        target = os.readlink(path)
        return Entry("link", 0, len(target), hashlib.sha256(target.encode()).hexdigest(), info.st_mtime_ns)
    if stat.S_ISDIR(info.st_mode):
        return Entry("dir", stat.S_IMODE(info.st_mode), 0, "", info.st_mtime_ns)
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        for block in iter(lambda: source.read(1 << 20), b""):
            digest.update(block)
    return Entry("file", stat.S_IMODE(info.st_mode), info.st_size, digest.hexdigest(), info.st_mtime_ns)


def differences(expected: dict[str, Entry], actual: dict[str, Entry], *, limit: int = 20) -> list[str]:
    """Human-readable differences between two listings (empty: identical)."""
    problems = []
    for path in sorted(expected.keys() | actual.keys()):
        want, got = expected.get(path), actual.get(path)
        if want is None:
            problems.append(f"{path}: unexpected {got}")
        elif got is None:
            problems.append(f"{path}: missing (expected {want})")
        elif want != got:
            fields = [name for name in Entry._fields if getattr(want, name) != getattr(got, name)]
            problems.append(
                f"{path}: {', '.join(f'{name} {getattr(want, name)!r} != {getattr(got, name)!r}' for name in fields)}"
            )
        if len(problems) >= limit:
            problems.append("...")
            break
    return problems


def make_tree(root: Path, *, files: int, total_bytes: int, seed: int = 11) -> dict[str, int]:
    """A tree of ``files`` regular files holding ``total_bytes`` in all, plus links, odd modes and mtimes.

    Directories nest three levels deep; one is 0700, one 0500 (read-only);
    files are 0644, 0755 (executable) or 0600; links are relative, absolute
    and dangling; every mtime is set, with nanoseconds. Returns counts.
    """
    rng = random.Random(seed)
    root.mkdir(parents=True)
    directories = [root]
    for index in range(24):
        parent = rng.choice(directories[: 1 + index // 3])
        directory = parent / f"d{index:02d}"
        directory.mkdir()
        directories.append(directory)
    sizes = [1 + rng.randrange(4096) for _ in range(files)]
    big = total_bytes - sum(sizes)
    for index in range(max(0, big) // (8 << 20) + 1):  # the rest in a few large files
        sizes[index] += big // (max(0, big) // (8 << 20) + 1)
    modes = (0o644, 0o755, 0o600, 0o640)
    made = []
    for index, size in enumerate(sizes):
        path = rng.choice(directories) / f"f{index:04d}{rng.choice(['.py', '.txt', '.bin', ''])}"
        path.write_bytes(rng.randbytes(size))
        os.chmod(path, rng.choice(modes))
        made.append(path)
    links = 0
    for index, target in enumerate(made[:30]):
        link = rng.choice(directories) / f"link{index:02d}"
        os.symlink(os.path.relpath(target, link.parent), link)
        links += 1
    os.symlink("/etc/hostname", root / "absolute-link")
    os.symlink("does/not/exist", root / "dangling-link")
    os.symlink("d00", root / "dir-link")
    links += 3
    (root / "empty-dir").mkdir()
    (root / "empty-file").write_bytes(b"")
    (root / "name with spaces & ünïcode").write_text("odd names travel too\n")
    deep = root / "a" / "b" / "c" / ("long-" + "x" * 120) / "deep.txt"
    deep.parent.mkdir(parents=True)
    deep.write_text("a name longer than 100 bytes\n")
    os.chmod(directories[1], 0o700)
    for path in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        stamp = 1_600_000_000_000_000_000 + rng.randrange(10**17)
        os.utime(path, ns=(stamp, stamp), follow_symlinks=False)
    read_only = directories[2]
    os.utime(root, ns=(1_650_000_000_123_456_789,) * 2)
    os.chmod(read_only, 0o555)
    return {"files": files, "links": links, "directories": len(directories)}
