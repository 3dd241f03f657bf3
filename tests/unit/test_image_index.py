"""Packages index parsing, Debian version order and the dependency closure of a recipe."""

from __future__ import annotations

import pytest

from pytest_forkd.errors import ImageError
from pytest_forkd.image.index import PackageIndex, compare_versions, parse_relations

SHA = "0" * 64


def stanza(name: str, *, version: str = "1.0-1", depends: str = "", pre: str = "", provides: str = "") -> str:
    lines = [f"Package: {name}", f"Version: {version}", "Architecture: amd64"]
    if pre:
        lines.append(f"Pre-Depends: {pre}")
    if depends:
        lines.append(f"Depends: {depends}")
    if provides:
        lines.append(f"Provides: {provides}")
    lines += [
        f"Filename: pool/main/{name}_{version}_amd64.deb",
        "Size: 1234",
        f"SHA256: {SHA}",
        "Description: a package",
        " Depends: this continuation line is not a field",
    ]
    return "\n".join(lines) + "\n"


# A bookworm-shaped slice of the archive: python3-minimal names the interpreter's version.
ARCHIVE = "\n".join(
    [
        stanza("python3-minimal", depends="dpkg (>= 1.13.20)", pre="python3.11-minimal (>= 3.11.2-1~)"),
        stanza("libpython3-stdlib", depends="libpython3.11-stdlib (>= 3.11.2-1~)"),
        stanza("python3.11-minimal", pre="libc6 (>= 2.36)", depends="libpython3.11-minimal (= 3.11.2-6), zlib1g"),
        stanza("libpython3.11-minimal", depends="libc6 (>= 2.14), libssl3 (>= 3.0.0)"),
        stanza(
            "libpython3.11-stdlib",
            depends=(
                "libpython3.11-minimal (= 3.11.2-6), media-types | mime-support, libreadline8 (>= 7.0~beta), python3:any"
            ),
        ),
        stanza("libc6", depends="libgcc-s1"),
        stanza("libgcc-s1", depends="gcc-12-base (= 12.2.0-14), libc6 (>= 2.35)"),
        stanza("gcc-12-base"),
        stanza("zlib1g", version="1:1.2.13.dfsg-1", depends="libc6 (>= 2.14)"),
        stanza("libssl3", depends="libc6 (>= 2.34)"),
        stanza("media-types"),
        stanza("mime-support", depends="perl-base"),
        stanza("perl-base"),
        stanza("libreadline8", depends="readline-common, libc6 (>= 2.33)"),
        stanza("readline-common", depends="dpkg (>= 1.15.4) | install-info"),
        stanza("dpkg", pre="libc6 (>= 2.34)", depends="tar (>= 1.28-1)"),
        stanza("install-info"),
        stanza("tar"),
        stanza("python3", depends="python3-minimal", provides="python3-any, python3:any (= 3.11.2-1)"),
        stanza("busybox-static", version="1:1.35.0-4+deb12u1+b1", provides="busybox"),
        stanza("mail-transport-agent-a", provides="mail-transport-agent"),
        stanza("needs-mta", depends="mail-transport-agent"),
        stanza(
            "linux-image-cloud-amd64", version="6.1.176-1", depends="linux-image-6.1.0-50-cloud-amd64 (= 6.1.176-1)"
        ),
        stanza(
            "linux-image-6.1.0-50-cloud-amd64", version="6.1.176-1", depends="kmod, linux-base (>= 4.3~)", pre="debconf"
        ),
        # a package listed twice (the archive keeps two versions): the newer one counts
        stanza("twice", version="2.0~rc1-1"),
        stanza("twice", version="2.0-1"),
        stanza("twice", version="1.9-1"),
    ]
)


@pytest.fixture(scope="module")
def index() -> PackageIndex:
    return PackageIndex.parse(ARCHIVE, "Debian testrel on http://127.0.0.1/debian")


def test_stanzas_keep_the_fields_the_builder_needs(index: PackageIndex) -> None:
    package = index["python3.11-minimal"]
    assert package.version == "1.0-1" and package.architecture == "amd64"
    assert package.filename == "pool/main/python3.11-minimal_1.0-1_amd64.deb"
    assert package.size == 1234 and package.sha256 == SHA
    # Pre-Depends come first and count like Depends; version constraints are dropped.
    assert package.dependency_groups() == [["libc6"], ["libpython3.11-minimal"], ["zlib1g"]]
    assert index["zlib1g"].version == "1:1.2.13.dfsg-1"


