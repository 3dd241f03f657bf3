"""Root tree helpers that need no packages: recipe files, module list, env file."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from pytest_forkd.errors import ImageError
from pytest_forkd.image import rootfs
from pytest_forkd.image.kernel import KernelParts
from pytest_forkd.image.recipe import FileSpec
from pytest_forkd.image.rootfs import (
    PRUNED_PYTHON_LIBRARY,
    install_modules,
    install_recipe_files,
    prune,
    remove_compiled_sources,
    write_env_file,
)


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
    install_modules(
        root,
        KernelParts(
            release="6.1", vmlinuz=tmp_path / "vmlinuz", boot_image=tmp_path / "vmlinuz", modules=tuple(modules)
        ),
    )
    assert (root / "etc/forkd/modules").read_text() == "virtio_ring\nvirtio\nvirtio_mmio\n"
    assert (root / "lib/modules/forkd/virtio.ko").read_bytes() == b"virtio"


def test_env_file_survives_shell_metacharacters(tmp_path: Path) -> None:
    env_file = tmp_path / "env"
    tricky = 'it\'s $HOME; `true` "quoted"\nsecond line'
    write_env_file(env_file, {"TRICKY": tricky, "PLAIN": "1"})
    shown = subprocess.run(
        ["sh", "-c", '. "$1"; printf %s "$TRICKY"', "sh", str(env_file)], capture_output=True, text=True, check=True
    ).stdout
    assert shown == tricky


def touch(root: Path, *names: str) -> None:
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(name)


def test_prune_removes_matching_files_links_and_trees(tmp_path: Path) -> None:
    touch(tmp_path, "usr/share/doc/a/copyright", "etc/python3.11/sitecustomize.py", "etc/keep.conf")
    (tmp_path / "usr/lib").mkdir(parents=True)
    # An absolute link means the guest's file; on the host it dangles.
    (tmp_path / "usr/lib/sitecustomize.py").symlink_to("/no/such/dir/sitecustomize.py")

    prune(tmp_path, ["usr/share/doc", "etc/python3*/sitecustomize.py", "usr/lib/sitecustomize.py", "no/such/path"])

    assert not (tmp_path / "usr/share/doc").exists()
    assert not (tmp_path / "etc/python3.11/sitecustomize.py").exists()
    assert not os.path.lexists(tmp_path / "usr/lib/sitecustomize.py")
    assert (tmp_path / "etc/keep.conf").is_file()


def test_stdlib_pruning_keeps_what_test_suites_and_agents_use(tmp_path: Path) -> None:
    library = tmp_path / "python3.11"
    kept = ["unittest/__init__.py", "doctest.py", "decimal.py", "lib-dynload/_json.cpython-311-x86_64-linux-gnu.so"]
    dropped = [
        "test/support/__init__.py",
        "pydoc_data/topics.py",
        "turtle.py",
        "_pydecimal.py",
        "lib-dynload/_testcapi.cpython-311-x86_64-linux-gnu.so",
        "lib-dynload/_ctypes_test.cpython-311-x86_64-linux-gnu.so",
        "lib-dynload/xxlimited_35.cpython-311-x86_64-linux-gnu.so",
    ]
    touch(library, *kept, *dropped)

    prune(library, PRUNED_PYTHON_LIBRARY)

    assert all((library / name).is_file() for name in kept)
    assert not any((library / name).exists() for name in dropped)
    assert not (library / "test").exists()


def test_compiled_sources_are_removed_and_the_others_kept(tmp_path: Path) -> None:
    touch(tmp_path, "os.py", "os.pyc", "json/__init__.py", "json/__init__.pyc", "broken.py", "data.txt")

    remove_compiled_sources(tmp_path)

    assert sorted(path.relative_to(tmp_path).as_posix() for path in tmp_path.rglob("*") if path.is_file()) == [
        "broken.py",
        "data.txt",
        "json/__init__.pyc",
        "os.pyc",
    ]


@pytest.mark.parametrize("location", ["bin", "usr/bin", "usr/sbin"])
def test_busybox_is_found_wherever_its_package_puts_it(tmp_path: Path, location: str) -> None:
    from pytest_forkd.image.rootfs import find_busybox, make_merged_usr

    root = tmp_path / "root"
    root.mkdir()
    make_merged_usr(root)
    (root / location / "busybox").write_bytes(b"BB")
    found = find_busybox(root)
    assert found.read_bytes() == b"BB"
    assert found.relative_to(root).as_posix().startswith("usr/")  # merged /usr: one place for both layouts


def test_no_busybox_names_the_package(tmp_path: Path) -> None:
    from pytest_forkd.image.rootfs import find_busybox

    with pytest.raises(ImageError, match="keep busybox-static in the recipe's packages"):
        find_busybox(tmp_path)


def test_python3_link_follows_the_release_version(tmp_path: Path) -> None:
    from pytest_forkd.image.rootfs import link_python3

    bin_dir = tmp_path / "usr/bin"
    bin_dir.mkdir(parents=True)
    for name in ("python3.11", "python3.13", "python3.13-config"):
        (bin_dir / name).write_bytes(b"")
    assert link_python3(tmp_path, "3.11").name == "python3.11"
    assert os.readlink(bin_dir / "python3") == "python3.11"
    (bin_dir / "python3").unlink()
    assert link_python3(tmp_path).name == "python3.13"  # no version given: the newest
    with pytest.raises(ImageError, match="no Python interpreter .usr/bin/python3.12.; .*python3-minimal"):
        link_python3(tmp_path, "3.12")


def test_what_the_builder_creates_is_readable_by_every_guest_user(tmp_path: Path) -> None:
    """Under forkd's umask 077 the builder's own files would reach the guest 0600: non-root Python could not start."""
    root = tmp_path / "root"
    (root / "usr/lib/python3.11").mkdir(parents=True)
    packaged_secret = root / "etc/ssl/private"
    packaged_secret.mkdir(parents=True)
    os.chmod(packaged_secret, 0o700)
    os.chmod(root / "etc/ssl", 0o755)
    os.chmod(root / "etc", 0o755)
    packaged = rootfs.tree_paths(root)
    old = os.umask(0o077)
    try:
        (root / "usr/lib/python3.11/__pycache__").mkdir()
        (root / "usr/lib/python3.11/os.pyc").write_bytes(b"compiled")
        (root / "opt/forkd/agent").mkdir(parents=True)
        (root / "opt/forkd/agent/server.py").write_text("pass\n")
        (root / "init").write_text("#!/bin/sh\n")
        os.chmod(root / "init", 0o700)
        (root / "root").mkdir()
        (root / "etc/secret").write_text("kept private\n")
    finally:
        os.umask(old)
    rootfs.open_builder_modes(root, keep=packaged | {"root", "etc/secret"})
    mode = lambda relative: stat.S_IMODE((root / relative).lstat().st_mode)  # noqa: E731
    assert mode("usr/lib/python3.11/os.pyc") == 0o644
    assert mode("usr/lib/python3.11/__pycache__") == 0o755
    assert mode("opt") == mode("opt/forkd") == mode("opt/forkd/agent") == 0o755
    assert mode("opt/forkd/agent/server.py") == 0o644
    assert mode("init") == 0o755
    assert mode("root") == 0o700 and mode("etc/secret") == 0o600  # chosen modes stay
    assert mode("etc/ssl/private") == 0o700  # a package's own mode stays


def test_bash_is_the_static_build_when_the_image_has_it(tmp_path: Path) -> None:
    (tmp_path / "usr/bin").mkdir(parents=True)
    (tmp_path / "usr/bin/bash").write_bytes(b"dynamic")
    (tmp_path / "usr/bin/bash-static").write_bytes(b"static")
    rootfs.use_static_bash(tmp_path)
    assert os.readlink(tmp_path / "usr/bin/bash") == "bash-static"
    assert (tmp_path / "usr/bin/bash").read_bytes() == b"static"


def test_bash_stays_when_there_is_no_static_build(tmp_path: Path) -> None:
    (tmp_path / "usr/bin").mkdir(parents=True)
    (tmp_path / "usr/bin/bash").write_bytes(b"dynamic")
    rootfs.use_static_bash(tmp_path)
    assert (tmp_path / "usr/bin/bash").read_bytes() == b"dynamic" and not (tmp_path / "usr/bin/bash").is_symlink()
