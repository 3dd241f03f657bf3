"""Image disks: layers made in the test become a real ext4 file, read back with debugfs (no root, no mount).

Covers what a guest must see of an image (whiteouts, opaque directories, hard
links, symlinks, setuid, owners, xattrs, devices, fifos, times), the disk's
layout and cache, hostile images that leave nothing behind, a full disk, a
non-root build, and, as root, the whole tree against umoci's unpacking of the
same layers.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from oci_disks import DiskReader, debugfs_path, pulled_from_layout, pulled_image
from oci_images import EPOCH, Compression, LayerTar, write_layout

from pytest_forkd.errors import ImageError, ImageStoreFull
from pytest_forkd.image.oci import disk as disk_module
from pytest_forkd.image.oci.disk import DISK_CONFIG, DISK_ROOT, DiskError, disk_path, ensure_disk, guest_reference
from pytest_forkd.image.oci.layers import HostileLayer
from pytest_forkd.image.oci.store import ImageConfig, PulledImage

pytestmark = pytest.mark.skipif(
    debugfs_path() is None or shutil.which("mke2fs", path="/usr/sbin:/sbin:" + os.environ.get("PATH", "")) is None,
    reason="image disks need e2fsprogs (mke2fs, debugfs): apt-get install e2fsprogs",
)

ROOT = Path(__file__).resolve().parents[2]
CAPABILITY = b"\x01\x00\x00\x02\x00\x20\x00\x00" + bytes(12)  # cap_net_bind_service, permitted
#: Names debugfs needs quoted, or could misread: each must land on the disk as is, with its owner.
AWKWARD_NAMES = [
    "with space",
    'quote"d',
    "back\\slash",
    "<12>",
    "-dash",
    "semi;colon",
    "tab\there",
    "#hash",
    "\udcff\udcfe",
]
LONG_TARGET = "../" * 30 + "usr/lib/x86_64-linux-gnu/libc.so.6"  # beyond the 60 bytes an inode holds
CONFIG = ImageConfig(
    env=("PATH=/usr/bin:/bin", "LANG=C.UTF-8"),
    working_dir="/work",
    user="1000:1000",
    entrypoint=("/bin/sh", "-c"),
    cmd=("true",),
)


def rich_layers(
    compressions: tuple[Compression, Compression, Compression] = ("gzip", "zstd", "none"),
) -> list[tuple[LayerTar, Compression]]:
    """Three layers using every semantic a disk must carry."""
    base = (
        LayerTar()
        .dir("bin")
        .file("bin/busybox", b"\x7fELF busybox", mode=0o755)
        .hardlink("bin/ls", "bin/busybox")
        .symlink("bin/sh", "busybox")
        .hardlink("bin/sh-again", "bin/sh")  # a hard link to a symlink
        .file("bin/su", b"su", mode=0o4755)
        .file("bin/ping", b"ping", mode=0o755, xattrs={"security.capability": CAPABILITY, "user.note": b"\xff\x00bin"})
        .dir("usr/bin")
        .file("usr/bin/wall", b"wall", mode=0o2755, gid=5)
        .symlink("usr/lib64", LONG_TARGET)
        .dir("usr/lib")
        .file("usr/lib/keep", "kept")
        .symlink("lib", "usr/lib")
        .symlink("etc-link", "/etc")
        .dir("etc", mode=0o755)
        .file("etc/passwd", "root:x:0:0::/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n")
        .file("etc/motd", "goes away\n")
        .dir("home/user", mode=0o700, uid=1000, gid=1000)
        .file("home/user/.profile", "export A=1\n", mode=0o600, uid=1000, gid=1000)
        .file("home/user/huge-ids", "x", uid=100000, gid=200000)
        .dir("tmp", mode=0o1777)
        .dir("locked", mode=0o500)
        .file("locked/secret", "s", mode=0o000)
        .dir("dev")
        .device("dev/null", "char", 1, 3)
        .hardlink("dev/null-again", "dev/null")  # a hard link to a device
        .device("dev/sda", "block", 8, 0, mode=0o660)
        .device("dev/big", "char", 300, 70000, mode=0o600)
        .fifo("dev/initctl", mode=0o600)
        .dir("opt/old")
        .file("opt/old/file", "old")
        .dir("gone-dir")
        .file("gone-dir/x", "x")
        .file("was-file", "file")
        .dir("was-dir")
        .file("was-dir/inside", "inside")
        .file("empty", b"")
        .dir("awkward")
        .dir("usr/share/doc")
        .file("usr/share/doc/gone", "hidden through a symlinked parent")
        .symlink("share", "usr/share")  # parents later layers write through (merged-/usr style)
        .symlink("abs-doc", "/usr/share/doc")
    )
    for name in AWKWARD_NAMES:
        base.file(f"awkward/{name}", name.encode("utf-8", "surrogateescape"), uid=1234, gid=4321)
    middle = (
        LayerTar()
        .whiteout("etc/motd")
        .whiteout("gone-dir")
        .opaque("opt")
        .dir("lib")  # a directory where a symlink was, opaque as overlayfs makes it
        .opaque("lib")
        .file("lib/new", "new")
        .file("opt/new", "new")
        .file("was-dir", "now a file")
        .dir("was-file", mode=0o750)
        .file("was-file/inside", "now a dir")
        .hardlink("bin/busybox-too", "bin/busybox")  # to an entry of an earlier layer
        .dir("etc", mode=0o751, uid=0, gid=42)  # a directory over a directory: new metadata, same contents
    )
    top = (
        LayerTar()
        .whiteout("bin/ls")
        .file("deep/implicit/parents/file", "deep", uid=7, gid=8)
        .file("share/through-relative", "r")  # lands in usr/share, as containerd and umoci put it
        .file("abs-doc/through-absolute", "a")  # an absolute target counts from the image root
        .whiteout("abs-doc/gone")
    )
    return [(base, compressions[0]), (middle, compressions[1]), (top, compressions[2])]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    folder = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FORKD_CACHE_DIR", str(folder))
        yield folder


@pytest.fixture(scope="module")
def rich(cache: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[PulledImage, Path, list[str]]:
    written = write_layout(tmp_path_factory.mktemp("layout"), rich_layers())
    image = pulled_from_layout(written, config=CONFIG)
    lines: list[str] = []
    return image, ensure_disk(image, progress=lines.append), lines


@pytest.fixture(scope="module")
def reader(rich: tuple[PulledImage, Path, list[str]]) -> DiskReader:
    return DiskReader(rich[1])


def rootfs(path: str = "") -> str:
    return f"/{DISK_ROOT}/{path}" if path else f"/{DISK_ROOT}"


# ------------------------------------------------------------------------------------------ the tree


def test_the_disk_is_a_clean_ext4_filesystem(rich: tuple[PulledImage, Path, list[str]]) -> None:
    e2fsck = shutil.which("e2fsck", path="/usr/sbin:/sbin:" + os.environ.get("PATH", ""))
    if e2fsck is None:
        pytest.skip("e2fsck is not installed")
    result = subprocess.run([e2fsck, "-fn", str(rich[1])], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_whiteouts_and_opaque_directories(reader: DiskReader) -> None:
    top = reader.names(rootfs())
    assert "gone-dir" not in top and not reader.exists(rootfs("etc/motd"))
    assert reader.names(rootfs("opt")) == {"new"}
    assert not any(name.startswith(".wh.") for name in top | reader.names(rootfs("etc")) | reader.names(rootfs("opt")))
    assert reader.names(rootfs("etc")) == {"passwd"}
    etc = reader.stat(rootfs("etc"))
    assert (etc.mode, etc.gid) == (0o751, 42)


def test_entries_under_in_root_symlinks_land_where_they_point(reader: DiskReader) -> None:
    assert reader.read(rootfs("usr/share/through-relative")) == b"r"
    assert reader.names(rootfs("usr/share/doc")) == {"through-absolute"}  # and the whiteout hid "gone"
    assert reader.stat(rootfs("share")).target == "usr/share" and reader.stat(rootfs("abs-doc")).kind == "symlink"


def test_replaced_directories_and_files(reader: DiskReader) -> None:
    assert reader.stat(rootfs("lib")).kind == "directory" and reader.names(rootfs("lib")) == {"new"}
    assert reader.read(rootfs("usr/lib/keep")) == b"kept"
    assert reader.stat(rootfs("was-dir")).kind == "regular"
    assert reader.read(rootfs("was-dir")) == b"now a file"
    assert reader.stat(rootfs("was-file")).kind == "directory"
    assert reader.read(rootfs("was-file/inside")) == b"now a dir"


def test_hard_links_are_one_inode(reader: DiskReader) -> None:
    busybox, again = reader.stat(rootfs("bin/busybox")), reader.stat(rootfs("bin/busybox-too"))
    assert busybox.number == again.number and busybox.links == 2  # bin/ls was whited out
    assert not reader.exists(rootfs("bin/ls"))
    shell, shell_again = reader.stat(rootfs("bin/sh")), reader.stat(rootfs("bin/sh-again"))
    assert shell.number == shell_again.number and shell.links == 2 and shell.target == "busybox"
    null, null_again = reader.stat(rootfs("dev/null")), reader.stat(rootfs("dev/null-again"))
    assert null.number == null_again.number and null.links == 2


def test_symlinks_are_verbatim(reader: DiskReader) -> None:
    assert reader.stat(rootfs("etc-link")).target == "/etc"
    long = reader.stat(rootfs("usr/lib64"))
    assert (long.kind, long.target, long.mode) == ("symlink", LONG_TARGET, 0o777)


def test_modes_owners_and_special_bits(reader: DiskReader) -> None:
    expected = {
        "bin/su": (0o4755, 0, 0),
        "usr/bin/wall": (0o2755, 0, 5),
        "tmp": (0o1777, 0, 0),
        "home/user": (0o700, 1000, 1000),
        "home/user/.profile": (0o600, 1000, 1000),
        "home/user/huge-ids": (0o644, 100000, 200000),
        "locked": (0o500, 0, 0),
        "locked/secret": (0o000, 0, 0),
        "deep/implicit": (0o755, 0, 0),
        "deep/implicit/parents/file": (0o644, 7, 8),
    }
    found = {path: (status.mode, status.uid, status.gid) for path in expected for status in [reader.stat(rootfs(path))]}
    assert found == expected


def test_xattrs_including_file_capabilities(reader: DiskReader) -> None:
    assert reader.xattrs(rootfs("bin/ping")) == {"security.capability": CAPABILITY, "user.note": b"\xff\x00bin"}
    assert reader.xattrs(rootfs("bin/su")) == {}


def test_devices_and_fifos(reader: DiskReader) -> None:
    null, sda, big, fifo = (reader.stat(rootfs(f"dev/{name}")) for name in ("null", "sda", "big", "initctl"))
    assert (null.kind, null.device, null.mode) == ("character special", (1, 3), 0o666)
    assert (sda.kind, sda.device, sda.mode) == ("block special", (8, 0), 0o660)
    assert (big.kind, big.device, big.mode) == ("character special", (300, 70000), 0o600)
    assert (fifo.kind, fifo.mode) == ("FIFO", 0o600)


def test_contents(reader: DiskReader) -> None:
    assert reader.read(rootfs("bin/busybox")) == b"\x7fELF busybox"
    assert reader.read(rootfs("etc/passwd")).startswith(b"root:x:0:0")
    assert reader.read(rootfs("empty")) == b""
    assert reader.stat(rootfs("empty")).size == 0


def test_awkward_names_keep_their_names_and_owners(reader: DiskReader) -> None:
    for name in AWKWARD_NAMES:
        path = rootfs(f"awkward/{name}")
        status = reader.stat(path)
        assert (status.uid, status.gid) == (1234, 4321), name
        assert reader.read(path) == name.encode("utf-8", "surrogateescape")


def test_times_are_kept_to_the_second(reader: DiskReader) -> None:
    for path in ("bin/busybox", "bin/sh", "dev/null", "dev/initctl", "etc", "tmp", "awkward/with space", "dev"):
        assert reader.stat(rootfs(path)).mtime == EPOCH, path


def test_the_config_beside_the_root(rich: tuple[PulledImage, Path, list[str]], reader: DiskReader) -> None:
    image = rich[0]
    raw = reader.read(f"/{DISK_CONFIG}")
    document = json.loads(raw)
    assert image.reference.startswith("oci:/")  # a host path, which the guest must not see
    assert document == {
        "format": 2,
        "reference": "oci:<local>:latest",
        "digest": image.digest,
        "config": {
            "env": ["PATH=/usr/bin:/bin", "LANG=C.UTF-8"],
            "working_dir": "/work",
            "user": "1000:1000",
            "entrypoint": ["/bin/sh", "-c"],
            "cmd": ["true"],
        },
    }
    assert image.reference.split(":")[1].encode() not in raw
    for path in ("/", "/forkd", f"/{DISK_CONFIG}", rootfs()):
        status = reader.stat(path)
        assert (status.uid, status.gid) == (0, 0), path
    assert reader.stat("/").mode == 0o755 and reader.stat(f"/{DISK_CONFIG}").mode == 0o644


@pytest.mark.parametrize(
    ("reference", "shown"),
    [
        ("docker://127.0.0.1:5000/tests/app:1", "docker://127.0.0.1:5000/tests/app:1"),
        ("python:3.12-slim", "docker://docker.io/library/python:3.12-slim"),
        ("oci:/home/me/layouts/app:v1", "oci:<local>:v1"),
        ("oci-archive:/srv/evals/task.tar", "oci-archive:<local>"),
        ("docker-archive:/home/me/image.tar", "docker-archive:<local>"),
        ("dockerfile:/home/me/task/Dockerfile", "dockerfile:<local>"),
        ("oci:", "<local>"),  # unreadable: nothing of it shown
    ],
)
def test_the_guest_sees_no_host_path_in_the_reference(reference: str, shown: str) -> None:
    assert guest_reference(reference) == shown


# ------------------------------------------------------------------------------------------ the cache


def test_the_disk_is_published_read_only_sparse_and_once(
    rich: tuple[PulledImage, Path, list[str]], cache: Path
) -> None:
    image, disk, lines = rich
    assert disk == disk_path(image.digest) == cache / "oci" / "disks" / f"{image.digest.split(':')[1]}.ext4"
    status = disk.stat()
    assert stat.S_IMODE(status.st_mode) == 0o444
    assert status.st_blocks * 512 < status.st_size  # sparse: the slack costs nothing
    assert [line.split(" sha256")[0] for line in lines[:3]] == [f"unpacking layer {n}/3" for n in (1, 2, 3)]
    assert lines[3].startswith("writing the disk: ") and lines[3].endswith(" MiB")
    assert sorted(path.name for path in disk.parent.iterdir()) == [".locks", disk.name]
    again: list[str] = []
    assert ensure_disk(image, progress=again.append) == disk and again == []
    assert disk.stat().st_ino == status.st_ino


def test_workers_asking_at_once_build_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORKD_CACHE_DIR", str(tmp_path / "cache"))
    image = pulled_image(tmp_path / "blobs", [(LayerTar().file("a", "a" * 100_000), "gzip")])
    lines: list[str] = []
    results: list[Path] = []
    workers = [
        threading.Thread(target=lambda: results.append(ensure_disk(image, progress=lines.append))) for _ in range(3)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert len(results) == 3 and len(set(results)) == 1
    assert sum(line.startswith("unpacking layer") for line in lines) == 1


def test_a_build_killed_earlier_is_cleaned_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORKD_CACHE_DIR", str(tmp_path / "cache"))
    image = pulled_image(tmp_path / "blobs", [(LayerTar().file("a", "a"), "gzip")])
    stale = disk_path(image.digest).parent / f".build-{image.digest.split(':')[1]}-killed"
    (stale / "stage").mkdir(parents=True)
    disk = ensure_disk(image, progress=lambda line: None)
    assert not stale.exists() and disk.is_file()


# ------------------------------------------------------------------------------------------ refusals


def hostile_cases(sentinel: Path) -> dict[str, tuple[LayerTar, str]]:
    """Layers that try to write ``sentinel`` (outside everything of the build) or to reach the host."""

    def entry(name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
        info = tarfile.TarInfo(name)
        info.type, info.linkname, info.mode = kind, linkname, 0o644
        return info

    ups = "../" * 40
    return {
        "dotdot": (LayerTar().add(entry(f"{ups}{str(sentinel).lstrip('/')}"), b"pwned"), "escapes the image root"),
        "symlink-then-write": (
            LayerTar().symlink("evil", "/" + ups + str(sentinel.parent)).add(entry(f"evil/{sentinel.name}"), b"pwned"),
            "would be written through the symlink 'evil' -> '/../",
        ),
        "relative-symlink-then-write": (
            LayerTar().symlink("evil", ups.rstrip("/")).add(entry(f"evil/{str(sentinel).lstrip('/')}"), b"pwned"),
            "would be written through the symlink 'evil' -> '../",
        ),
        "hardlink-to-host": (
            LayerTar().add(entry("passwd", tarfile.LNKTYPE, "/etc/passwd")),
            "is a hard link to '/etc/passwd', which no earlier entry created",
        ),
        "hardlink-up": (
            LayerTar().add(entry("shadow", tarfile.LNKTYPE, f"{ups}etc/shadow")),
            "which escapes the image root",
        ),
    }


@pytest.mark.parametrize(
    "case", ["dotdot", "symlink-then-write", "relative-symlink-then-write", "hardlink-to-host", "hardlink-up"]
)
def test_a_hostile_image_is_refused_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    monkeypatch.setenv("FORKD_CACHE_DIR", str(tmp_path / "cache"))
    outside = Path(tempfile.mkdtemp(prefix="forkd-sentinel-"))
    try:
        sentinel = outside / "pwned"
        layer, expected = hostile_cases(sentinel)[case]
        image = pulled_image(
            tmp_path / "blobs", [(LayerTar().dir("etc").file("etc/ok", "ok"), "gzip"), (layer, "gzip")]
        )
        passwd_before = Path("/etc/passwd").read_bytes()
        with pytest.raises(HostileLayer) as refused:
            ensure_disk(image, progress=lambda line: None)
        message = str(refused.value)
        assert expected in message and message.startswith(f"layer {image.layers[1].digest[:19]}…: entry ")
        assert "\n" not in message
        assert not sentinel.exists() and list(outside.iterdir()) == []
        assert Path("/etc/passwd").read_bytes() == passwd_before
        disks = disk_path(image.digest).parent
        assert sorted(path.name for path in disks.iterdir()) == [".locks"]  # no disk, no build directory
    finally:
        shutil.rmtree(outside)


def test_an_absolute_symlinked_parent_to_a_host_folder_stays_inside_the_image(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``evil -> /tmp/x`` means the image's /tmp/x, never the host's: the entry lands on the disk, nowhere else."""
    monkeypatch.setenv("FORKD_CACHE_DIR", str(tmp_path / "cache"))
    outside = Path(tempfile.mkdtemp(prefix="forkd-sentinel-"))
    try:
        layer = LayerTar().symlink("evil", str(outside)).file("evil/pwned", "inside the image")
        disk = ensure_disk(pulled_image(tmp_path / "blobs", [(layer, "gzip")]), progress=lambda line: None)
        assert list(outside.iterdir()) == []
        reader = DiskReader(disk)
        assert reader.read(rootfs(f"{str(outside).lstrip('/')}/pwned")) == b"inside the image"
        assert reader.stat(rootfs("evil")).target == str(outside)
    finally:
        shutil.rmtree(outside)