def test_relations_drop_versions_qualifiers_and_restrictions() -> None:
    assert parse_relations("a (>= 1), b | c:any, d [amd64] <!nocheck>") == [["a"], ["b", "c"], ["d"]]
    assert parse_relations("") == []


@pytest.mark.parametrize(
    ("older", "newer"),
    [
        ("1.0-1", "1.0-2"),
        ("1.0~rc1-1", "1.0-1"),
        ("1.0-1", "1:0.1-1"),
        ("2.36-9", "2.36-9+deb12u4"),
        ("6.1.0-9", "6.1.0-10"),
        ("1.2.13.dfsg-1", "1.2.13.dfsg-1+b1"),
        ("3.0.11-1~deb12u2", "3.0.11-1"),
        ("1.0", "1.0-0.1"),
    ],
)
def test_debian_version_order(older: str, newer: str) -> None:
    assert compare_versions(older, newer) == -1
    assert compare_versions(newer, older) == 1
    assert compare_versions(newer, newer) == 0


def test_the_newest_of_duplicate_stanzas_wins(index: PackageIndex) -> None:
    assert index["twice"].version == "2.0-1"


def test_closure_follows_dependencies_alternatives_and_virtual_packages(index: PackageIndex) -> None:
    closure = index.closure(["python3-minimal", "libpython3-stdlib"], [])
    assert closure[:2] == ["python3-minimal", "libpython3-stdlib"]
    assert set(closure) == {
        "python3-minimal",
        "libpython3-stdlib",
        "python3.11-minimal",
        "libpython3.11-stdlib",
        "dpkg",
        "libc6",
        "libpython3.11-minimal",
        "zlib1g",
        "libssl3",
        "libgcc-s1",
        "gcc-12-base",
        "media-types",
        "libreadline8",
        "readline-common",
        "tar",
        # python3:any is virtual: its provider comes in
        "python3",
    }
    assert "mime-support" not in closure  # the first alternative of "media-types | mime-support" was taken


def test_excluding_a_package_drops_what_only_it_needed(index: PackageIndex) -> None:
    closure = index.closure(["python3-minimal", "libpython3-stdlib"], ["dpkg", "gcc-12-base", "python3"])
    assert "dpkg" not in closure and "tar" not in closure and "gcc-12-base" not in closure
    assert "readline-common" in closure and "install-info" in closure  # dpkg | install-info: the next one
    assert "libc6" in closure


def test_an_excluded_first_alternative_falls_back_to_the_next(index: PackageIndex) -> None:
    closure = index.closure(["libpython3.11-stdlib"], ["media-types", "python3"])
    assert "media-types" not in closure
    assert "mime-support" in closure and "perl-base" in closure


def test_roots_are_kept_even_when_excluded_and_virtual_roots_become_providers(index: PackageIndex) -> None:
    assert "dpkg" in index.closure(["dpkg"], ["dpkg"])
    assert index.closure(["busybox"], []) == ["busybox-static"]
    assert index.closure(["needs-mta"], []) == ["needs-mta", "mail-transport-agent-a"]


def test_unknown_packages_are_named_with_the_release_and_the_fix(index: PackageIndex) -> None:
    with pytest.raises(ImageError) as caught:
        index.closure(["python3-minimal", "python3.99-minimal", "nope"], [])
    message = str(caught.value)
    assert "\n" not in message
    assert "Debian testrel on http://127.0.0.1/debian has no package python3.99-minimal, nope" in message
    assert "fix the recipe's packages" in message


def test_kernel_metapackage_resolves_to_the_package_that_ships_the_kernel(index: PackageIndex) -> None:
    assert index.kernel_package("linux-image-cloud-amd64") == "linux-image-6.1.0-50-cloud-amd64"
    assert index.kernel_package("linux-image-6.1.0-50-cloud-amd64") == "linux-image-6.1.0-50-cloud-amd64"
    with pytest.raises(ImageError, match="has no package linux-image-nope; fix the recipe's kernel"):
        index.kernel_package("linux-image-nope")


def test_python_version_is_read_from_the_packages(index: PackageIndex) -> None:
    closure = index.closure(["python3-minimal"], ["dpkg"])
    assert index.python_version(closure) == "3.11"
    assert index.python_version(["busybox-static"]) is None


def test_a_stanza_without_a_checksum_is_a_malformed_index() -> None:
    with pytest.raises(ImageError, match="lacks a valid 'SHA256' field; the mirror serves a malformed index"):
        PackageIndex.parse("Package: a\nVersion: 1\nFilename: pool/a.deb\nSize: 1\n", "somewhere")
