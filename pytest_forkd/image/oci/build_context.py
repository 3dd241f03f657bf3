"""What a Dockerfile build is made of, as one key: the Dockerfile, the context's files, arguments, target, platform.

Two builds with the same key give the same image, so the store keeps a build
under its key and serves it again without running a builder; a build whose
key differs in anything (another build argument, a changed file of the
context, another ``--target``) is another image. The key hashes:

- the Dockerfile's bytes;
- every entry of the build context that the builder would send: its path,
  type, permission bits, and a file's content (a link's target), leaving
  out what the ignore file excludes, read as Docker reads ``.dockerignore``
  (``#`` comments, ``!`` exceptions, ``*``/``?``/``[...]`` within a path
  part, ``**`` across parts, the last matching line winning, and a pattern
  that matches a folder excluding all of it);
- the build arguments, the target and the platform.

Owners and modification times are left out, as BuildKit's cache leaves them
out: touching a file, or Inspect writing its ``logs/`` into a context whose
``.dockerignore`` names it, builds nothing again.

Which ignore file: podman and buildah read ``.containerignore`` before
``.dockerignore``; docker's BuildKit reads ``<Dockerfile>.dockerignore``
beside the Dockerfile before the context's ``.dockerignore``. Each builder's
key follows what that builder reads.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["KEY_FORMAT", "IgnoreRules", "build_key", "ignore_file", "read_ignore_file"]

#: Bump when what the key hashes changes: every build is then looked up anew.
KEY_FORMAT = 1
#: Characters that mean nothing special in a Docker pattern but do in a regular expression (patternmatcher's).
_ESCAPED = set(".+()|{}$")
_CHUNK = 1 << 20
# Per process: a file's digest by (path, size, mtime, inode, ctime), so an unchanged context is read once.
_digests: dict[tuple[str, int, int, int, int], str] = {}


@dataclass(frozen=True)
class _Pattern:
    """One line, compiled as patternmatcher compiles it: an exact, prefix or suffix match, else a regex."""

    text: str
    exception: bool
    kind: str
    regex: re.Pattern[str]

    def match(self, path: str) -> bool:
        if self.kind == "exact":
            return path == self.text
        if self.kind == "prefix":  # "DIR/**"
            return path.startswith(self.text[:-2])
        if self.kind == "suffix":  # "**SUFFIX"
            suffix = self.text[2:]
            return path.endswith(suffix) or (suffix.startswith("/") and path == suffix[1:])
        return self.regex.match(path) is not None


class IgnoreRules:
    """The lines of a ``.dockerignore``, matched as moby's patternmatcher matches them."""

    def __init__(self, lines: list[str]) -> None:
        self.patterns: list[_Pattern] = []
        for raw in lines:
            if raw.startswith("#"):
                continue
            line = raw.strip()
            if not line:
                continue
            exception = line.startswith("!")
            if exception:
                line = line[1:].strip()
            if not line:
                continue
            cleaned = posixpath.normpath(line)
            if len(cleaned) > 1 and cleaned.startswith("/"):
                cleaned = cleaned.lstrip("/") or "."
            kind, regex = _compile(cleaned)
            self.patterns.append(_Pattern(cleaned, exception, kind, re.compile(regex)))

    @property
    def has_exceptions(self) -> bool:
        return any(pattern.exception for pattern in self.patterns)

    def excluded(self, relative: str) -> bool:
        """Whether ``relative`` (a ``/``-separated path in the context) is left out of it."""
        parents = relative.split("/")[:-1]
        matched = False
        for pattern in self.patterns:
            if pattern.exception != matched:
                continue  # an exclusion of what is excluded already, or an exception of what is not
            hit = pattern.match(relative)
            if not hit:
                hit = any(pattern.match("/".join(parents[: depth + 1])) for depth in range(len(parents)))
            if hit:
                matched = not pattern.exception
        return matched


