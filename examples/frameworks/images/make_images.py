"""The container images of the framework examples, made on this host without Docker Hub.

The examples name their environment as their harnesses do for Docker: the
Inspect task's compose file builds ``FROM ${FORKD_EXAMPLE_BASE:-python:3.12-slim}``
and the mini-swe-agent run takes an image. Where Docker Hub is reachable
nothing needs making; where it is not (a CI runner, an air-gapped machine),
this script makes the two images as OCI archives, from Debian bookworm
packages (the mirror forkd's own guest image comes from, cached the same
way)::

    python examples/frameworks/images/make_images.py

writes, next to itself,

- ``base.tar``: Debian with bash, python3 and coreutils, whose reference is
  ``oci-archive:/abs/path/base.tar`` (``export FORKD_EXAMPLE_BASE=...``, as
  the script prints);
- ``calc-task.tar``: that base with a small project in ``/srv/project``
  whose test fails, for the mini-swe-agent run.

Both are plain OCI images: ``skopeo copy oci-archive:base.tar
docker://REGISTRY/base:1`` pushes one to a registry, ``podman load`` takes
it too. Run again, it rewrites them (a few seconds once the packages are
cached).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: What the base image carries besides the default guest image's bash and python3.
PACKAGES = ("bash", "python3-minimal", "libpython3-stdlib", "coreutils", "grep", "sed", "findutils", "diffutils")
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: A fixed time for every entry and config, so the same packages give the same digests.
EPOCH = 1_700_000_000

CALC = "def add(a, b):\n    return a - b\n"
TEST_CALC = """\
import unittest

from calc import add


class AddTest(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)

    def test_add_negative(self):
        self.assertEqual(add(-1, 1), 0)


if __name__ == "__main__":
    unittest.main()
"""


def debian_root(root: Path) -> None:
    """Unpack :data:`PACKAGES` and their dependencies (Debian bookworm, amd64) into ``root``, merged /usr."""
    from pytest_forkd import paths
    from pytest_forkd.image.debian import select_packages, unpack
    from pytest_forkd.image.recipe import load_default_recipe
    from pytest_forkd.image.rootfs import make_merged_usr

    recipe = load_default_recipe()
    selection = select_packages(
        recipe.release, recipe.kernel, PACKAGES, ("dpkg", "debconf", "tzdata"), paths.debs_dir(), print
    )
    make_merged_usr(root)
    for deb in selection.package_debs():
        unpack(deb, root)
    (root / "usr" / "bin" / "sh").unlink(missing_ok=True)
    (root / "usr" / "bin" / "sh").symlink_to("bash")
    python = root / "usr" / "bin" / "python3"
    if not python.exists():
        python.symlink_to(sorted(path.name for path in (root / "usr" / "bin").glob("python3.*"))[-1])
    etc = root / "etc"
    (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (etc / "group").write_text("root:x:0:\n")
    for folder in ("root", "tmp"):
        (root / folder).mkdir(exist_ok=True)
    (root / "tmp").chmod(0o1777)


def layer_of_tree(root: Path) -> bytes:
    """A layer tar of every file under ``root``, owned by root, with fixed times."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(root.rglob("*")):
            info = tar.gettarinfo(str(path), arcname=path.relative_to(root).as_posix())
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = EPOCH
            if info.isreg():
                with path.open("rb") as source:
                    tar.addfile(info, source)
            else:
                tar.addfile(info)
    return buffer.getvalue()


def layer_of_files(files: dict[str, str]) -> bytes:
    """A layer tar of text files (and their folders) given by path."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        folders = sorted({str(Path(name).parent) for name in files} - {"."})
        for folder in folders:
            info = tarfile.TarInfo(folder)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, EPOCH
            tar.addfile(info)
        for name, text in sorted(files.items()):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, EPOCH
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def write_oci_archive(path: Path, layers: list[bytes], *, working_dir: str, env: list[str], tag: str) -> None:
    """An OCI image (gzip layers, a linux/amd64 config) as an ``oci-archive`` tar, written atomically."""
    blobs: dict[str, bytes] = {}

    def blob(data: bytes) -> tuple[str, int]:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return digest, len(data)

    descriptors = []
    for layer in layers:
        digest, size = blob(gzip.compress(layer, compresslevel=6, mtime=0))
        descriptors.append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": digest, "size": size})
    config = {
        "created": "2023-11-14T22:13:20Z",
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": env, "WorkingDir": working_dir, "Cmd": ["bash"]},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest() for layer in layers]},
        # One history entry per layer: builders (podman, buildah) count them against the layers.
        "history": [{"created": "2023-11-14T22:13:20Z", "created_by": "make_images.py"} for _ in layers],
    }
    config_digest, config_size = blob(json.dumps(config, sort_keys=True).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": config_size,
        },
        "layers": descriptors,
    }
    manifest_digest, manifest_size = blob(json.dumps(manifest, sort_keys=True).encode())
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": manifest_digest,
                "size": manifest_size,
                "annotations": {"org.opencontainers.image.ref.name": tag},
            }
        ],
    }
    files = {
        "oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
        "index.json": json.dumps(index).encode(),
    }
    files.update({f"blobs/sha256/{digest.split(':')[1]}": data for digest, data in blobs.items()})
    temporary = path.with_name(f".{path.name}.partial")
    with tarfile.open(temporary, "w") as archive:
        for folder in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(folder)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, EPOCH
            archive.addfile(info)
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, EPOCH
            archive.addfile(info, io.BytesIO(data))
    os.replace(temporary, path)


def make_images(folder: Path = HERE) -> tuple[Path, Path]:
    """Write ``base.tar`` and ``calc-task.tar`` into ``folder``; their paths."""
    with tempfile.TemporaryDirectory(prefix="forkd-example-base-") as scratch:
        root = Path(scratch) / "root"
        root.mkdir()
        debian_root(root)
        base_layer = layer_of_tree(root)
    env = [f"PATH={PATH}"]
    base = folder / "base.tar"
    write_oci_archive(base, [base_layer], working_dir="/", env=env, tag="base")
    project = layer_of_files({"srv/project/calc.py": CALC, "srv/project/test_calc.py": TEST_CALC})
    task = folder / "calc-task.tar"
    write_oci_archive(task, [base_layer, project], working_dir="/srv/project", env=env, tag="calc-task")
    return base, task


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--output", type=Path, default=HERE, help="folder to write the archives to (default: here)")
    args = parser.parse_args(argv)
    args.output.mkdir(parents=True, exist_ok=True)
    base, task = make_images(args.output.resolve())
    print(f"export FORKD_EXAMPLE_BASE=oci-archive:{base}")
    print(f"export FORKD_EXAMPLE_TASK_IMAGE=oci-archive:{task}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
