"""Debian packages through the host's apt: resolve, close over dependencies, download, unpack.

The guest is built only from packages of the host's own distribution, taken
with the ordinary tools (``apt-cache``, ``apt-get download``, ``dpkg-deb``),
so no root and no chroot are needed, nothing is installed on the host and a
rebuild works offline once the .deb files are cached.

The dependency closure is computed here, one ``apt-cache depends`` per level
of the dependency graph, rather than with ``apt-cache depends --recurse``:
an excluded package must also drop the dependencies only it pulled in.
"""

from __future__ import annotations

import os
import re
import subprocess
import tarfile
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

from filelock import FileLock

from ..errors import ImageError

DEPENDS_FLAGS = (
    "--no-recommends",
    "--no-suggests",
    "--no-conflicts",
    "--no-breaks",
    "--no-replaces",
    "--no-enhances",
)
# "  Depends: name", " |Depends: name" (an alternative to the next line), "  PreDepends: <virtual>"
DEPENDENCY_LINE = re.compile(r"^ ([ |])([A-Za-z]+): (\S+)$")
# Providers of a virtual package, listed under it with deeper indentation.
PROVIDER_LINE = re.compile(r"^ {4}(\S+)$")
APT_LISTS_HINT = "run `apt-get update` (as root) so apt knows the packages of this distribution, then retry"


@dataclass(frozen=True)
class DebPackage:
    """The candidate version of one package, as apt would download it."""

    name: str
    version: str
    architecture: str
    size: int

    @property
    def filename(self) -> str:
        """The file name ``apt-get download`` gives it (the epoch colon is URL-encoded)."""
        return f"{self.name}_{self.version.replace(':', '%3a')}_{self.architecture}.deb"


def _missing_tool(name: str) -> ImageError:
    return ImageError(
        f"{name} not found: guest images are built from the host's Debian packages, "
        "so the builder needs a Debian-based host with apt and dpkg"
    )


