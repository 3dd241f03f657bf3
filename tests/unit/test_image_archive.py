"""The mirror client against a tiny signed archive on 127.0.0.1: signature, hash chain, cache, bad mirrors."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_debian import ArchiveServer, FakeArchive, FakePackage, GnuPG, gpg_available

from pytest_forkd.errors import ImageError
from pytest_forkd.image import archive as archive_module
from pytest_forkd.image.archive import Release
from pytest_forkd.image.debian import select_packages
from pytest_forkd.image.mirror import Mirror

pytestmark = [
    pytest.mark.skipif(not gpg_available(), reason="needs gpg, gpgv and gpgconf for a throwaway signing key"),
    pytest.mark.slow,
]  # a gpg key and signatures per test

PACKAGES = [
    FakePackage(
        "python3-minimal",
        depends="dpkg (>= 1.13.20)",
        pre_depends="python3.12-minimal (>= 3.12.1-1~)",
        files={"usr/bin/": b"", "usr/bin/python3": b"link"},
    ),
    FakePackage("python3.12-minimal", depends="libc6 (>= 2.36)", files={"usr/bin/python3.12": b"interp"}),
    FakePackage("libpython3-stdlib", depends="libpython3.12-stdlib"),
    FakePackage("libpython3.12-stdlib", depends="media-types | mime-support, python3:any"),
    FakePackage("python3", provides="python3:any", depends="python3-minimal"),
    FakePackage("libc6", files={"usr/lib/x86_64-linux-gnu/libc.so.6": b"libc"}),
    FakePackage("dpkg", depends="tar"),
    FakePackage("tar"),
    FakePackage("media-types", architecture="all"),
    FakePackage("busybox-static", version="1:1.36.1-9", provides="busybox", files={"usr/bin/busybox": b"BB"}),
    FakePackage("linux-image-cloud-amd64", depends="linux-image-6.12.1-cloud-amd64 (= 6.12.1-1)"),
    FakePackage("linux-image-6.12.1-cloud-amd64", version="6.12.1-1", files={"boot/vmlinuz-6.12.1-cloud-amd64": b"K"}),
]
ROOTS = ("busybox-static", "python3-minimal", "libpython3-stdlib")


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GnuPG, GnuPG, Path]]:
    """The archive's key (its public half in a keyring) and a stranger's key."""
    base = tmp_path_factory.mktemp("gpg")
    archive_key, stranger = GnuPG(base / "archive"), GnuPG(base / "stranger", "Someone Else")
    try:
        yield archive_key, stranger, archive_key.export_keyring(base / "keyring.gpg")
    finally:
        archive_key.close()
        stranger.close()


@pytest.fixture
def archive(tmp_path: Path, keys: tuple[GnuPG, GnuPG, Path]) -> FakeArchive:
    fake = FakeArchive(tmp_path / "srv" / "debian")
    fake.publish("testrel", PACKAGES, keys[0])
    return fake


@pytest.fixture
def server(archive: FakeArchive) -> Iterator[ArchiveServer]:
    served = ArchiveServer(archive.root.parent)
    served.mirror_url = f"{served.url}/debian"
    yield served
    served.close()


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "debs"


def select(
    server_url: str,
    cache: Path,
    keyring: Path,
    release: str = "testrel",
    messages: list[str] | None = None,
    roots: tuple[str, ...] = ROOTS,
    security: str | None = None,
):
    return select_packages(
        release,
        "linux-image-cloud-amd64",
        roots,
        ("dpkg", "python3"),
        cache,
        (messages if messages is not None else []).append,
        mirror=Mirror(server_url, "test"),
        keyring_path=keyring,
        security_mirror=Mirror(security, "test") if security else None,
    )


def cache_files(cache: Path) -> list[str]:
    return sorted(
        str(path.relative_to(cache)) for path in cache.rglob("*") if path.is_file() and path.suffix != ".lock"
    )


def test_resolves_downloads_and_caches_by_sha256(
    server: ArchiveServer, cache: Path, keys: tuple[GnuPG, GnuPG, Path], archive: FakeArchive
) -> None:
    messages: list[str] = []
    selection = select(server.mirror_url, cache, keys[2], messages=messages)
    assert selection.kernel.name == "linux-image-6.12.1-cloud-amd64"
    assert [package.name for package in selection.packages] == [
        "busybox-static",
        "python3-minimal",
        "libpython3-stdlib",
        "python3.12-minimal",
        "libpython3.12-stdlib",
        "libc6",
        "media-types",
    ]
    assert selection.python == "3.12" and selection.release_version == "99.1"
    for package in (selection.kernel, *selection.packages):
        path = selection.debs[package.name]
        assert path == cache / f"{package.sha256}.deb"
        assert path.read_bytes() == archive.path_of(package.name).read_bytes()
    assert not [name for name in cache_files(cache) if ".part" in name or name.startswith(".")]
    assert any("downloading 8 packages" in message for message in messages)

    # Warm: the index comes from the cache (only the small signed Release is fetched) and no .deb is fetched.
    server.requests.clear()
    messages.clear()
    again = select(server.mirror_url, cache, keys[2], messages=messages)
    assert again.debs == selection.debs
    assert [path for path in server.requests if "/dists/testrel/" in path or "/pool/" in path] == [
        "/debian/dists/testrel/InRelease"
    ]
    assert any("all 8 packages already downloaded" in message for message in messages)


def test_offline_builds_reuse_the_verified_release_file(
    server: ArchiveServer, cache: Path, keys: tuple[GnuPG, GnuPG, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(archive_module, "ATTEMPTS", 1)
    first = select(server.mirror_url, cache, keys[2])
    server.close()
    messages: list[str] = []
    again = select(server.mirror_url, cache, keys[2], messages=messages)
    assert again.debs == first.debs
    assert any("mirror unreachable" in message for message in messages)


def test_release_and_detached_signature_when_there_is_no_inrelease(
    archive: FakeArchive, cache: Path, keys: tuple[GnuPG, GnuPG, Path]
) -> None:
    archive.publish("testrel", PACKAGES, keys[0], in_release=False)
    served = ArchiveServer(archive.root.parent)
    served.mirror_url = f"{served.url}/debian"
    try:
        assert select(served.mirror_url, cache, keys[2]).python == "3.12"
        assert "/debian/dists/testrel/Release.gpg" in served.requests
    finally:
        served.close()


def test_a_release_signed_by_another_key_is_refused(
    archive: FakeArchive, server: ArchiveServer, cache: Path, keys: tuple[GnuPG, GnuPG, Path]
) -> None:
    archive.publish("testrel", PACKAGES, keys[1])
    with pytest.raises(ImageError) as caught:
        select(server.mirror_url, cache, keys[2])
    message = str(caught.value)
    assert "\n" not in message
    assert "release file from" in message and "is not signed by a key of" in message
    assert "use another mirror" in message
    assert not list(cache.rglob("*.deb")) and not list(cache.rglob("InRelease"))


def test_a_tampered_release_file_is_refused(
    archive: FakeArchive, server: ArchiveServer, cache: Path, keys: tuple[GnuPG, GnuPG, Path]
) -> None:
    in_release = archive.root / "dists/testrel/InRelease"
    in_release.write_bytes(in_release.read_bytes().replace(b"Version: 99.1", b"Version: 99.2"))
    with pytest.raises(ImageError, match="is not signed by a key of .*BAD signature"):
        select(server.mirror_url, cache, keys[2])


def test_an_index_that_does_not_match_the_release_checksum_is_refused(
    archive: FakeArchive, server: ArchiveServer, cache: Path, keys: tuple[GnuPG, GnuPG, Path]
) -> None:
    index = archive.root / "dists/testrel/main/binary-amd64/Packages.xz"
    index.write_bytes(index.read_bytes()[:-8] + b"garbage!")
    with pytest.raises(ImageError) as caught:
        select(server.mirror_url, cache, keys[2])
    message = str(caught.value)
    assert "main/binary-amd64/Packages.xz from" in message
    assert "does not match the checksum in the signed testrel release file" in message
    assert "\n" not in message
    assert not list((cache / "indexes").glob("*")) if (cache / "indexes").exists() else True


def test_a_deb_that_does_not_match_the_index_is_refused_and_not_cached(
    archive: FakeArchive, server: ArchiveServer, cache: Path, keys: tuple[GnuPG, GnuPG, Path]
) -> None:
    deb = archive.path_of("libc6")
    deb.write_bytes(deb.read_bytes().replace(b"2.0\n", b"2.1\n", 1))
    with pytest.raises(ImageError) as caught:
        select(server.mirror_url, cache, keys[2])
    message = str(caught.value)
    assert message.startswith(f"{deb.name} from {server.mirror_url} does not match the signed index")
    assert "use another mirror" in message
    names = cache_files(cache)
    assert not [name for name in names if ".part" in name]
    assert len([name for name in names if name.endswith(".deb")]) < 8  # the bad one is not among them


def test_a_release_the_mirror_does_not_have(
    server: ArchiveServer, cache: Path, keys: tuple[GnuPG, GnuPG, Path]
) -> None:
    with pytest.raises(ImageError) as caught:
        select(server.mirror_url, cache, keys[2], release="bookwurm")
    message = str(caught.value)
    assert f"the Debian mirror {server.mirror_url} (from test) has no release 'bookwurm'" in message
    assert "`release:` field" in message and "\n" not in message
    assert not cache.exists() or not list(cache.rglob("InRelease"))


def test_a_signed_release_of_another_name_is_refused(
    archive: FakeArchive, server: ArchiveServer, cache: Path, keys: tuple[GnuPG, GnuPG, Path]
) -> None:
    archive.publish("testrel", PACKAGES, keys[0], codename="otherrel")
    with pytest.raises(ImageError, match="describes release otherrel .*not testrel"):
        select(server.mirror_url, cache, keys[2])


def test_a_package_the_release_does_not_have(
    server: ArchiveServer, cache: Path, keys: tuple[GnuPG, GnuPG, Path]
) -> None:
    with pytest.raises(ImageError) as caught:
        select(server.mirror_url, cache, keys[2], roots=(*ROOTS, "python3.11-minimal"))
    message = str(caught.value)
    assert f"Debian testrel (main, amd64) on {server.mirror_url} has no package python3.11-minimal" in message
    assert "fix the recipe's packages" in message
    assert not list(cache.glob("*.deb"))


def test_a_mirror_that_does_not_answer(
    cache: Path, keys: tuple[GnuPG, GnuPG, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(archive_module, "ATTEMPTS", 1)
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    with pytest.raises(ImageError) as caught:
        select(f"http://127.0.0.1:{port}/debian", cache, keys[2])
    message = str(caught.value)
    assert message.startswith(f"cannot download from the Debian mirror http://127.0.0.1:{port}/debian (from test)")
    assert "FORKD_DEBIAN_MIRROR" in message and "\n" not in message


def test_a_mirror_that_stays_silent_times_out(
    cache: Path, keys: tuple[GnuPG, GnuPG, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(archive_module, "ATTEMPTS", 1)
    monkeypatch.setattr(archive_module, "TIMEOUT", 0.3)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)  # accepts connections (in the kernel) and never answers
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(ImageError, match="cannot download from the Debian mirror .*timed out"):
            select(url, cache, keys[2])


def test_release_object_fetches_its_index_once(
    server: ArchiveServer, cache: Path, keys: tuple[GnuPG, GnuPG, Path]
) -> None:
    release = Release(Mirror(server.mirror_url, "test"), "testrel", cache, lambda message: None, keyring_path=keys[2])
    assert "libc6" in release.index()
    assert release.verified_release().codename == "testrel"
    assert sum(path.endswith("testrel/InRelease") for path in server.requests) == 1


def test_without_a_signature_verifier_the_error_says_what_to_install(
    server: ArchiveServer, cache: Path, keys: tuple[GnuPG, GnuPG, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(archive_module.shutil, "which", lambda name: None)
    with pytest.raises(ImageError) as caught:
        select(server.mirror_url, cache, keys[2])
    message = str(caught.value)
    assert message.startswith("neither gpgv nor sqv is installed") and "apt-get install gpgv" in message
    assert "not signed" not in message


def test_updates_and_security_suites_bring_newer_packages(
    archive: FakeArchive, server: ArchiveServer, cache: Path, keys: tuple[GnuPG, GnuPG, Path]
) -> None:
    updates = [FakePackage("libc6", version="1.0-1+deb1u1", files={"usr/lib/x86_64-linux-gnu/libc.so.6": b"fixed"})]
    archive.publish("testrel-updates", updates, keys[0])
    security = FakeArchive(archive.root.parent / "debian-security")
    security.publish(
        "testrel-security",
        [
            FakePackage(
                "linux-image-cloud-amd64", version="1.1", depends="linux-image-6.12.9-cloud-amd64 (= 6.12.9-1)"
            ),
            FakePackage(
                "linux-image-6.12.9-cloud-amd64", version="6.12.9-1", files={"boot/vmlinuz-6.12.9-cloud-amd64": b"K2"}
            ),
            FakePackage("libc6", version="1.0-1+deb1u0", files={"usr/lib/x86_64-linux-gnu/libc.so.6": b"older"}),
        ],
        keys[0],
    )
    messages: list[str] = []
    selection = select(server.mirror_url, cache, keys[2], messages=messages, security=f"{server.url}/debian-security")
    assert selection.kernel.name == "linux-image-6.12.9-cloud-amd64"  # the security suite's new kernel
    libc = next(package for package in selection.packages if package.name == "libc6")
    assert libc.version == "1.0-1+deb1u1"  # the newest of release, updates and security
    assert (
        selection.debs["linux-image-6.12.9-cloud-amd64"].read_bytes()
        == security.path_of("linux-image-6.12.9-cloud-amd64").read_bytes()
    )
    assert any("newer packages from testrel-security" in message for message in messages)


def test_a_missing_security_suite_is_skipped_with_a_note(
    server: ArchiveServer, cache: Path, keys: tuple[GnuPG, GnuPG, Path]
) -> None:
    messages: list[str] = []
    selection = select(server.mirror_url, cache, keys[2], messages=messages, security=f"{server.url}/nowhere")
    assert selection.kernel.name == "linux-image-6.12.1-cloud-amd64"
    assert any(message.startswith("no testrel-security suite") for message in messages)
    assert any(message.startswith("no testrel-updates suite") for message in messages)
