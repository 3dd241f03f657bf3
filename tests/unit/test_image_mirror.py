"""Which mirror the builder uses: the environment, forkd.yaml, then the host's apt sources."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_forkd.errors import ImageError
from pytest_forkd.image import mirror
from pytest_forkd.image.mirror import MIRROR_ENV, find_mirror, host_apt_mirror, use_project_mirror


@pytest.fixture(autouse=True)
def no_configured_mirror(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(MIRROR_ENV, raising=False)
    use_project_mirror(None)
    yield
    use_project_mirror(None)


def apt_root(tmp_path: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = tmp_path / "etc/apt" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


DEB822 = """\
Types: deb
URIs: http://192.0.2.7/debian-security
Suites: bookworm-security
Components: main

Types: deb deb-src
# a comment inside a stanza
URIs: http://192.0.2.7/debian/
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""


def test_deb822_sources_give_the_archive_not_the_security_one(tmp_path: Path) -> None:
    found = host_apt_mirror(apt_root(tmp_path, {"sources.list.d/debian.sources": DEB822}))
    assert found is not None
    assert found.url == "http://192.0.2.7/debian"
    assert "debian.sources" in found.origin


def test_one_line_sources_with_options_and_comments(tmp_path: Path) -> None:
    root = apt_root(
        tmp_path,
        {
            "sources.list": (
                "# deb http://192.0.2.1/old bookworm main\n"
                "deb cdrom:[Debian 12]/ bookworm main\n"
                "deb [arch=amd64 signed-by=/k.gpg] https://192.0.2.2/debian trixie main  # trailing\n"
            )
        },
    )
    found = host_apt_mirror(root)
    assert found is not None and found.url == "https://192.0.2.2/debian"


def test_disabled_stanzas_and_other_files_are_skipped(tmp_path: Path) -> None:
    root = apt_root(
        tmp_path,
        {
            "sources.list.d/a.sources": "Enabled: no\nTypes: deb\nURIs: http://192.0.2.3/debian\nSuites: trixie\n",
            "sources.list.d/b.list.disabled": "deb http://192.0.2.4/debian trixie main\n",
            "sources.list.d/c.list": "deb http://192.0.2.5/debian trixie main\n",
        },
    )
    found = host_apt_mirror(root)
    assert found is not None and found.url == "http://192.0.2.5/debian"


def test_a_host_without_apt_sources_has_no_mirror(tmp_path: Path) -> None:
    assert host_apt_mirror(tmp_path) is None


def test_environment_beats_forkd_yaml_which_beats_apt_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = apt_root(tmp_path, {"sources.list.d/debian.sources": DEB822})
    assert find_mirror(apt_root=root).url == "http://192.0.2.7/debian"
    use_project_mirror("http://192.0.2.8/debian/")
    found = find_mirror(apt_root=root)
    assert (found.url, found.origin) == ("http://192.0.2.8/debian", "forkd.yaml settings.debian_mirror")
    monkeypatch.setenv(MIRROR_ENV, "http://192.0.2.9/debian")
    found = find_mirror(apt_root=root)
    assert (found.url, found.origin) == ("http://192.0.2.9/debian", MIRROR_ENV)
    assert find_mirror("file:///srv/debian", apt_root=root).url == "file:///srv/debian"


def test_no_mirror_anywhere_says_how_to_set_one(tmp_path: Path) -> None:
    with pytest.raises(ImageError) as caught:
        find_mirror(apt_root=tmp_path)
    message = str(caught.value)
    assert "\n" not in message
    assert f"set {MIRROR_ENV}=" in message and "debian_mirror:" in message and "forkd.yaml" in message


def test_a_mirror_that_is_not_a_url_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MIRROR_ENV, "192.0.2.9/debian")
    with pytest.raises(ImageError, match=f"{MIRROR_ENV}: '192.0.2.9/debian' is not a mirror URL"):
        find_mirror()


def test_a_missing_keyring_names_the_package_and_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(mirror.KEYRING_ENV, str(tmp_path / "none.gpg"))
    with pytest.raises(ImageError, match="install debian-archive-keyring .* or set FORKD_DEBIAN_KEYRING"):
        mirror.keyring()


def test_no_mirror_host_name_is_written_into_the_code() -> None:
    source_dir = Path(mirror.__file__).parent
    for path in source_dir.glob("*.py"):
        text = path.read_text()
        assert "debian.org" not in text and "ubuntu.com" not in text, path.name


def test_security_updates_come_from_the_environment_apt_sources_or_next_to_the_mirror(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pytest_forkd.image.mirror import SECURITY_MIRROR_ENV, Mirror, find_security_mirror

    monkeypatch.delenv(SECURITY_MIRROR_ENV, raising=False)
    main = Mirror("http://192.0.2.7/debian", "test")
    root = apt_root(tmp_path / "a", {"sources.list.d/debian.sources": DEB822})
    assert find_security_mirror(main, apt_root=root).url == "http://192.0.2.7/debian-security"
    found = find_security_mirror(Mirror("http://192.0.2.20/mirror/debian", "test"), apt_root=tmp_path / "none")
    assert found is not None and (found.url, found.origin) == (
        "http://192.0.2.20/mirror/debian-security",
        "next to http://192.0.2.20/mirror/debian",
    )
    assert find_security_mirror(Mirror("http://192.0.2.21", "test"), apt_root=tmp_path / "none") is None
    monkeypatch.setenv(SECURITY_MIRROR_ENV, "http://192.0.2.22/sec")
    assert find_security_mirror(main, apt_root=root).url == "http://192.0.2.22/sec"
    monkeypatch.setenv(SECURITY_MIRROR_ENV, "none")
    assert find_security_mirror(main, apt_root=root) is None
