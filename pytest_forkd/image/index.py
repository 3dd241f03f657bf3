"""A Debian Packages index: parsing, version order, and the dependency closure of a recipe.

Only what the builder needs is kept from each stanza (name, version,
dependencies, what it provides, where its .deb is and its checksum), so an
index of a whole release (60,000 packages) loads in a fraction of a second
from the builder's cache.

Dependencies are followed the way an image needs them, not the way apt
installs a system: Depends and Pre-Depends only, version constraints
ignored (a release has one version of each package), an OR group satisfied
by whatever the closure already has, else by its first alternative that is
not excluded, a virtual package by its first provider. An excluded package
also drops whatever only it pulled in, so a recipe can leave out the
package-manager machinery (dpkg, perl, debconf) that an interpreter never
runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping, Sequence

from ..errors import ImageError

#: Fields kept from a Packages stanza.
FIELDS = ("Package", "Version", "Architecture", "Pre-Depends", "Depends", "Provides", "Filename", "Size", "SHA256")
# "name", "name:any", "name (>= 1.0)", "name [amd64]", "name <!nocheck>"
RELATION = re.compile(r"^\s*(?P<name>[a-z0-9][a-z0-9+.-]*)(?::[a-z0-9-]+)?")
PYTHON_MINIMAL = re.compile(r"^python3\.(\d+)-minimal$")


@dataclass(frozen=True)
class Package:
    """One binary package of a release, as its Packages index describes it."""

    name: str
    version: str
    architecture: str
    depends: str  # Pre-Depends and Depends, comma separated
    provides: str
    filename: str  # path of the .deb below the mirror's root
    size: int
    sha256: str

    def dependency_groups(self) -> list[list[str]]:
        """Pre-Depends and Depends as OR groups of package names (qualifiers and versions dropped)."""
        return parse_relations(self.depends)

    def provided(self) -> list[str]:
        return [group[0] for group in parse_relations(self.provides) if group]


def parse_relations(text: str) -> list[list[str]]:
    """``a (>= 1), b | c:any`` -> ``[["a"], ["b", "c"]]``."""
    groups = []
    for clause in text.split(","):
        alternatives = []
        for option in clause.split("|"):
            match = RELATION.match(option)
            if match:
                alternatives.append(match["name"])
        if alternatives:
            groups.append(alternatives)
    return groups


def stanzas(text: str) -> Iterator[dict[str, str]]:
    """The kept fields of each stanza of a Packages file (continuation lines are skipped)."""
    wanted = frozenset(FIELDS)
    for block in text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.split("\n"):
            if not line or line[0] in " \t":
                continue
            key, _, value = line.partition(":")
            if key in wanted:
                fields[key] = value.strip()
        if "Package" in fields:
            yield fields


def package_from_fields(fields: Mapping[str, str], where: str) -> Package:
    try:
        return Package(
            name=fields["Package"],
            version=fields["Version"],
            architecture=fields.get("Architecture", "all"),
            depends=", ".join(fields[key] for key in ("Pre-Depends", "Depends") if fields.get(key)),
            provides=fields.get("Provides", ""),
            filename=fields["Filename"],
            size=int(fields.get("Size", "0")),
            sha256=fields["SHA256"],
        )
    except (KeyError, ValueError) as exc:
        raise ImageError(
            f"{where}: package {fields.get('Package')!r} lacks a valid {exc} field; the mirror serves a "
            "malformed index: use another mirror"
        ) from None


# -- Debian version order (deb-version(7)) ----------------------------------------


def _order(char: str) -> int:
    if char == "~":
        return -1
    if char.isalpha():
        return ord(char)
    return ord(char) + 256


def _compare_part(left: str, right: str) -> int:
    i = j = 0
    while i < len(left) or j < len(right):
        difference = 0
        while (i < len(left) and not left[i].isdigit()) or (j < len(right) and not right[j].isdigit()):
            a = _order(left[i]) if i < len(left) and not left[i].isdigit() else 0
            b = _order(right[j]) if j < len(right) and not right[j].isdigit() else 0
            if a != b:
                return -1 if a < b else 1
            i += 1
            j += 1
        while i < len(left) and left[i] == "0":
            i += 1
        while j < len(right) and right[j] == "0":
            j += 1
        while i < len(left) and left[i].isdigit() and j < len(right) and right[j].isdigit():
            if not difference:
                difference = (left[i] > right[j]) - (left[i] < right[j])
            i += 1
            j += 1
        if i < len(left) and left[i].isdigit():
            return 1
        if j < len(right) and right[j].isdigit():
            return -1
        if difference:
            return difference
    return 0


def _split_version(version: str) -> tuple[int, str, str]:
    epoch, _, rest = version.partition(":") if ":" in version else ("0", "", version)
    upstream, _, revision = rest.rpartition("-") if "-" in rest else (rest, "", "0")
    return int(epoch or 0), upstream, revision


def compare_versions(left: str, right: str) -> int:
    """-1, 0 or 1 as Debian version ``left`` sorts before, equal to or after ``right``."""
    a, b = _split_version(left), _split_version(right)
    if a[0] != b[0]:
        return -1 if a[0] < b[0] else 1
    return _compare_part(a[1], b[1]) or _compare_part(a[2], b[2])


# -- the index --------------------------------------------------------------------


class PackageIndex:
    """The packages of one release and architecture, by name, with the providers of virtual names."""

    def __init__(self, packages: Iterable[Package], where: str) -> None:
        self.where = where
        self.packages: dict[str, Package] = {}
        for package in packages:
            known = self.packages.get(package.name)
            if known is None or compare_versions(package.version, known.version) > 0:
                self.packages[package.name] = package
        self.providers: dict[str, list[str]] = {}
        for package in self.packages.values():
            for virtual in package.provided():
                self.providers.setdefault(virtual, []).append(package.name)

    def overlay(self, newer: PackageIndex) -> list[str]:
        """Take ``newer``'s packages that are new or newer (an updates or security suite over its release).

        Returns the names taken, so the caller knows which mirror serves them.
        """
        taken = []
        for name, package in newer.packages.items():
            known = self.packages.get(name)
            if known is None or compare_versions(package.version, known.version) > 0:
                self.packages[name] = package
                taken.append(name)
                for virtual in package.provided():
                    providers = self.providers.setdefault(virtual, [])
                    if name not in providers:
                        providers.append(name)
        return taken

    @classmethod
    def parse(cls, text: str, where: str) -> PackageIndex:
        """Parse a Packages file; ``where`` names it in error messages."""
        return cls((package_from_fields(fields, where) for fields in stanzas(text)), where)

    def __contains__(self, name: object) -> bool:
        return name in self.packages

    def __getitem__(self, name: str) -> Package:
        return self.packages[name]

    def require(self, names: Sequence[str], what: str) -> None:
        """ImageError naming every one of ``names`` that is neither a package nor provided by one."""
        unknown = [name for name in names if name not in self.packages and name not in self.providers]
        if unknown:
            raise ImageError(
                f"{self.where} has no package {', '.join(unknown)}; fix the {what} (package names differ "
                "between Debian releases: look them up on the release's package list)"
            )

    def concrete(self, name: str, excluded: frozenset[str] = frozenset()) -> str | None:
        """``name`` itself when it is a real package, else its first provider that is not excluded."""
        if name in self.packages:
            return None if name in excluded else name
        return next((provider for provider in self.providers.get(name, ()) if provider not in excluded), None)

    def closure(self, roots: Sequence[str], exclude: Iterable[str]) -> list[str]:
        """The roots plus everything they depend on, minus ``exclude`` and what only it needed.

        The roots themselves are always kept (a virtual root becomes its
        provider). An OR group is skipped when any of its alternatives (or
        their providers) is already chosen; otherwise its first alternative
        that resolves to a package not excluded is taken. A group whose
        alternatives are all excluded or unknown is dropped. Dependencies are
        followed breadth first, so the result does not depend on the order
        in which a level's packages are visited.
        """
        self.require(roots, "recipe's packages")
        excluded = frozenset(exclude) - set(roots)
        chosen: dict[str, None] = {}
        for root in roots:
            chosen[self.concrete(root) or root] = None
        frontier = list(chosen)
        while frontier:
            next_frontier: list[str] = []
            for name in frontier:
                for group in self.packages[name].dependency_groups():
                    if any(
                        option in chosen or any(p in chosen for p in self.providers.get(option, ())) for option in group
                    ):
                        continue
                    pick = next(
                        (found for option in group if (found := self.concrete(option, excluded)) is not None), None
                    )
                    if pick is not None:
                        chosen[pick] = None
                        next_frontier.append(pick)
            frontier = next_frontier
        return list(chosen)

    def kernel_package(self, name: str) -> str:
        """Follow a kernel metapackage (linux-image-cloud-amd64) to the package that ships the kernel."""
        self.require([name], "recipe's kernel")
        current = self.concrete(name) or name
        seen = {current}
        while True:
            images = [
                option
                for group in self.packages[current].dependency_groups()
                for option in group
                if option.startswith("linux-image-") and option not in seen and option in self.packages
            ]
            if not images:
                return current
            current = images[0]
            seen.add(current)

    def python_version(self, names: Iterable[str]) -> str | None:
        """The Python minor version ("3.11") of the interpreter among ``names``, or None when there is none.

        It is read from the packages (the release's ``python3.X-minimal``,
        which ``python3-minimal`` depends on), so a recipe never names it.
        """
        versions = sorted(
            (int(match.group(1)) for name in names if (match := PYTHON_MINIMAL.match(name))), reverse=True
        )
        return f"3.{versions[0]}" if versions else None