def test_an_entry_debugfs_cannot_take_in_one_line_is_refused_not_split(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """debugfs reads commands with fgets(8192): a longer line would run as two commands, the rest chosen by the image."""
    monkeypatch.setenv("FORKD_CACHE_DIR", str(tmp_path / "cache"))
    deep = "/".join(['"' * 240] * 15)  # 3,614 bytes; quoted for debugfs, twice as long
    layer = LayerTar().symlink(f"{deep}/a", "target").hardlink(f"{deep}/b", f"{deep}/a")
    image = pulled_image(tmp_path / "blobs", [(layer, "gzip")])
    with pytest.raises(DiskError, match="has a path too long for the disk writer"):
        ensure_disk(image, progress=lambda line: None)
    assert sorted(path.name for path in disk_path(image.digest).parent.iterdir()) == [".locks"]


def test_a_bad_digest_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORKD_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ImageError, match="is not of the form sha256:<64 hex digits>"):
        disk_path("sha256:../../etc")


def test_a_full_disk_is_one_line_naming_the_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill needs root")
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(small)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        monkeypatch.setenv("FORKD_CACHE_DIR", str(small))
        image = pulled_image(tmp_path / "blobs", [(LayerTar().file("big", os.urandom(4 << 20)), "gzip")])
        with pytest.raises(ImageStoreFull) as full:
            ensure_disk(image, progress=lambda line: None)
        message = str(full.value)
        assert f" failed: no space left in {small}/oci/disks, on tmpfs at {small} (" in message, message
        assert "forkd image prune" in message and "FORKD_CACHE_DIR" in message and "\n" not in message
        assert sorted(path.name for path in (small / "oci" / "disks").iterdir()) == [".locks"]
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_without_e2fsprogs_the_error_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORKD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(disk_module, "_tool", lambda name: None)
    image = pulled_image(tmp_path / "blobs", [(LayerTar().file("a", "a"), "gzip")])
    with pytest.raises(ImageError, match=r"mke2fs is not installed .* install e2fsprogs"):
        ensure_disk(image, progress=lambda line: None)


