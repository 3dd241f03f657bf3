"""Package resolution against canned apt output, and kernel module load order."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import pytest

from pytest_forkd.errors import ImageError
from pytest_forkd.image import debian
from pytest_forkd.image.kernel import load_order, module_dependencies

# What `apt-cache depends --no-recommends ...` prints for each package.
DEPENDS = {
    "python3.11-minimal": "  PreDepends: libc6\n  Depends: libpython3.11-minimal\n  Depends: zlib1g\n",
    "libpython3.11-minimal": "  Depends: libc6\n  Depends: libssl3\n",
    "libc6": "  Depends: libgcc-s1\n",
    "libgcc-s1": "  Depends: gcc-12-base\n  Depends: libc6\n",
    "gcc-12-base": "",
    "zlib1g": "  Depends: libc6\n",
    "libssl3": "  Depends: libc6\n",
    "libpython3.11-stdlib": (
        "  Depends: libpython3.11-minimal\n |Depends: media-types\n  Depends: mime-support\n"
        "  Depends: libreadline8\n  Depends: <python3:any>\n    python3.11-minimal\n"
    ),
    "media-types": "",
    "mime-support": "  Depends: perl-base\n",
    "perl-base": "",
    "libreadline8": "  Depends: readline-common\n  Depends: libc6\n",
    "readline-common": " |Depends: dpkg\n  Depends: install-info\n",
    "dpkg": "  PreDepends: libc6\n  Depends: tar\n",
    "install-info": "",
    "tar": "",
    "linux-image-cloud-amd64": "  Depends: linux-image-6.1.0-57-cloud-amd64\n",
    "linux-image-6.1.0-57-cloud-amd64": "  Depends: kmod\n  Depends: linux-base\n",
}


@pytest.fixture
def fake_apt(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    calls: list[list[str]] = []

    def run(argv: Sequence[str], *, cwd: Path | None = None, what: str) -> str:
        calls.append(list(argv))
        assert argv[:2] == ["apt-cache", "depends"]
        names = [arg for arg in argv[2:] if not arg.startswith("--")]
        return "".join(f"{name}\n{DEPENDS[name]}" for name in names)

    monkeypatch.setattr(debian, "_run", run)
    return calls


def test_closure_follows_dependencies_and_virtual_providers(fake_apt: list[list[str]]) -> None:
    closure = debian.dependency_closure(["python3.11-minimal", "libpython3.11-stdlib"], [])
    assert closure[:2] == ["python3.11-minimal", "libpython3.11-stdlib"]
    assert set(closure) == {
        "python3.11-minimal", "libpython3.11-stdlib", "libc6", "libpython3.11-minimal", "zlib1g",
        "libssl3", "libgcc-s1", "gcc-12-base", "media-types", "libreadline8", "readline-common",
        "dpkg", "tar",
    }
    # One apt-cache call per level of the graph, not one per package.
    assert len(fake_apt) <= 5


def test_exclusion_drops_what_only_the_excluded_package_needed(fake_apt: list[list[str]]) -> None:
    closure = debian.dependency_closure(
        ["python3.11-minimal", "libpython3.11-stdlib"], ["readline-common", "gcc-12-base"]
    )
    assert "readline-common" not in closure
    assert "gcc-12-base" not in closure
    assert "dpkg" not in closure and "tar" not in closure and "install-info" not in closure
    assert "libreadline8" in closure


def test_excluded_first_alternative_falls_back_to_the_next(fake_apt: list[list[str]]) -> None:
    closure = debian.dependency_closure(["libpython3.11-stdlib"], ["media-types", "readline-common"])
    assert "media-types" not in closure
    assert "mime-support" in closure and "perl-base" in closure


def test_roots_are_kept_even_when_excluded(fake_apt: list[list[str]]) -> None:
    assert "dpkg" in debian.dependency_closure(["dpkg"], ["dpkg"])


def test_kernel_metapackage_resolves_to_the_concrete_package(fake_apt: list[list[str]]) -> None:
    assert debian.resolve_kernel_package("linux-image-cloud-amd64") == "linux-image-6.1.0-57-cloud-amd64"
    assert debian.resolve_kernel_package("linux-image-6.1.0-57-cloud-amd64") == "linux-image-6.1.0-57-cloud-amd64"


def test_deb_file_name_encodes_the_epoch_like_apt_get_download() -> None:
    package = debian.DebPackage("busybox-static", "1:1.35.0-4+deb12u1+b1", "amd64", 928188)
    assert package.filename == "busybox-static_1%3a1.35.0-4+deb12u1+b1_amd64.deb"


def test_unknown_packages_tell_the_user_to_update_apt_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    class Completed:
        stdout = "Package: zlib1g\nVersion: 1:1.2.13.dfsg-1\nArchitecture: amd64\nSize: 87000\n\n"

    monkeypatch.setattr(debian.subprocess, "run", lambda *args, **kwargs: Completed())
    found = debian.candidates(["zlib1g"])
    assert found["zlib1g"].version == "1:1.2.13.dfsg-1" and found["zlib1g"].size == 87000
    with pytest.raises(ImageError, match=r"no installable version of no-such-pkg .*run `apt-get update`"):
        debian.candidates(["zlib1g", "no-such-pkg"])


def fake_module(directory: Path, name: str, depends: str) -> Path:
    path = directory / f"{name}.ko"
    path.write_bytes(b"\x7fELF....\0license=GPL\0depends=" + depends.encode() + b"\0vermagic=6.1\0")
    return path


def test_modules_are_ordered_after_their_dependencies(tmp_path: Path) -> None:
    modules = {
        "virtio_console": fake_module(tmp_path, "virtio_console", "virtio,virtio_ring"),
        "virtio_mmio": fake_module(tmp_path, "virtio_mmio", "virtio,virtio_ring"),
        "virtio": fake_module(tmp_path, "virtio", "virtio_ring"),
        "virtio_ring": fake_module(tmp_path, "virtio_ring", ""),
    }
    assert module_dependencies(modules["virtio_mmio"]) == ["virtio", "virtio_ring"]
    order = [path.stem for path in load_order(modules)]
    assert order.index("virtio_ring") < order.index("virtio") < order.index("virtio_mmio")
    assert order.index("virtio") < order.index("virtio_console")


def test_a_missing_module_dependency_is_reported(tmp_path: Path) -> None:
    modules = {"virtio_net": fake_module(tmp_path, "virtio_net", "virtio,net_failover"),
               "virtio": fake_module(tmp_path, "virtio", "")}
    with pytest.raises(ImageError, match="virtio_net needs net_failover"):
        load_order(modules)
