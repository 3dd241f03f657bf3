"""The Debian packages of a recipe: from its release's index to cached .deb files.

The guest is built from a pinned Debian release (the recipe's ``release``)
read straight from a mirror (see :mod:`.archive` for the chain of trust and
:mod:`.mirror` for how the mirror is chosen), never from the host's own
distribution: the same recipe gives the same guest on Debian 12, Debian 13,
Ubuntu or a host without apt, and no root, chroot or apt lists are needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .archive import Release, SuiteMissing, download
from .deb import data_tar, unpack
from .index import Package, PackageIndex
from .mirror import Mirror, find_mirror, find_security_mirror

__all__ = ["Selection", "data_tar", "select_packages", "unpack"]


@dataclass(frozen=True)
class Selection:
    """What a recipe resolves to in its release: the kernel package, the closure and their .debs."""

    release: str
    release_version: str
    mirror: Mirror
    kernel: Package
    packages: tuple[Package, ...]  # the closure of the recipe's packages, roots first
    debs: dict[str, Path]  # package name -> cached .deb
    python: str | None  # "3.11": the interpreter's minor version, read from the packages

    @property
    def kernel_deb(self) -> Path:
        return self.debs[self.kernel.name]

    def package_debs(self) -> list[Path]:
        return [self.debs[package.name] for package in self.packages]


def select_packages(
    release: str,
    kernel: str,
    roots: tuple[str, ...],
    exclude: tuple[str, ...],
    cache: Path,
    progress: Callable[[str], None],
    *,
    mirror: Mirror | None = None,
    security_mirror: Mirror | None = None,
    keyring_path: Path | None = None,
) -> Selection:
    """Resolve the recipe's kernel and packages in ``release`` and download what is not cached.

    The release's ``-updates`` suite (same mirror) and ``-security`` suite
    (see :func:`find_security_mirror`) are read too when they exist, and
    their newer packages replace the release's, as apt would install them.
    An explicit ``mirror`` without ``security_mirror`` reads no security suite.
    """
    explicit_mirror = mirror is not None
    mirror = mirror or find_mirror()
    # One architecture (amd64, with "all"): a qualifier such as python3:any or zlib1g:amd64 says nothing more.
    roots = tuple(dict.fromkeys(name.split(":")[0] for name in roots))
    kernel = kernel.split(":")[0]
    source = Release(mirror, release, cache, progress, keyring_path=keyring_path)
    progress(f"reading Debian {release} from {mirror.url} (from {mirror.origin})")
    index: PackageIndex = source.index()
    served_by: dict[str, Mirror] = {}
    if security_mirror is None and not explicit_mirror:
        security_mirror = find_security_mirror(mirror)
    for suite_mirror, suite in ((mirror, f"{release}-updates"), (security_mirror, f"{release}-security")):
        if suite_mirror is None:
            continue
        extra = Release(suite_mirror, suite, cache, progress, keyring_path=keyring_path, optional=True)
        try:
            newer = extra.index()
        except SuiteMissing as exc:
            progress(f"no {suite} suite ({exc}): {release} without those updates")
            continue
        taken = index.overlay(newer)
        served_by.update(dict.fromkeys(taken, suite_mirror))
        if taken:
            progress(f"{len(taken)} newer packages from {suite}")
    index.require([kernel], "recipe's kernel")
    index.require(list(roots), "recipe's packages")
    kernel_name = index.kernel_package(kernel)
    closure = index.closure(roots, exclude)
    packages = tuple(index[name] for name in closure)
    progress(f"resolved kernel {kernel_name} and {len(packages)} packages from {', '.join(roots)}")
    debs = download(
        [index[kernel_name], *packages], cache, progress, lambda package: served_by.get(package.name, mirror)
    )
    return Selection(
        release=release,
        release_version=source.verified_release().version,
        mirror=mirror,
        kernel=index[kernel_name],
        packages=packages,
        debs=debs,
        python=index.python_version(closure),
    )
