"""OCI images made in Python for the tests: layers, configs, layouts, manifest lists, pushes with skopeo.

Docker Hub is out of reach of these machines, so the tests make their images
themselves, byte by byte, and push them with the real ``skopeo`` to the real
registry of :mod:`registry`:

- :class:`LayerTar` writes one layer's tar: files, directories, symlinks, hard
  links, whiteouts, opaque directories, device nodes, owners, modes and
  xattrs, and any raw (hostile) entry a test wants.
- :func:`write_layout` writes an OCI image layout (``oci:DIR:TAG``): blobs by
  digest, the image config (Env, WorkingDir, User, Entrypoint, Cmd), one
  manifest, or a manifest list over several platforms (an arm64-only image...).
- :func:`busybox_layers` / :func:`write_busybox_image`: an image with nothing
  but the static busybox of the ``busybox-static`` package the project
  already caches (no python, no libc), in layers that exercise whiteouts,
  opaque directories, hard links, symlinks, setuid, owners and xattrs; see
  :data:`BUSYBOX_FACTS` for what a guest of it must see.
- :func:`write_debian_image`: a Debian root with bash and python3, from the
  cached packages the default guest image was built from.
- :func:`push` copies a layout to a registry with ``skopeo copy``.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from support import USER_CACHE

Compression = Literal["none", "gzip", "zstd"]

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER_MEDIA_TYPES: dict[Compression, str] = {
    "none": "application/vnd.oci.image.layer.v1.tar",
    "gzip": "application/vnd.oci.image.layer.v1.tar+gzip",
    "zstd": "application/vnd.oci.image.layer.v1.tar+zstd",
}
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: A fixed layer time, so the same layers give the same digests in every run.
EPOCH = 1_700_000_000


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class LayerTar:
    """One layer's uncompressed tar, written entry by entry (PAX format, so xattrs and long names fit).

    Paths are given without a leading ``/`` or with one (it is dropped, as
    image tools write them). Every method returns ``self`` for chaining.
    """

    def __init__(self) -> None:
        self._buffer = io.BytesIO()
        self._tar = tarfile.open(fileobj=self._buffer, mode="w", format=tarfile.PAX_FORMAT)
        self._closed = False

    @staticmethod
    def _info(path: str, kind: bytes, *, mode: int, uid: int = 0, gid: int = 0) -> tarfile.TarInfo:
        info = tarfile.TarInfo(path.lstrip("/"))
        info.type = kind
        info.mode = mode
        info.uid, info.gid = uid, gid
        info.uname = info.gname = ""
        info.mtime = EPOCH
        return info

    def add(self, info: tarfile.TarInfo, data: bytes | None = None) -> LayerTar:
        """Add any entry as given, hostile ones included (``../x``, ``/abs``, a link out of the root...)."""
        assert not self._closed, "the layer's tar is already written"
        if data is not None:
            info.size = len(data)
        self._tar.addfile(info, io.BytesIO(data) if data is not None else None)
        return self

    def dir(self, path: str, *, mode: int = 0o755, uid: int = 0, gid: int = 0) -> LayerTar:
        return self.add(self._info(path, tarfile.DIRTYPE, mode=mode, uid=uid, gid=gid))

    def file(
        self,
        path: str,
        data: bytes | str = b"",
        *,
        mode: int = 0o644,
        uid: int = 0,
        gid: int = 0,
        xattrs: Mapping[str, bytes] | None = None,
    ) -> LayerTar:
        info = self._info(path, tarfile.REGTYPE, mode=mode, uid=uid, gid=gid)
        for name, value in (xattrs or {}).items():
            # PAX carries xattrs as SCHILY.xattr.NAME; binary values survive as surrogate escapes.
            info.pax_headers[f"SCHILY.xattr.{name}"] = value.decode("utf-8", "surrogateescape")
        return self.add(info, data.encode() if isinstance(data, str) else data)

    def symlink(self, path: str, target: str, *, uid: int = 0, gid: int = 0) -> LayerTar:
        info = self._info(path, tarfile.SYMTYPE, mode=0o777, uid=uid, gid=gid)
        info.linkname = target
        return self.add(info)

    def hardlink(self, path: str, target: str) -> LayerTar:
        """A hard link to ``target``, an earlier entry of this same layer (path in the root, no leading /)."""
        info = self._info(path, tarfile.LNKTYPE, mode=0o644)
        info.linkname = target.lstrip("/")
        return self.add(info)

    def device(
        self, path: str, kind: Literal["char", "block"], major: int, minor: int, *, mode: int = 0o666
    ) -> LayerTar:
        info = self._info(path, tarfile.CHRTYPE if kind == "char" else tarfile.BLKTYPE, mode=mode)
        info.devmajor, info.devminor = major, minor
        return self.add(info)

    def fifo(self, path: str, *, mode: int = 0o644) -> LayerTar:
        return self.add(self._info(path, tarfile.FIFOTYPE, mode=mode))

    def whiteout(self, path: str) -> LayerTar:
        """Delete ``path`` of the layers below (an empty ``.wh.NAME`` file beside it)."""
        parent, _, name = path.strip("/").rpartition("/")
        return self.file(f"{parent}/.wh.{name}" if parent else f".wh.{name}", b"", mode=0o600)

    def opaque(self, directory: str) -> LayerTar:
        """Hide everything the layers below had in ``directory`` (a ``.wh..wh..opq`` file in it)."""
        return self.file(f"{directory.strip('/')}/.wh..wh..opq", b"", mode=0o600)

    def tree(self, root: Path, *, uid: int = 0, gid: int = 0) -> LayerTar:
        """Every file, directory and symlink under ``root`` (sorted, modes kept, owners ``uid:gid``)."""
        for path in sorted(root.rglob("*")):
            relative = path.relative_to(root).as_posix()
            info = self._tar.gettarinfo(str(path), arcname=relative)
            info.uid, info.gid, info.uname, info.gname, info.mtime = uid, gid, "", "", EPOCH
            if info.isreg():
                with path.open("rb") as handle:
                    self._tar.addfile(info, handle)
            else:
                self._tar.addfile(info)
        return self

    def tar(self) -> bytes:
        """The finished tar (no entry can be added afterwards)."""
        if not self._closed:
            self._tar.close()
            self._closed = True
        return self._buffer.getvalue()


def compress(data: bytes, compression: Compression) -> bytes:
    if compression == "none":
        return data
    if compression == "gzip":
        return gzip.compress(data, compresslevel=6, mtime=0)
    try:
        import zstandard
    except ImportError:
        tool = shutil.which("zstd")
        assert tool, "zstd layers need the zstandard module or the zstd tool (apt-get install zstd)"
        return subprocess.run([tool, "-q", "-c", "-3"], input=data, stdout=subprocess.PIPE, check=True).stdout
    return bytes(zstandard.ZstdCompressor(level=3).compress(data))


@dataclass(frozen=True)
class ImageConfigSpec:
    """The runtime part of an image config (the ``config`` object of the OCI config JSON)."""

    env: tuple[str, ...] = (f"PATH={DEFAULT_PATH}",)
    working_dir: str = ""
    user: str = ""
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ("sh",)
    labels: Mapping[str, str] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        config: dict[str, Any] = {"Env": list(self.env), "Cmd": list(self.cmd)}
        if self.working_dir:
            config["WorkingDir"] = self.working_dir
        if self.user:
            config["User"] = self.user
        if self.entrypoint:
            config["Entrypoint"] = list(self.entrypoint)
        if self.labels:
            config["Labels"] = dict(self.labels)
        return config


@dataclass(frozen=True)
class WrittenImage:
    """What :func:`write_layout` wrote: the tag's top digest, and the platform manifests below it."""

    layout: Path
    tag: str
    digest: str  # the manifest digest, or the manifest list's when there are platforms
    manifests: Mapping[str, str]  # "linux/amd64" -> manifest digest
    layer_digests: tuple[str, ...]  # the compressed layers, bottom first

    @property
    def reference(self) -> str:
        return f"oci:{self.layout}:{self.tag}"


