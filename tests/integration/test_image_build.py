"""Real images: the default image's content, and booting images under QEMU to run Python in them.

These build from the host's Debian packages (downloaded once, then cached)
and boot QEMU directly with the machine arguments of DESIGN.md section 3, so
they check the image and its /init independently of the engine.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from pytest_forkd import paths
from pytest_forkd.engine.host import tsc_khz
from pytest_forkd.guest.client import AgentClient
from pytest_forkd.image import Image, build_image, ensure_image

pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="needs qemu-system-x86_64"),
    pytest.mark.skipif(shutil.which("apt-get") is None, reason="images are built from Debian packages"),
]

BOOT_TIMEOUT = 60.0


@pytest.fixture(scope="module")
def default_image() -> Image:
    return ensure_image()


def archive_names(path: Path) -> set[str]:
    listing = subprocess.run(["cpio", "-t", "--quiet"], stdin=path.open("rb"), capture_output=True, check=True)
    return set(listing.stdout.decode().split())


@pytest.mark.skipif(shutil.which("cpio") is None, reason="needs GNU cpio to list the archive")
def test_default_image_contains_init_agent_python_and_modules(default_image: Image) -> None:
    names = archive_names(default_image.initrd)
    assert {"init", "bin/sh", "bin/busybox", "sbin/insmod", "dev/console"} <= names
    assert {"opt/forkd/agent.py", "opt/forkd/wire.py", "usr/bin/python3", "usr/bin/python3.11"} <= names
    assert {
        f"lib/modules/forkd/{module}.ko" for module in ("virtio_ring", "virtio", "virtio_mmio", "virtio_console")
    } <= names
    assert "usr/lib/python3.11/json/__init__.pyc" in names
    assert not any(name.startswith(("usr/share/doc/", "usr/share/man/")) for name in names)
    assert not any(name.startswith("lib/modules/") and "/kernel/" in name for name in names)
    assert default_image.stub_kernel.stat().st_size == 64 * 1024
    assert default_image.stub_initrd.stat().st_size == 4096
    manifest = default_image.manifest
    assert manifest["key"] == default_image.key
    assert "python3.11-minimal" in manifest["packages"]
    assert "perl-base" not in manifest["packages"]


@contextmanager
def booted(image: Image, tmp_path: Path) -> Iterator[tuple[AgentClient, Path]]:
    """Boot ``image`` with the console in a file; yield an agent client and the console log."""
    agent_socket = tmp_path / "agent.sock"
    console = tmp_path / "console.log"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(agent_socket))
    listener.listen(1)
    listener.settimeout(BOOT_TIMEOUT)
    append = " ".join(
        ["console=ttyS0", "quiet", "panic=-1", f"tsc_early_khz={tsc_khz()}", "tsc=reliable", *image.kernel_args]
    )
    qemu = subprocess.Popen(
        [
            "qemu-system-x86_64", "-M", "microvm", "-accel", "tcg", "-cpu", "max", "-smp", "1", "-m", "256M",
            "-kernel", str(image.kernel), "-initrd", str(image.initrd), "-append", append,
            "-display", "none", "-no-reboot", "-nodefaults", "-no-user-config", "-serial", f"file:{console}",
            "-device", "virtio-serial-device",
            "-chardev", f"socket,id=agent,path={agent_socket},server=off",
            "-device", "virtserialport,chardev=agent,name=agent",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    client = None
    try:
        connection, _ = listener.accept()
        client = AgentClient(connection)
        client.ping(timeout=BOOT_TIMEOUT)
        yield client, console
    finally:
        if client is not None:
            client.close()
        listener.close()
        qemu.kill()
        qemu.communicate()


def test_default_image_boots_and_runs_python(default_image: Image, tmp_path: Path) -> None:
    with booted(default_image, tmp_path) as (client, console):
        result = client.exec(
            ["python3", "-c", "import json, subprocess, socket, hashlib, ssl; print(json.dumps([42]))"],
            timeout=60,
        )
        assert (result.exit_code, result.stdout, result.stderr) == (0, "[42]\n", "")
        environment = client.exec("echo $HOME $LANG; hostname; cat /sys/class/virtio-ports/*/name", timeout=30)
        assert environment.stdout.split() == ["/root", "C.UTF-8", "forkd", "agent"]
        assert "forkd-agent: starting on /dev/vport" in console.read_text()


def test_recipe_files_env_and_kernel_args_reach_the_guest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared_debs = paths.debs_dir()  # reuse the downloaded packages, keep the images separate
    monkeypatch.setenv("FORKD_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "debs").symlink_to(shared_debs)
    (tmp_path / "hello.py").write_text("import os\nprint('hello', os.environ['GREETING'])\n")
    recipe = tmp_path / "hello.yaml"
    recipe.write_text(
        "files:\n  - {src: hello.py, dest: /usr/local/bin/hello, mode: '0755'}\n"
        "kernel_args: [forkd.test=1]\n"
        "env: {GREETING: from-recipe}\n"
    )
    image = build_image(recipe, progress=lambda message: None)
    assert image.name == "hello" and image.kernel_args[-1] == "forkd.test=1"

    with booted(image, tmp_path) as (client, _console):
        result = client.exec("python3 /usr/local/bin/hello; stat -c %a /usr/local/bin/hello; cat /proc/cmdline", timeout=60)
        lines = result.stdout.splitlines()
        assert lines[0] == "hello from-recipe"
        assert lines[1] == "755"
        assert "forkd.test=1" in lines[2].split()