# ------------------------------------------------------------------------------------------ without root


NOBODY = 65534


def build_as_nobody(image: PulledImage, cache: Path) -> Path:
    """``ensure_disk(image)`` in a forked child that has dropped root for nobody's uid and gid.

    A fork, not ``runuser``: the interpreter may live where nobody cannot run it
    (a pyenv under /root), while the child inherits it already running.
    """
    reading, writing = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        status = 1
        try:
            os.close(reading)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.environ["FORKD_CACHE_DIR"] = str(cache)
            answer = str(ensure_disk(image, progress=lambda line: None))
            status = 0
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
            answer = f"{type(exc).__name__}: {exc}"
        finally:
            os.write(writing, answer.encode())
            os._exit(status)
    os.close(writing)
    with os.fdopen(reading, "rb") as pipe:
        answer = pipe.read().decode()
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, answer
    return Path(answer)


def test_a_non_root_build_carries_the_images_ownership(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk a user without privileges builds has the image's owners, modes, devices and capabilities."""
    shared = Path(tempfile.mkdtemp(prefix="forkd-nonroot-"))  # tmp_path's parents are private to its owner
    try:
        os.chmod(shared, 0o755)
        image = pulled_from_layout(write_layout(shared / "layout", rich_layers()))
        cache = shared / "cache"
        cache.mkdir()
        if os.geteuid() == 0:
            for path in [shared, *shared.rglob("*")]:
                os.chmod(path, 0o755 if path.is_dir() else 0o644)
            os.chown(cache, NOBODY, NOBODY)
            disk = build_as_nobody(image, cache)
            assert disk.stat().st_uid == NOBODY
        else:
            monkeypatch.setenv("FORKD_CACHE_DIR", str(cache))
            disk = ensure_disk(image, progress=lambda line: None)
        reader = DiskReader(disk)
        for path, owner in {
            "bin/su": (0o4755, 0, 0),
            "usr/bin/wall": (0o2755, 0, 5),
            "home/user/.profile": (0o600, 1000, 1000),
            "home/user/huge-ids": (0o644, 100000, 200000),
            "locked/secret": (0o000, 0, 0),
            "awkward/with space": (0o644, 1234, 4321),
            'awkward/quote"d': (0o644, 1234, 4321),
            "etc": (0o751, 0, 42),
            "deep/implicit": (0o755, 0, 0),
            "dev/sda": (0o660, 0, 0),
        }.items():
            status = reader.stat(rootfs(path))
            assert (status.mode, status.uid, status.gid) == owner, path
        assert reader.stat(rootfs("dev/sda")).device == (8, 0)
        assert reader.stat(rootfs("dev/big")).device == (300, 70000)
        assert reader.xattrs(rootfs("bin/ping"))["security.capability"] == CAPABILITY
        for path in ("/", rootfs(), "/forkd", f"/{DISK_CONFIG}"):
            assert (reader.stat(path).uid, reader.stat(path).gid) == (0, 0), path
    finally:
        shutil.rmtree(shared)


# ------------------------------------------------------------------------------------------ against umoci


def describe_tree(root: Path) -> tuple[dict[str, tuple[object, ...]], set[frozenset[str]]]:
    """Every entry under ``root`` (type, mode, owner, content, target, device, xattrs) and its hard link groups."""
    entries: dict[str, tuple[object, ...]] = {}
    inodes: dict[int, set[str]] = {}
    for directory, names, files in os.walk(root):
        for name in names + files:
            path = Path(directory) / name
            relative = str(path.relative_to(root))
            status = os.lstat(path)
            kind = stat.S_IFMT(status.st_mode)
            detail: object = None
            if stat.S_ISREG(kind):
                detail = hashlib.sha256(path.read_bytes()).hexdigest()
            elif stat.S_ISLNK(kind):
                detail = os.readlink(path)
            elif stat.S_ISCHR(kind) or stat.S_ISBLK(kind):
                detail = (os.major(status.st_rdev), os.minor(status.st_rdev))
            xattrs = (
                {}
                if stat.S_ISLNK(kind)
                else {
                    attribute: os.getxattr(path, attribute, follow_symlinks=False)
                    for attribute in os.listxattr(path, follow_symlinks=False)
                }
            )
            mtime = None if stat.S_ISDIR(kind) else int(status.st_mtime)
            entries[relative] = (
                kind,
                stat.S_IMODE(status.st_mode),
                status.st_uid,
                status.st_gid,
                detail,
                xattrs,
                mtime,
            )
            if not stat.S_ISDIR(kind):
                inodes.setdefault(status.st_ino, set()).add(relative)
    return entries, {frozenset(group) for group in inodes.values() if len(group) > 1}


@pytest.mark.oci_tools  # runs umoci, a real container tool (and loop-mounts the disk)
def test_the_disk_matches_umocis_unpacking_of_the_same_layers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """umoci is a reference unpacker of OCI images: its rootfs and the disk's must be the same tree."""
    if os.geteuid() != 0:
        pytest.skip("comparing with umoci needs root: umoci unpacks owners and devices, and the disk is mounted")
    umoci = shutil.which("umoci")
    if umoci is None:
        pytest.skip("umoci is not installed (apt-get install umoci)")
    monkeypatch.setenv("FORKD_CACHE_DIR", str(tmp_path / "cache"))
    written = write_layout(tmp_path / "layout", rich_layers(("gzip", "gzip", "gzip")))
    disk = ensure_disk(pulled_from_layout(written), progress=lambda line: None)
    bundle = tmp_path / "bundle"
    unpacked = subprocess.run(
        [umoci, "unpack", "--image", f"{written.layout}:{written.tag}", str(bundle)], capture_output=True, text=True
    )
    assert unpacked.returncode == 0, unpacked.stderr
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    mounted = subprocess.run(["mount", "-o", "loop,ro", str(disk), str(mountpoint)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot loop-mount the disk here: {mounted.stderr.strip()}")
    try:
        ours, our_links = describe_tree(mountpoint / DISK_ROOT)
        theirs, their_links = describe_tree(bundle / "rootfs")
    finally:
        subprocess.run(["umount", str(mountpoint)], check=True)
    assert len(ours) > 40
    assert {path: ours.get(path) for path in theirs.keys() | ours.keys() if ours.get(path) != theirs.get(path)} == {
        path: theirs.get(path) for path in theirs.keys() | ours.keys() if ours.get(path) != theirs.get(path)
    }
    assert our_links == their_links
