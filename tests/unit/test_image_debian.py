"""The kernel package's parts: both Debian layouts, compressed and built-in modules, load order."""

from __future__ import annotations

import lzma
import shutil
import subprocess
from pathlib import Path

import pytest
from fake_debian import make_deb

from pytest_forkd.errors import ImageError
from pytest_forkd.image.kernel import GUEST_MODULES, builtin_modules, extract_kernel, load_order, module_dependencies


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
    modules = {
        "virtio_net": fake_module(tmp_path, "virtio_net", "virtio,net_failover"),
        "virtio": fake_module(tmp_path, "virtio", ""),
    }
    with pytest.raises(ImageError, match="virtio_net needs net_failover"):
        load_order(modules)


def module_bytes(name: str, depends: str) -> bytes:
    return b"\x7fELF....\0license=GPL\0name=" + name.encode() + b"\0depends=" + depends.encode() + b"\0vermagic=6\0"


DEPENDS = {
    "virtio_ring": "",
    "virtio": "virtio_ring",
    "virtio_mmio": "virtio,virtio_ring",
    "virtio_console": "virtio,virtio_ring",
}


def test_debian_12_layout_plain_modules_under_lib(tmp_path: Path) -> None:
    release = "6.1.0-50-cloud-amd64"
    files: dict[str, bytes | str] = {f"boot/vmlinuz-{release}": b"not a bzImage"}
    for name in GUEST_MODULES:
        directory = "char" if name == "virtio_console" else "virtio"
        files[f"lib/modules/{release}/kernel/drivers/{directory}/{name}.ko"] = module_bytes(name, DEPENDS[name])
    files[f"lib/modules/{release}/kernel/drivers/net/virtio_net.ko"] = module_bytes("virtio_net", "virtio")
    deb = tmp_path / "kernel.deb"
    deb.write_bytes(make_deb(files))
    parts = extract_kernel(deb, tmp_path / "out")
    assert parts.release == release and parts.builtin == ()
    assert parts.boot_image == parts.vmlinuz  # no PVH kernel inside: booted as it is
    order = [path.stem for path in parts.modules]
    assert sorted(order) == sorted(GUEST_MODULES)
    assert order.index("virtio_ring") < order.index("virtio") < order.index("virtio_mmio")


@pytest.mark.parametrize(
    "compression",
    ["xz", pytest.param("zst", marks=pytest.mark.skipif(shutil.which("zstd") is None, reason="needs zstd"))],
)
def test_debian_13_layout_compressed_and_builtin_modules_under_usr_lib(tmp_path: Path, compression: str) -> None:
    release = "6.12.1+deb13-cloud-amd64"
    plain = module_bytes("virtio_mmio", "")
    if compression == "xz":
        packed = lzma.compress(plain, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC32)
    else:
        packed = subprocess.run(["zstd", "-q", "-c"], input=plain, capture_output=True, check=True).stdout
    files: dict[str, bytes | str] = {
        f"boot/vmlinuz-{release}": b"not a bzImage",
        f"usr/lib/modules/{release}/kernel/drivers/virtio/virtio_mmio.ko.{compression}": packed,
        f"usr/lib/modules/{release}/modules.builtin": (
            "kernel/drivers/virtio/virtio.ko\nkernel/drivers/virtio/virtio_ring.ko\n"
            "kernel/drivers/char/virtio_console.ko\nkernel/fs/ext4/ext4.ko\n"
        ),
    }
    deb = tmp_path / "kernel.deb"
    deb.write_bytes(make_deb(files))
    parts = extract_kernel(deb, tmp_path / "out")
    assert [path.name for path in parts.modules] == ["virtio_mmio.ko"]
    assert parts.modules[0].read_bytes() == plain  # decompressed: busybox insmod loads plain ELF only
    assert set(parts.builtin) == {"virtio", "virtio_ring", "virtio_console"}


