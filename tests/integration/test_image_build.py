"""Real images: the default image's content, and booting images under QEMU to run Python in them.

These build from a pinned Debian release read from the configured mirror
(indexes and packages downloaded once, then cached) and boot QEMU directly
with the machine arguments of DESIGN.md section 3 and the engine's TCG CPU
model, so they check the image and its /init independently of the engine.
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
from pytest_forkd.engine.qemu.host import tsc_khz
from pytest_forkd.engine.qemu.machine import cpu_model
from pytest_forkd.guest import agent_files
from pytest_forkd.guest.client import AgentClient
from pytest_forkd.image import Image, build_image, ensure_image

pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="needs qemu-system-x86_64"),
    pytest.mark.skipif(
        shutil.which("gpgv") is None and shutil.which("sqv") is None,
        reason="checking Debian's signatures needs gpgv or sqv",
    ),
]

BOOT_TIMEOUT = 60.0


@pytest.fixture(scope="module")
def default_image() -> Image:
    return ensure_image()


def archive_names(path: Path) -> set[str]:
    """Entry names of a newc cpio archive (the initramfs format), read without the cpio program."""
    names = set()
    data = path.read_bytes()
    position = 0
    while True:
        header = data[position : position + 110]
        assert header[:6] == b"070701", f"bad cpio header at {position}"
        size, name_size = int(header[54:62], 16), int(header[94:102], 16)
        name = data[position + 110 : position + 110 + name_size - 1].decode()
        if name == "TRAILER!!!":
            return names
        names.add(name)
        position += 110 + name_size
        position += -position % 4
        position += size + (-size % 4)


def test_default_image_contains_init_agent_python_and_modules(default_image: Image) -> None:
    names = archive_names(default_image.initrd)
    # merged /usr: /bin, /sbin, /lib and /lib64 are links into /usr whatever the release's layout
    assert {"init", "bin", "lib", "usr/bin/sh", "usr/bin/busybox", "usr/sbin/insmod", "dev/console"} <= names
    assert {"opt/forkd/agent/__init__.py", "opt/forkd/wire.py", "usr/bin/python3", "usr/bin/python3.11"} <= names
    assert {f"opt/forkd/{name}" for name in agent_files()} <= names, "the image lacks part of the agent package"
    assert "opt/forkd/agent/__pycache__/server.cpython-311.pyc" in names, "the agent package is not byte-compiled"
    assert {
        f"usr/lib/modules/forkd/{module}.ko" for module in ("virtio_ring", "virtio", "virtio_mmio", "virtio_console")
    } <= names
    assert "usr/lib/python3.11/json/__init__.pyc" in names
    assert not any(name.startswith(("usr/share/doc/", "usr/share/man/")) for name in names)
    assert not any("/modules/" in name and "/kernel/" in name for name in names)
    assert default_image.stub_kernel.stat().st_size == 64 * 1024
    assert default_image.stub_initrd.stat().st_size == 4096
    manifest = default_image.manifest
    assert manifest["key"] == default_image.key
    assert manifest["debian"]["release"] == "bookworm" and manifest["python"] == "3.11"
    assert "python3.11-minimal" in manifest["packages"]  # found through python3-minimal, not named by the recipe
    assert "perl-base" not in manifest["packages"]


@contextmanager
def booted(
    image: Image, tmp_path: Path, cpu: str = cpu_model("tcg"), kernel: Path | None = None
) -> Iterator[tuple[AgentClient, Path]]:
    """Boot ``image`` (its ``kernel``, or the one given) with the console in a file; yield an agent client and the log."""
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
            "qemu-system-x86_64",
            "-M",
            "microvm",
            "-accel",
            "tcg",
            "-cpu",
            cpu,
            "-smp",
            "1",
            "-m",
            "256M",
            "-kernel",
            str(kernel or image.kernel),
            "-initrd",
            str(image.initrd),
            "-append",
            append,
            "-display",
            "none",
            "-no-reboot",
            "-nodefaults",
            "-no-user-config",
            "-serial",
            f"file:{console}",
            "-device",
            "virtio-serial-device",
            "-chardev",
            f"socket,id=agent,path={agent_socket},server=off",
            "-device",
            "virtserialport,chardev=agent,name=agent",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    client = None
    try:
        try:
            connection, _ = listener.accept()
            client = AgentClient(connection)
            client.ping(timeout=BOOT_TIMEOUT)
        except Exception as exc:
            qemu.kill()
            _, stderr = qemu.communicate()
            tail = console.read_text(errors="replace").splitlines()[-15:] if console.exists() else []
            raise AssertionError(
                f"{image.name} did not boot ({exc}); QEMU exit {qemu.returncode}: {stderr.decode(errors='replace')}"
                + "\nconsole:\n"
                + "\n".join(tail)
            ) from exc
        yield client, console
    finally:
        if client is not None:
            client.close()
        listener.close()
        if qemu.returncode is None:
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


def test_default_image_keeps_a_bzimage_that_boots(default_image: Image, tmp_path: Path) -> None:
    # The PVH kernel hangs on QEMU 10; the bzImage next to it is what QEMU 8 and later boot.
    assert default_image.manifest["kernel"]["entry"] == "pvh"
    assert default_image.bzimage is not None and default_image.bzimage.read_bytes()[0x202:0x206] == b"HdrS"
    with booted(default_image, tmp_path, kernel=default_image.bzimage) as (client, _console):
        result = client.exec(["python3", "-c", "print(6 * 7)"], timeout=60)
        assert (result.exit_code, result.stdout) == (0, "42\n")


def test_recipe_files_env_and_kernel_args_reach_the_guest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
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
        result = client.exec(
            "python3 /usr/local/bin/hello; stat -c %a /usr/local/bin/hello; cat /proc/cmdline", timeout=60
        )
        lines = result.stdout.splitlines()
        assert lines[0] == "hello from-recipe"
        assert lines[1] == "755"
        assert "forkd.test=1" in lines[2].split()


@pytest.fixture(scope="module")
def trixie_image(tmp_path_factory: pytest.TempPathFactory) -> Image:
    """Debian 13 from a recipe that names only its release: Python 3.13, merged /usr, .ko.xz and built-in virtio."""
    recipe = tmp_path_factory.mktemp("trixie") / "trixie.yaml"
    recipe.write_text("name: forkd-test-trixie\nrelease: trixie\n")
    return build_image(recipe, progress=lambda message: None)


def test_trixie_image_has_its_own_python_and_kernel_layout(trixie_image: Image) -> None:
    manifest = trixie_image.manifest
    assert manifest["debian"]["release"] == "trixie" and manifest["python"] == "3.13"
    assert "python3.13-minimal" in manifest["packages"] and "python3.11-minimal" not in manifest["packages"]
    kernel = manifest["kernel"]
    assert sorted([*kernel["modules"], *kernel["builtin"]]) == sorted(
        ("virtio_ring", "virtio", "virtio_mmio", "virtio_console", "failover", "net_failover", "virtio_net")
        + ("virtio_blk", "overlay")  # a container image's disk and its overlay root
    )
    assert kernel["builtin"], "Debian 13's cloud kernel builds some virtio drivers in"


def test_trixie_image_boots_and_runs_python(trixie_image: Image, tmp_path: Path) -> None:
    with booted(trixie_image, tmp_path) as (client, console):
        result = client.exec(
            ["python3", "-c", "import sys, json, ssl, sqlite3; print(json.dumps(sys.version_info[:2]))"], timeout=60
        )
        assert (result.exit_code, result.stdout, result.stderr) == (0, "[3, 13]\n", "")
        release = client.exec("uname -r; cat /sys/class/virtio-ports/*/name", timeout=30)
        kernel_release, port = release.stdout.split()
        assert kernel_release == trixie_image.manifest["kernel"]["release"] and port == "agent"
        assert "forkd-agent: starting on /dev/vport" in console.read_text()


def test_an_image_builds_without_apt_or_dpkg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a signature verifier is needed from the host: no apt-get, apt lists or dpkg-deb on PATH."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("gpgv", "sqv"):
        if shutil.which(tool):
            (tools / tool).symlink_to(shutil.which(tool))
    shared_debs = paths.debs_dir()  # reuse downloaded packages and the verified indexes
    monkeypatch.setenv("FORKD_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "debs").symlink_to(shared_debs)
    monkeypatch.setenv("PATH", str(tools))
    recipe = tmp_path / "noapt.yaml"
    recipe.write_text("env: {BUILT_WITHOUT: apt}\n")
    messages: list[str] = []
    image = build_image(recipe, progress=messages.append)
    assert image.manifest["env"] == {"BUILT_WITHOUT": "apt"}
    assert image.initrd.stat().st_size > 10 * 2**20
    assert any(message.startswith("unpacking") for message in messages)  # really built, not found in a cache
    assert not any("apt-get" in message or "dpkg" in message for message in messages)