def _put_blob(layout: Path, data: bytes) -> tuple[str, int]:
    digest = sha256_digest(data)
    blob = layout / "blobs" / "sha256" / digest.split(":", 1)[1]
    blob.parent.mkdir(parents=True, exist_ok=True)
    if not blob.exists():
        blob.write_bytes(data)
    return digest, len(data)


def _descriptor(media_type: str, digest: str, size: int, **extra: Any) -> dict[str, Any]:
    return {"mediaType": media_type, "digest": digest, "size": size, **extra}


def write_layout(
    layout: Path,
    layers: Sequence[tuple[LayerTar | bytes, Compression]],
    *,
    config: ImageConfigSpec = ImageConfigSpec(),
    tag: str = "latest",
    platforms: Sequence[str] | None = None,
) -> WrittenImage:
    """Write an image into the OCI layout ``layout`` (created, or added to) under ``tag``.

    ``layers`` are (tar, compression) pairs, bottom first. Without
    ``platforms`` the tag names one linux/amd64 manifest; with them (e.g.
    ``["linux/arm64"]`` or ``["linux/amd64", "linux/arm64/v8"]``) it names a
    manifest list with one manifest per platform, each with its own config.
    """
    layout.mkdir(parents=True, exist_ok=True)
    (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    layer_descriptors = []
    diff_ids = []
    for layer, compression in layers:
        tar = layer.tar() if isinstance(layer, LayerTar) else layer
        diff_ids.append(sha256_digest(tar))
        digest, size = _put_blob(layout, compress(tar, compression))
        layer_descriptors.append(_descriptor(LAYER_MEDIA_TYPES[compression], digest, size))

    def manifest_for(os_name: str, architecture: str, variant: str | None) -> tuple[str, int]:
        config_json: dict[str, Any] = {
            "created": "2023-11-14T22:13:20Z",
            "architecture": architecture,
            "os": os_name,
            "config": config.as_json(),
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
            "history": [{"created": "2023-11-14T22:13:20Z", "created_by": "tests/oci_images.py"} for _ in diff_ids],
        }
        if variant:
            config_json["variant"] = variant
        config_digest, config_size = _put_blob(layout, json.dumps(config_json, sort_keys=True).encode())
        manifest = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": _descriptor(OCI_CONFIG, config_digest, config_size),
            "layers": layer_descriptors,
        }
        return _put_blob(layout, json.dumps(manifest, sort_keys=True).encode())

    manifests: dict[str, str] = {}
    if platforms is None:
        digest, size = manifest_for("linux", "amd64", None)
        manifests["linux/amd64"] = digest
        top = _descriptor(OCI_MANIFEST, digest, size)
    else:
        entries = []
        for platform in platforms:
            os_name, architecture, *rest = platform.split("/")
            variant = rest[0] if rest else None
            digest, size = manifest_for(os_name, architecture, variant)
            manifests[platform] = digest
            described = {"os": os_name, "architecture": architecture, **({"variant": variant} if variant else {})}
            entries.append(_descriptor(OCI_MANIFEST, digest, size, platform=described))
        index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries}
        digest, size = _put_blob(layout, json.dumps(index, sort_keys=True).encode())
        top = _descriptor(OCI_INDEX, digest, size)
    top["annotations"] = {"org.opencontainers.image.ref.name": tag}
    index_file = layout / "index.json"
    existing = json.loads(index_file.read_text()) if index_file.exists() else {"schemaVersion": 2, "manifests": []}
    existing["manifests"] = [
        entry
        for entry in existing["manifests"]
        if entry.get("annotations", {}).get("org.opencontainers.image.ref.name") != tag
    ] + [top]
    index_file.write_text(json.dumps(existing))
    return WrittenImage(
        layout=layout,
        tag=tag,
        digest=top["digest"],
        manifests=manifests,
        layer_digests=tuple(entry["digest"] for entry in layer_descriptors),
    )


