"""An image's merged tree (path -> :class:`Node`), and paths resolved inside its root as containerd and umoci do.

The tree is what :mod:`.layers` builds from the layers and :mod:`.disk`
writes: one :class:`Node` per inode (hard links are one Node under several
names), small enough for a million of them (``__slots__``, shared empty
values, a file's content kept as the name of a file on disk).

A later layer often writes under a directory that an earlier one made a
symlink: ``lib -> usr/lib`` on Debian's merged /usr, then ``lib/hello.txt``
from BuildKit's ``COPY --link``. containerd (``fs.RootPath``) and umoci
(``github.com/cyphar/filepath-securejoin``) resolve such a parent inside the
image root, so the file lands at ``usr/lib/hello.txt``; :class:`Resolver`
does the same on the tree: each symlink met on the way is followed, an
absolute target from the image root (``var/run -> /run`` is ``/run`` of the
image, never of the host), a relative one from the symlink's directory. The
last component is never followed: an entry named by a symlink replaces the
symlink, as in both references. Where securejoin clamps a ``..`` at the
root, forkd refuses instead: a target that climbs above the root (``lib ->
../../etc``) has no meaning inside an image, no builder writes one that a
later entry must go through, and refusing it names the link. More than
:data:`MAX_LINKS` symlinks in one path (a loop) are refused as the kernel
refuses them (ELOOP), and every component walked counts against
:data:`MAX_WALK_STEPS` for the whole image, so no tree of links makes the
work unbounded.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final, Literal

__all__ = ["MAX_LINKS", "MAX_WALK_STEPS", "Kind", "MergedTree", "Node", "Resolver", "Unresolvable"]

#: Symlinks one path may go through (Linux's MAXSYMLINKS): more is a loop.
MAX_LINKS: Final = 40
#: Path components walked (entries' own and symlinks' targets) for a whole image: a bound on the work.
MAX_WALK_STEPS: Final = 50_000_000

Kind = Literal["file", "dir", "symlink", "char", "block", "fifo"]

KIND_NAMES: Final[dict[str, str]] = {
    "file": "a regular file",
    "dir": "a directory",
    "symlink": "a symlink",
    "char": "a character device",
    "block": "a block device",
    "fifo": "a fifo",
}


@dataclass(eq=False, slots=True)
class Node:
    """One inode of the merged tree; hard links are one Node under several names.

    ``blob`` names a regular file's content (a file in the build directory,
    None when empty); ``children`` is a directory's entries (None for
    anything else); ``xattrs`` are ``(name, value)`` pairs.
    """

    kind: Kind
    mode: int  # permission bits, 0o7777
    uid: int
    gid: int
    mtime: int
    xattrs: tuple[tuple[str, bytes], ...] = ()
    size: int = 0
    blob: str | None = None
    target: str = ""  # a symlink's, verbatim
    device: tuple[int, int] = (0, 0)  # major, minor
    children: dict[str, Node] | None = None
    names: int = 0  # how many paths name this node

    @classmethod
    def directory(
        cls, mode: int = 0o755, uid: int = 0, gid: int = 0, mtime: int = 0, xattrs: tuple[tuple[str, bytes], ...] = ()
    ) -> Node:
        return cls("dir", mode, uid, gid, mtime, xattrs, children={})

    @property
    def entries(self) -> dict[str, Node]:
        """A directory's children (an empty dict for anything else)."""
        return self.children if self.children is not None else {}


@dataclass
class MergedTree:
    """An image's root after all its layers: the root directory and, below it, every entry."""

    root: Node

    def walk(self) -> Iterator[tuple[str, Node]]:
        """Every ``(path, node)``, parents before children, names sorted; the root's path is ``""``.

        Iterative: a hostile image may nest directories deeper than Python's recursion limit.
        """
        stack: list[tuple[str, Node]] = [("", self.root)]
        while stack:
            path, node = stack.pop()
            yield path, node
            if node.children:
                prefix = f"{path}/" if path else ""
                stack.extend((prefix + name, child) for name, child in sorted(node.children.items(), reverse=True))