def test_a_kernel_without_the_guest_modules_is_refused(tmp_path: Path) -> None:
    deb = tmp_path / "kernel.deb"
    deb.write_bytes(
        make_deb(
            {
                "boot/vmlinuz-6.1.0-1-amd64": b"K",
                "lib/modules/6.1.0-1-amd64/modules.builtin": "kernel/drivers/virtio/virtio.ko\n",
            }
        )
    )
    with pytest.raises(ImageError, match="has no module.s. virtio_ring, virtio_mmio, virtio_console .neither"):
        extract_kernel(deb, tmp_path / "out")


def test_builtin_list_names_use_underscores() -> None:
    assert builtin_modules("kernel/drivers/virtio/virtio-mmio.ko\n\nkernel/a/b.ko\n") == {"virtio_mmio", "b"}


def test_builtin_dependencies_need_no_loading(tmp_path: Path) -> None:
    modules = {"virtio_mmio": fake_module(tmp_path, "virtio_mmio", "virtio,virtio_ring")}
    assert [path.stem for path in load_order(modules, {"virtio", "virtio_ring"})] == ["virtio_mmio"]


def test_an_extracted_kernel_is_reused_by_later_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_forkd.image import kernel

    release = "6.1.0-50-cloud-amd64"
    files: dict[str, bytes | str] = {f"boot/vmlinuz-{release}": b"not a bzImage"}
    for name in GUEST_MODULES:
        files[f"lib/modules/{release}/kernel/drivers/virtio/{name}.ko"] = module_bytes(name, DEPENDS[name])
    deb = tmp_path / f"{'ab' * 32}.deb"
    deb.write_bytes(make_deb(files))
    cache = tmp_path / "kernels"
    first = kernel.cached_kernel(deb, cache)
    assert first.release == release and len(first.modules) == 4
    assert first.boot_image.read_bytes() == b"not a bzImage"
    assert [path.name for path in cache.iterdir()] == [first.vmlinuz.parent.name]  # no scratch left behind

    def no_second_extraction(*args: object, **kwargs: object) -> None:
        raise AssertionError("the kernel package was read again")

    monkeypatch.setattr(kernel, "extract_kernel", no_second_extraction)
    again = kernel.cached_kernel(deb, cache)
    assert again == first


def _kernel_with_network(tmp_path: Path, network: dict[str, tuple[str, str]]) -> list[str]:
    """Module load order extracted from a Debian 12 style package with the given network modules."""
    from pytest_forkd.image.kernel import NETWORK_MODULES

    release = "6.1.0-50-cloud-amd64"
    files: dict[str, bytes | str] = {f"boot/vmlinuz-{release}": b"not a bzImage"}
    for name in GUEST_MODULES:
        files[f"lib/modules/{release}/kernel/drivers/virtio/{name}.ko"] = module_bytes(name, DEPENDS[name])
    for name, (where, depends) in network.items():
        files[f"lib/modules/{release}/kernel/{where}/{name}.ko"] = module_bytes(name, depends)
    deb = tmp_path / "kernel.deb"
    deb.write_bytes(make_deb(files))
    parts = extract_kernel(deb, tmp_path / "out", optional=NETWORK_MODULES)
    return [path.stem for path in parts.modules]


def test_network_modules_are_taken_when_present_dependencies_first(tmp_path: Path) -> None:
    order = _kernel_with_network(
        tmp_path,
        {
            "failover": ("net/core", ""),
            "net_failover": ("drivers/net", "failover"),
            "virtio_net": ("drivers/net", "virtio,virtio_ring,net_failover"),
        },
    )
    assert order.index("failover") < order.index("net_failover") < order.index("virtio_net")
    assert order.index("virtio") < order.index("virtio_net")


def test_network_modules_are_optional(tmp_path: Path) -> None:
    order = _kernel_with_network(tmp_path, {"virtio_net": ("drivers/net", "virtio,net_failover")})
    assert "virtio_net" not in order  # its dependency is missing: left out, the image still builds
    assert sorted(order) == sorted(GUEST_MODULES)