def _run(argv: Sequence[str], *, cwd: Path | None = None, what: str) -> str:
    try:
        completed = subprocess.run(list(argv), cwd=cwd, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise _missing_tool(argv[0]) from None
    if completed.returncode != 0:
        detail = (completed.stderr or completed.stdout).strip()
        raise ImageError(f"{what} failed ({' '.join(argv[:3])} ... exit {completed.returncode}): {detail}")
    return completed.stdout


def _strip_qualifier(name: str) -> str:
    """``python3:any`` -> ``python3``; other architecture qualifiers are kept."""
    return name[: -len(":any")] if name.endswith(":any") else name


def candidates(names: Iterable[str]) -> dict[str, DebPackage]:
    """The candidate version of each package; ImageError naming those apt does not know."""
    wanted = list(dict.fromkeys(names))
    if not wanted:
        return {}
    try:
        # Not _run: apt-cache exits non-zero when some names are unknown, and
        # still prints the others; the unknown ones are reported below.
        completed = subprocess.run(
            ["apt-cache", "show", "--no-all-versions", *wanted], capture_output=True, text=True, check=False
        )
    except FileNotFoundError:
        raise _missing_tool("apt-cache") from None
    found: dict[str, DebPackage] = {}
    for stanza in completed.stdout.split("\n\n"):
        fields = dict(
            line.split(": ", 1) for line in stanza.splitlines() if ": " in line and not line.startswith(" ")
        )
        if "Package" in fields and "Version" in fields:
            found[fields["Package"]] = DebPackage(
                name=fields["Package"],
                version=fields["Version"],
                architecture=fields.get("Architecture", "all"),
                size=int(fields.get("Size", "0")),
            )
    unknown = [name for name in wanted if name.split(":")[0] not in found]
    if unknown:
        raise ImageError(
            f"apt has no installable version of {', '.join(unknown)} on this host; {APT_LISTS_HINT}"
            " (or fix the package names in the recipe)"
        )
    return {name: found[name.split(":")[0]] for name in wanted}


def _direct_dependencies(names: Sequence[str]) -> dict[str, list[list[list[str]]]]:
    """For each package: its Depends/PreDepends as OR-groups of alternatives.

    An alternative is a list of concrete package names: one name for a real
    package, the providers for a virtual one (possibly none).
    """
    output = _run(["apt-cache", "depends", *DEPENDS_FLAGS, *names], what="resolving dependencies")
    result: dict[str, list[list[list[str]]]] = {}
    groups: list[list[list[str]]] = []
    alternative: list[str] | None = None
    group_open = False
    for line in output.splitlines():
        if line and not line.startswith(" "):
            groups = result.setdefault(_strip_qualifier(line.strip()), [])
            alternative, group_open = None, False
            continue
        dependency = DEPENDENCY_LINE.match(line)
        if dependency:
            continues, kind, target = dependency.groups()
            if kind not in ("Depends", "PreDepends"):
                alternative, group_open = None, False
                continue
            alternative = [] if target.startswith("<") else [_strip_qualifier(target)]
            if group_open:
                groups[-1].append(alternative)
            else:
                groups.append([alternative])
            group_open = continues == "|"
            continue
        provider = PROVIDER_LINE.match(line)
        if provider and alternative is not None and not alternative:
            alternative.append(_strip_qualifier(provider.group(1)))
    return result


def dependency_closure(roots: Sequence[str], exclude: Iterable[str]) -> list[str]:
    """The roots plus everything they depend on, minus ``exclude`` and what only it needed.

    The roots themselves are always kept, even when excluded. For an OR
    group the first alternative already chosen wins, else the first one not
    excluded; a group whose alternatives are all excluded is dropped.
    """
    excluded = set(exclude) - set(roots)
    chosen: dict[str, None] = dict.fromkeys(roots)
    frontier = list(roots)
    while frontier:
        dependencies = _direct_dependencies(frontier)
        frontier = []
        for groups in dependencies.values():
            for group in groups:
                options = [name for alternative in group for name in alternative]
                if any(name in chosen for name in options):
                    continue
                pick = next((name for name in options if name not in excluded), None)
                if pick is not None:
                    chosen[pick] = None
                    frontier.append(pick)
    return list(chosen)


def resolve_kernel_package(name: str) -> str:
    """Follow a kernel metapackage (linux-image-cloud-amd64) to the package that ships the kernel."""
    seen = {name}
    while True:
        dependencies = _direct_dependencies([name]).get(name, [])
        image_dependencies = [
            option
            for group in dependencies
            for alternative in group
            for option in alternative
            if option.startswith("linux-image-") and option not in seen
        ]
        if not image_dependencies:
            return name
        name = image_dependencies[0]
        seen.add(name)


def download(
    packages: Sequence[DebPackage], cache: Path, progress: Callable[[str], None]
) -> dict[str, Path]:
    """Make sure every package's .deb is in ``cache``; return name -> .deb path.

    Files already cached are reused (a rebuild needs no network). Downloads
    go to a private directory first so a concurrent or interrupted download
    never leaves a truncated .deb under its final name.
    """
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(cache / ".download.lock"):
        missing = [package for package in packages if not (cache / package.filename).is_file()]
        if missing:
            megabytes = sum(package.size for package in missing) / 1e6
            progress(f"downloading {len(missing)} packages ({megabytes:.1f} MB) into {cache}")
            with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as scratch:
                try:
                    _run(
                        ["apt-get", "download", *(f"{p.name}={p.version}" for p in missing)],
                        cwd=Path(scratch),
                        what="downloading packages",
                    )
                except ImageError as exc:
                    raise ImageError(f"{exc}\nCheck network access to the apt mirrors, or {APT_LISTS_HINT}") from None
                for package in missing:
                    fetched = Path(scratch) / package.filename
                    if not fetched.is_file():
                        raise ImageError(
                            f"apt-get download did not produce {package.filename}; {APT_LISTS_HINT}"
                        )
                    os.replace(fetched, cache / package.filename)
        else:
            progress(f"all {len(packages)} packages already downloaded in {cache}")
    return {package.name: cache / package.filename for package in packages}


def unpack(deb: Path, root: Path) -> None:
    """Unpack a package's files into ``root`` (no maintainer scripts run)."""
    _run(["dpkg-deb", "-x", str(deb), str(root)], what=f"unpacking {deb.name}")


@contextmanager
def data_tar(deb: Path) -> Iterator[tarfile.TarFile]:
    """Stream a package's file archive, to pick a few members without unpacking it all."""
    try:
        process = subprocess.Popen(
            ["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
    except FileNotFoundError:
        raise _missing_tool("dpkg-deb") from None
    assert process.stdout is not None
    try:
        with tarfile.open(fileobj=process.stdout, mode="r|*") as archive:
            yield archive
    finally:
        process.stdout.close()
        process.communicate()
