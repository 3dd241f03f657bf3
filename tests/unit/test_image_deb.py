"""Reading .deb files in Python: every data.tar compression, merged /usr, no writes outside the root."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from fake_debian import make_deb

from pytest_forkd.errors import ImageError
from pytest_forkd.image.deb import data_tar, resolve_in_root, unpack
from pytest_forkd.image.rootfs import make_merged_usr

FILES = {"usr/": b"", "usr/bin/": b"", "usr/bin/tool": b"#!/bin/sh\necho tool\n", "etc/tool.conf": "x=1\n"}


@pytest.mark.parametrize(
    "compression",
    ["xz", "gz", "", pytest.param("zst", marks=pytest.mark.skipif(shutil.which("zstd") is None, reason="needs zstd"))],
)
def test_unpacks_each_compression(tmp_path: Path, compression: str) -> None:
    deb = tmp_path / "tool.deb"
    deb.write_bytes(make_deb(FILES, compression=compression, symlinks={"usr/bin/tool2": "tool"}))
    root = tmp_path / "root"
    root.mkdir()
    unpack(deb, root)
    assert (root / "usr/bin/tool").read_bytes() == b"#!/bin/sh\necho tool\n"
    assert os.access(root / "usr/bin/tool", os.X_OK)
    assert os.readlink(root / "usr/bin/tool2") == "tool"
    assert (root / "etc/tool.conf").read_text() == "x=1\n"
    with data_tar(deb) as archive:
        assert "./usr/bin/tool" in [member.name for member in archive]


def test_debian_12_paths_land_in_a_merged_usr(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    make_merged_usr(root)
    deb = tmp_path / "libc.deb"
    deb.write_bytes(
        make_deb(
            {
                "lib/": b"",
                "lib/x86_64-linux-gnu/": b"",
                "lib/x86_64-linux-gnu/libc.so.6": b"ELF",
                "bin/": b"",
                "bin/busybox": b"BB",
                "lib64/": b"",
            },
            symlinks={"lib64/ld-linux-x86-64.so.2": "/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"},
        )
    )
    unpack(deb, root)
    assert os.readlink(root / "lib") == "usr/lib" and os.readlink(root / "bin") == "usr/bin"
    assert (root / "usr/lib/x86_64-linux-gnu/libc.so.6").read_bytes() == b"ELF"
    assert (root / "usr/bin/busybox").read_bytes() == b"BB"
    assert os.readlink(root / "usr/lib64/ld-linux-x86-64.so.2") == "/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"


def test_absolute_links_are_followed_inside_the_root_only(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    (root / "usr/share").mkdir(parents=True)
    # A package's absolute link to a directory: on the host it would point at the host's /etc.
    (root / "usr/share/conf").symlink_to("/etc")
    assert resolve_in_root(root, "usr/share/conf/x") == root / "etc" / "x"
    (root / "up").symlink_to("../../../..")
    assert resolve_in_root(root, "up/etc/x") == root / "etc" / "x"
    deb = tmp_path / "evil.deb"
    deb.write_bytes(make_deb({"usr/share/conf/evil": "owned"}))
    unpack(deb, root)
    assert (root / "etc/evil").read_text() == "owned"
    assert not Path("/etc/evil").exists()


def test_member_paths_with_dotdot_are_refused(tmp_path: Path) -> None:
    deb = tmp_path / "evil.deb"
    deb.write_bytes(make_deb({"usr/../../escape": "x"}))
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(ImageError, match="points outside the root; refusing it"):
        unpack(deb, root)
    assert not (tmp_path / "escape").exists()


def test_a_file_that_is_not_a_deb_says_to_delete_it(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.deb"
    bogus.write_bytes(b"<html>not found</html>")
    with pytest.raises(ImageError, match="bogus.deb is not a Debian package .*delete it"):
        unpack(bogus, tmp_path)
    truncated = tmp_path / "truncated.deb"
    truncated.write_bytes(make_deb(FILES)[:70])
    with pytest.raises(ImageError, match="truncated or corrupt|no data.tar"):
        unpack(truncated, tmp_path)


def test_zstd_without_the_program_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if shutil.which("zstd") is None:
        pytest.skip("needs zstd to make the package")
    deb = tmp_path / "z.deb"
    deb.write_bytes(make_deb(FILES, compression="zst"))
    monkeypatch.setattr("pytest_forkd.image.deb.shutil.which", lambda name: None)
    with pytest.raises(ImageError, match="compressed with zstd and the zstd program is not installed; install it"):
        unpack(deb, tmp_path)


def test_a_package_shipping_the_merged_usr_links_itself(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    make_merged_usr(root)
    (root / "usr/sbin/real").mkdir()
    deb = tmp_path / "base-files.deb"
    deb.write_bytes(
        make_deb({"usr/bin/": b""}, symlinks={"bin": "usr/bin", "lib64": "usr/lib64", "usr/sbin/real": "x"})
    )
    unpack(deb, root)
    assert os.readlink(root / "bin") == "usr/bin" and os.readlink(root / "lib64") == "usr/lib64"
    assert (root / "usr/sbin/real").is_dir() and not (root / "usr/sbin/real").is_symlink()
