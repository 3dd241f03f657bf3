"""Root tree helpers that need no packages: recipe files, module list, env file."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from pytest_forkd.errors import ImageError
from pytest_forkd.image.kernel import KernelParts
from pytest_forkd.image.recipe import FileSpec
from pytest_forkd.image.rootfs import install_modules, install_recipe_files, write_env_file


def test_recipe_file_replaces_an_applet_link_without_touching_busybox(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "busybox").write_bytes(b"BUSYBOX")
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "usr" / "bin" / "awk").symlink_to("/bin/busybox")
    os.symlink(root / "bin" / "busybox", root / "usr" / "bin" / "sed")  # a link that resolves on the host
    script = tmp_path / "tool.sh"
    script.write_text("#!/bin/sh\n")

    install_recipe_files(
        root,
        [FileSpec(script, "/usr/bin/sed", 0o750), FileSpec(script, "/usr/bin/awk"), FileSpec(script, "/opt/new/tool")],
    )
    assert (root / "bin" / "busybox").read_bytes() == b"BUSYBOX"
    assert not (root / "usr" / "bin" / "sed").is_symlink()
    assert (root / "usr" / "bin" / "sed").stat().st_mode & 0o7777 == 0o750
    assert (root / "usr" / "bin" / "awk").read_text() == "#!/bin/sh\n"
    assert (root / "opt" / "new" / "tool").is_file()


def test_recipe_file_onto_a_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "root" / "etc").mkdir(parents=True)
    (tmp_path / "x").write_text("x")
    with pytest.raises(ImageError, match="/etc, which is a directory in the image"):
        install_recipe_files(tmp_path / "root", [FileSpec(tmp_path / "x", "/etc")])


def test_module_order_file_lists_modules_in_load_order(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "lib/modules/forkd").mkdir(parents=True)
    (root / "etc/forkd").mkdir(parents=True)
    modules = []
    for name in ("virtio_ring", "virtio", "virtio_mmio"):
        modules.append(tmp_path / f"{name}.ko")
        modules[-1].write_bytes(name.encode())
    install_modules(root, KernelParts(release="6.1", vmlinuz=tmp_path / "vmlinuz", modules=tuple(modules)))
    assert (root / "etc/forkd/modules").read_text() == "virtio_ring\nvirtio\nvirtio_mmio\n"
    assert (root / "lib/modules/forkd/virtio.ko").read_bytes() == b"virtio"


def test_env_file_survives_shell_metacharacters(tmp_path: Path) -> None:
    env_file = tmp_path / "env"
    tricky = "it's $HOME; `true` \"quoted\"\nsecond line"
    write_env_file(env_file, {"TRICKY": tricky, "PLAIN": "1"})
    shown = subprocess.run(
        ["sh", "-c", '. "$1"; printf %s "$TRICKY"', "sh", str(env_file)], capture_output=True, text=True, check=True
    ).stdout
    assert shown == tricky