def push(
    image: WrittenImage | str,
    destination: str,
    *,
    all_platforms: bool = True,
    docker_format: bool = False,
    authfile: Path | None = None,
) -> None:
    """Copy an image (a :class:`WrittenImage` or any skopeo source) to ``docker://...`` ``destination``.

    ``all_platforms`` pushes a whole manifest list (``--all``);
    ``docker_format`` converts to Docker v2 schema 2 media types on the way.
    """
    source = image.reference if isinstance(image, WrittenImage) else image
    command = ["skopeo", "copy", "--quiet", "--dest-tls-verify=false"]
    if all_platforms:
        command.append("--all")
    if docker_format:
        command += ["--format", "v2s2"]
    if authfile is not None:
        command += ["--dest-authfile", str(authfile)]
    subprocess.run([*command, source, destination], check=True, capture_output=True, timeout=300, env=skopeo_env())


def skopeo_env() -> dict[str, str]:
    """The environment the tests run skopeo in: a non-root user without XDG_RUNTIME_DIR gets a runtime folder.

    Without one skopeo reads /run/containers/UID/auth.json, which fails when root has made /run/containers
    its own (0700, once root ran podman): the same case forkd's own skopeo calls handle.
    """
    env = dict(os.environ)
    if os.getuid() != 0 and not env.get("XDG_RUNTIME_DIR"):
        env["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="forkd-tests-skopeo-run-")
    return env


# --- the busybox-only image -------------------------------------------------------------------

#: What a guest of :func:`write_busybox_image` sees (the layers' net effect), for the tests to check.
BUSYBOX_FACTS: dict[str, Any] = {
    "env": ("FORKD_IMAGE=busybox-only", "GREETING=hello from the image"),
    "working_dir": "/srv/work",
    "user": ("app", 1000, 1000),  # name, uid, gid in /etc/passwd
    "absent": (
        "/etc/removed-by-whiteout",
        "/opt/replaced/old.txt",
        "/usr/bin/python3",
        "/lib/x86_64-linux-gnu",
        "/usr/lib/removed-through-lib",  # a whiteout of layer 3 through the symlink lib -> usr/lib
    ),
    "files": {
        "/opt/replaced/new.txt": "from layer 2\n",
        "/etc/motd": "layer 3 replaced this\n",
        "/opt/data/original": "shared by a hard link\n",
        "/usr/lib/hello.txt": "written as lib/hello.txt\n",  # by layer 3, through lib -> usr/lib (merged /usr)
    },
    "hardlinks": ("/opt/data/original", "/opt/data/hardlink"),
    "symlinks": {"/opt/data/symlink": "original", "/bin/sh": "busybox", "/lib": "usr/lib"},
    "setuid": "/usr/local/bin/suid-tool",  # mode 04755
    "owned": ("/srv/owned", 1234, 5678),  # path, uid, gid
    "home": ("/home/app", 1000, 1000),
    "capability": "/usr/local/bin/cap-tool",  # carries security.capability (cap_net_raw+ep)
}
#: security.capability for cap_net_raw (bit 13) permitted+effective, VFS_CAP_REVISION_2.
CAP_NET_RAW = bytes.fromhex("0100000200200000000000000000000000000000")


@functools.lru_cache(maxsize=None)
def cached_deb(package: str, version: str | None = None) -> Path:
    """The cached .deb of ``package``, read from its control file.

    ``version``: that version exactly; by default the version the default image
    was built from. The cache holds every release's packages a run fetched (a
    trixie image beside the bookworm default), and mixing them breaks a root.
    """
    if version is None:
        version = default_image_packages().get(package)
    found: list[tuple[str, Path]] = []
    debs = USER_CACHE / "debs"
    for deb in sorted(debs.glob("*.deb")):
        fields = _control_fields(deb)
        if fields.get("Package") == package and version in (None, fields.get("Version")):
            found.append((fields.get("Version", ""), deb))
    if not found:
        raise LookupError(
            f"no cached .deb of {package} {version or ''} under {debs}: build the default image first "
            "(`forkd image build`)"
        )
    return sorted(found)[-1][1]


def _control_fields(deb: Path) -> dict[str, str]:
    from pytest_forkd.image.deb import ar_members

    with deb.open("rb") as handle:
        for name, size in ar_members(handle, deb.name):
            if not name.startswith("control.tar"):
                continue
            data = handle.read(size)
            if name.endswith(".zst"):
                data = compress_tool_decompress(data)
                mode = "r:"
            else:
                mode = {"control.tar": "r:", "control.tar.gz": "r:gz", "control.tar.xz": "r:xz"}[name]
            with tarfile.open(fileobj=io.BytesIO(data), mode=mode) as archive:  # type: ignore[call-overload]
                for member in archive:
                    if member.name.lstrip("./") == "control":
                        extracted = archive.extractfile(member)
                        assert extracted is not None
                        fields = {}
                        for line in extracted.read().decode().splitlines():
                            key, colon, value = line.partition(":")
                            if colon and not line.startswith((" ", "\t")):
                                fields[key.strip()] = value.strip()
                        return fields
    return {}


def compress_tool_decompress(data: bytes) -> bytes:
    return subprocess.run(["zstd", "-dcq"], input=data, stdout=subprocess.PIPE, check=True).stdout


def busybox_binary() -> bytes:
    """The static busybox of the cached ``busybox-static`` package."""
    from pytest_forkd.image.deb import data_tar

    with data_tar(cached_deb("busybox-static")) as archive:
        for member in archive:
            if member.isfile() and member.name.endswith("/busybox"):
                extracted = archive.extractfile(member)
                assert extracted is not None
                return extracted.read()
    raise LookupError("the busybox-static package has no busybox binary")


def busybox_applets(binary: bytes) -> list[str]:
    """Where busybox installs its applets (``bin/sh``, ``usr/bin/env``...), asked from the binary itself."""
    with tempfile.TemporaryDirectory() as folder:
        tool = Path(folder) / "busybox"
        tool.write_bytes(binary)
        tool.chmod(0o755)
        listed = subprocess.run([str(tool), "--list-full"], capture_output=True, text=True, check=True).stdout
    return sorted(line.strip() for line in listed.splitlines() if line.strip() and line.strip() != "bin/busybox")


def busybox_layers() -> list[tuple[LayerTar, Compression]]:
    """Three layers of a busybox-only image (gzip, zstd, uncompressed): see :data:`BUSYBOX_FACTS`."""
    binary = busybox_binary()
    base = LayerTar()
    for directory in (
        "bin",
        "sbin",
        "usr",
        "usr/bin",
        "usr/sbin",
        "usr/lib",
        "usr/local",
        "usr/local/bin",
        "etc",
        "root",
    ):
        base.dir(directory, mode=0o700 if directory == "root" else 0o755)
    base.symlink("lib", "usr/lib").file("usr/lib/removed-through-lib", "layer 3 deletes this through lib\n")
    base.dir("tmp", mode=0o1777).dir("home").dir("home/app", mode=0o750, uid=1000, gid=1000)
    base.dir("srv").dir("srv/work").dir("opt").dir("opt/replaced")
    base.file("bin/busybox", binary, mode=0o755)
    for applet in busybox_applets(binary):
        depth = applet.count("/")
        base.symlink(applet, "busybox" if applet.startswith("bin/") else "../" * depth + "bin/busybox")
    base.file("etc/passwd", "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:/bin/sh\n")
    base.file("etc/group", "root:x:0:\napp:x:1000:\n")
    base.file("etc/motd", "layer 1 wrote this\n")
    base.file("etc/removed-by-whiteout", "layer 2 deletes this\n")
    base.file("opt/replaced/old.txt", "layer 2 hides this with an opaque directory\n")

    second = LayerTar()
    second.whiteout("etc/removed-by-whiteout")
    second.dir("opt/replaced").opaque("opt/replaced").file("opt/replaced/new.txt", "from layer 2\n")
    second.dir("opt/data").file("opt/data/original", "shared by a hard link\n")
    second.hardlink("opt/data/hardlink", "opt/data/original")
    second.symlink("opt/data/symlink", "original")
    second.file("usr/local/bin/suid-tool", "#!/bin/sh\nid -u\n", mode=0o4755)
    second.file(
        "usr/local/bin/cap-tool", "#!/bin/sh\necho cap\n", mode=0o755, xattrs={"security.capability": CAP_NET_RAW}
    )
    second.file("srv/owned", "owned by 1234:5678\n", mode=0o640, uid=1234, gid=5678)

    third = LayerTar().file("etc/motd", "layer 3 replaced this\n")
    # As BuildKit's COPY --link writes onto a merged-/usr base: entries under a parent that is an in-root symlink.
    third.file("lib/hello.txt", "written as lib/hello.txt\n").whiteout("lib/removed-through-lib")
    return [(base, "gzip"), (second, "zstd"), (third, "none")]


def busybox_config(*, user: str = "") -> ImageConfigSpec:
    return ImageConfigSpec(
        env=(f"PATH={DEFAULT_PATH}", *BUSYBOX_FACTS["env"]),
        working_dir=BUSYBOX_FACTS["working_dir"],
        user=user,
        cmd=("sh",),
    )


def write_busybox_image(layout: Path, *, tag: str = "latest", user: str = "") -> WrittenImage:
    """The busybox-only image in ``layout`` under ``tag``; ``user="app"`` makes its config name a User."""
    return write_layout(layout, busybox_layers(), config=busybox_config(user=user), tag=tag)


# --- the Debian image with bash and python3 ---------------------------------------------------


def default_image_packages() -> dict[str, str]:
    """The packages of the built default guest image and their versions: bash, python3 and their closure."""
    images = USER_CACHE / "images"
    try:
        key = (images / "names" / "default").read_text().strip()
        manifest = json.loads((images / key / "manifest.json").read_text())
    except OSError:
        raise LookupError(f"no default image under {images}: build it first (`forkd image build`)") from None
    return dict(manifest["packages"])


def debian_root(root: Path, packages: Iterable[str] | None = None) -> Path:
    """Unpack cached Debian packages (by default the default image's) into ``root``, merged /usr, with users."""
    from pytest_forkd.image.deb import unpack
    from pytest_forkd.image.rootfs import install_busybox_links, make_merged_usr

    root.mkdir(parents=True, exist_ok=True)
    make_merged_usr(root)
    for package in packages if packages is not None else default_image_packages():
        unpack(cached_deb(package), root)
    etc = root / "etc"
    etc.mkdir(exist_ok=True)
    (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\ntester:x:1000:1000::/home/tester:/bin/bash\n")
    (etc / "group").write_text("root:x:0:\ntester:x:1000:\n")
    for directory in ("root", "tmp", "home/tester", "work"):
        (root / directory).mkdir(parents=True, exist_ok=True)
    (root / "tmp").chmod(0o1777)
    # The default image's packages leave out dash and coreutils (its busybox stands in): so here too.
    shell = root / "usr" / "bin" / "sh"
    if not shell.exists() and not shell.is_symlink():
        shell.symlink_to("bash")
    install_busybox_links(root)
    python = root / "usr" / "bin" / "python3"
    if not python.exists():
        interpreters = sorted((root / "usr" / "bin").glob("python3.*"))
        python.symlink_to(interpreters[-1].name)
    return root


def write_debian_image(layout: Path, *, tag: str = "latest", compression: Compression = "gzip") -> WrittenImage:
    """A Debian image with bash and python3 in ``layout``: one layer of the root, one small layer on top."""
    with tempfile.TemporaryDirectory(prefix="forkd-debian-image-") as folder:
        root = debian_root(Path(folder) / "root")
        base = LayerTar().tree(root)
    top = LayerTar().dir("work").file("work/README", "a Debian image for forkd tests\n")
    config = ImageConfigSpec(
        env=(f"PATH={DEFAULT_PATH}", "FORKD_IMAGE=debian", "LANG=C.UTF-8"),
        working_dir="/work",
        cmd=("bash",),
    )
    return write_layout(layout, [(base, compression), (top, "gzip")], config=config, tag=tag)