class Unresolvable(Exception):
    """A path that cannot be resolved inside the root; ``problem`` ends the sentence "entry 'x' ..."."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem


@dataclass(frozen=True, slots=True)
class _Step:
    """One component still to walk: where it came from (the entry's own ``index``, or a symlink's target)."""

    part: str
    index: int  # in the entry's own path; -1 for a component of a symlink's target
    link: str = ""  # the symlink whose target it is: "path -> target"


class Resolver:
    """Resolves directories of the tree inside its root, following in-root symlinks; see the module's doc."""

    def __init__(self, root: Node, *, max_path_bytes: int) -> None:
        self.root = root
        self.max_path_bytes = max_path_bytes
        self.steps = 0
        #: Bumped whenever a name of the tree is removed or replaced: a cached resolution is stale then.
        self.generation = 0
        self._cache: tuple[tuple[str, ...], int, Node, tuple[str, ...]] | None = None

    def changed(self) -> None:
        """The tree lost or replaced a name: forget the cached resolution."""
        self.generation += 1
        self._cache = None

    def directory(
        self,
        parts: tuple[str, ...],
        *,
        create: bool,
        mtime: int = 0,
        replaced: frozenset[tuple[str, ...]] = frozenset(),
    ) -> tuple[Node, tuple[str, ...]] | None:
        """The directory ``parts`` names and its path inside the root, or None when it is not there.

        With ``create``, missing directories are made (0755, root-owned,
        ``mtime``) and a non-directory on the way is :class:`Unresolvable`;
        without, both give None. A symlink of the entry's own path that the
        layer replaces with a directory (``replaced``) has nothing below it
        for a whiteout to hide: the walk ends there (None).
        """
        cache = self._cache
        if create and cache is not None and cache[0] == parts and cache[1] == self.generation:
            return cache[2], cache[3]
        found = self._walk(parts, create=create, mtime=mtime, replaced=replaced)
        if create and found is not None:
            self._cache = (parts, self.generation, found[0], found[1])
        return found

    def _walk(
        self, parts: tuple[str, ...], *, create: bool, mtime: int, replaced: frozenset[tuple[str, ...]]
    ) -> tuple[Node, tuple[str, ...]] | None:
        stack: list[Node] = [self.root]
        names: list[str] = []
        pending = [_Step(part, index) for index, part in reversed(list(enumerate(parts)))]
        links = 0
        while pending:
            step = pending.pop()
            self.steps += 1
            if self.steps > MAX_WALK_STEPS:
                raise Unresolvable(
                    f"takes the image past the {MAX_WALK_STEPS:,} path components (symlinks followed included) "
                    "an image may make forkd walk"
                )
            if step.part in ("", "."):
                continue  # only in a symlink's target
            if step.part == "..":  # only in a symlink's target: an entry's own path never has one
                if len(stack) == 1:
                    raise Unresolvable(
                        f"would be written through the symlink {step.link}, which leads out of the image root"
                    )
                stack.pop()
                names.pop()
                continue
            directory = stack[-1]
            assert directory.children is not None  # only directories are pushed
            child = directory.children.get(step.part)
            here = "/".join([*names, step.part])
            if child is None:
                if not create:
                    return None
                if len(os.fsencode(here)) > self.max_path_bytes:
                    raise Unresolvable(f"resolves to {here[:80]!r}…, a path longer than {self.max_path_bytes} bytes")
                child = Node.directory(mtime=mtime)
                child.names = 1
                directory.children[step.part] = child
            elif child.kind == "symlink":
                if step.index >= 0 and parts[: step.index + 1] in replaced:
                    return None
                links += 1
                if links > MAX_LINKS:
                    raise Unresolvable(
                        f"goes through more than {MAX_LINKS} symlinks (a loop?), the last {here!r} -> {child.target!r}"
                    )
                if child.target.startswith("/"):
                    stack, names = [self.root], []
                link = f"{here!r} -> {child.target!r}"
                pending.extend(_Step(part, -1, link) for part in reversed(child.target.split("/")))
                continue
            elif child.kind != "dir":
                if not create:
                    return None
                raise Unresolvable(
                    f"needs {here!r} to be a directory, but an earlier entry made it {KIND_NAMES[child.kind]}"
                )
            stack.append(child)
            names.append(step.part)
        return stack[-1], tuple(names)