def _compile(pattern: str) -> tuple[str, str]:
    """A cleaned ignore pattern as patternmatcher's ``compile`` makes it: its kind and its regular expression."""
    out = ["^"]
    kind = "exact"
    index = 0
    while index < len(pattern):
        first = index == 0
        char = pattern[index]
        index += 1
        if char == "*":
            if index < len(pattern) and pattern[index] == "*":
                index += 1
                if index < len(pattern) and pattern[index] == "/":
                    index += 1  # "**/" is "**"
                if index >= len(pattern):
                    if kind == "exact":
                        kind = "prefix"
                    else:
                        out.append(".*")
                        kind = "regex"
                else:
                    out.append("(.*/)?")
                    kind = "regex"
                if first:
                    kind = "suffix"
            else:
                out.append("[^/]*")
                kind = "regex"
        elif char == "?":
            out.append("[^/]")
            kind = "regex"
        elif char in _ESCAPED:
            out.append("\\" + char)
        elif char == "\\":
            if index < len(pattern):
                out.append("\\" + pattern[index])
                index += 1
                kind = "regex"
            else:
                out.append("\\\\")
        elif char in "[]":
            out.append(char)  # a character class, as in filepath.Match
            kind = "regex"
        else:
            out.append(char)
    out.append("$")
    return kind, "".join(out)


def ignore_file(dockerfile: Path, context: Path, builder: str) -> Path | None:
    """The ignore file ``builder`` reads for this build, or None when there is none."""
    if builder == "docker":
        candidates = [dockerfile.with_name(dockerfile.name + ".dockerignore"), context / ".dockerignore"]
    else:
        candidates = [context / ".containerignore", context / ".dockerignore"]
    return next((path for path in candidates if path.is_file()), None)


def read_ignore_file(path: Path | None) -> IgnoreRules:
    if path is None:
        return IgnoreRules([])
    text = path.read_text(encoding="utf-8", errors="replace").removeprefix("\ufeff")
    return IgnoreRules(text.splitlines())


def context_entries(context: Path, rules: IgnoreRules) -> Iterator[tuple[str, os.stat_result]]:
    """Every entry of ``context`` the builder sends (relative path, lstat), folders first, in name order."""
    for folder, folders, files in os.walk(context):
        base = os.path.relpath(folder, context)
        kept_folders = []
        for name in sorted(folders):
            relative = name if base == "." else f"{base}/{name}"
            if rules.excluded(relative):
                if rules.has_exceptions:
                    kept_folders.append(name)  # an exception may bring back something inside
                continue
            kept_folders.append(name)
            yield relative, os.lstat(os.path.join(folder, name))
        folders[:] = kept_folders
        for name in sorted(files):
            relative = name if base == "." else f"{base}/{name}"
            if not rules.excluded(relative):
                yield relative, os.lstat(os.path.join(folder, name))


def _file_digest(path: str, info: os.stat_result) -> str:
    memo = (path, info.st_size, info.st_mtime_ns, info.st_ino, info.st_ctime_ns)
    known = _digests.get(memo)
    if known is not None:
        return known
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(_CHUNK):
            digest.update(chunk)
    _digests[memo] = digest.hexdigest()
    return _digests[memo]


def build_key(
    dockerfile: Path,
    context: Path,
    *,
    args: Mapping[str, str],
    target: str | None,
    platform: str | None,
    builder: str,
) -> str:
    """The hex sha256 of what a build of ``dockerfile`` in ``context`` is made of (see the module docstring)."""
    digest = hashlib.sha256(f"forkd build key {KEY_FORMAT}\0".encode())
    digest.update(hashlib.sha256(dockerfile.read_bytes()).hexdigest().encode())
    rules = read_ignore_file(ignore_file(dockerfile, context, builder))
    for relative, info in context_entries(context, rules):
        mode = stat.S_IMODE(info.st_mode)
        if stat.S_ISREG(info.st_mode):
            content = _file_digest(os.path.join(context, relative), info)
            kind = "f"
        elif stat.S_ISLNK(info.st_mode):
            content, kind = os.readlink(os.path.join(context, relative)), "l"
        elif stat.S_ISDIR(info.st_mode):
            content, kind = "", "d"
        else:
            continue  # sockets, fifos, devices: builders skip or refuse them
        digest.update(f"{kind}\0{relative}\0{mode:o}\0{content}\n".encode())
    for key in sorted(args):
        digest.update(f"arg\0{key}\0{args[key]}\n".encode())
    digest.update(f"target\0{target or ''}\nplatform\0{platform or ''}\n".encode())
    return digest.hexdigest()
