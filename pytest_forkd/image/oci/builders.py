"""Building a Dockerfile with the host's podman, docker or buildah, into the local image store.

forkd does not build images itself: the user's builder does, with its own
cache, base image pulls and credentials. The first one installed is used, in
the order podman, docker, buildah; a docker client whose daemon cannot be
reached does not count. The built image is exported to an archive
(``podman save --format oci-archive``, ``docker save``, ``buildah push
oci-archive:``) and imported into the store as any other source, under the
reference ``dockerfile:/abs/path/Dockerfile``.

A Dockerfile is built again only when it may give another image: when the
Dockerfile, the build arguments or a file of the build context changed (size,
modification time, mode), or with the pull policy ``always``; ``never`` uses
the last build and never runs a builder.

Build arguments are passed on the builder's command line, as ``docker build
--build-arg`` does: they are not a place for secrets.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path

from ... import private
from ...errors import (
    ImageBuildError,
    ImageNotFound,
    ImageNotPulled,
    ImageStoreFull,
    ImageToolMissing,
    InvalidArgument,
)
from . import store
from .importer import import_image
from .reference import ImageReference
from .store import PulledImage, PullPolicy, check_policy

__all__ = ["BUILDERS", "available_builders", "build_dockerfile", "build_tag"]

BUILDERS = ("podman", "docker", "buildah")
DOCKERFILE_NAMES = ("Dockerfile", "Containerfile")
#: Lines of the builder's output an error quotes.
TAIL_LINES = 15
DAEMON_PROBE_TIMEOUT = 10
Progress = Callable[[str], None]


def _quiet(_line: str) -> None:
    return None


def _docker_daemon_reachable(docker: str) -> bool:
    """True when ``docker`` answers with a server version (a client alone cannot build)."""
    try:
        probe = subprocess.run(
            [docker, "version", "--format", "{{.Server.Version}}"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=DAEMON_PROBE_TIMEOUT,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0 and bool(probe.stdout.strip())


def available_builders() -> list[str]:
    """The builders found on this host, in the order they are preferred (podman, docker, buildah)."""
    found = []
    for name in BUILDERS:
        program = shutil.which(name)
        if program is None:
            continue
        if name == "docker" and not _docker_daemon_reachable(program):
            continue
        found.append(name)
    return found


def _dockerfile_path(dockerfile: Path) -> Path:
    dockerfile = Path(os.path.abspath(os.path.expanduser(dockerfile)))
    if dockerfile.is_dir():
        for name in DOCKERFILE_NAMES:
            if (dockerfile / name).is_file():
                return dockerfile / name
        raise ImageNotFound(f"{dockerfile} has no Dockerfile or Containerfile; name the file: dockerfile:PATH")
    if not dockerfile.is_file():
        raise ImageNotFound(f"dockerfile:{dockerfile}: no such file; check the path")
    return dockerfile


def build_stamp(dockerfile: Path, context: Path, args: Mapping[str, str]) -> str:
    """What a build depends on: the Dockerfile, the arguments and every file of the context (size, time, mode)."""
    digest = hashlib.sha256()
    digest.update(dockerfile.read_bytes())
    digest.update(f"\0context={context}\0".encode())
    for key in sorted(args):
        digest.update(f"arg {key}={args[key]}\0".encode())
    for folder, folders, files in os.walk(context):
        folders.sort()
        for name in sorted(files):
            path = os.path.join(folder, name)
            try:
                info = os.lstat(path)
            except OSError:
                continue
            relative = os.path.relpath(path, context)
            digest.update(f"{relative}\0{info.st_size}\0{info.st_mtime_ns}\0{info.st_mode}\0".encode())
    return "build:" + digest.hexdigest()


def build_tag(dockerfile: Path) -> str:
    """The builder's tag of the image built from ``dockerfile`` (kept, so that its cache serves the next build)."""
    key = str(ImageReference("dockerfile", str(_dockerfile_path(dockerfile))))
    return f"localhost/forkd-build/{hashlib.sha256(key.encode()).hexdigest()[:16]}:latest"


def build_dockerfile(
    dockerfile: Path,
    *,
    context: Path | None = None,
    args: Mapping[str, str] | None = None,
    policy: PullPolicy = "missing",
    progress: Progress | None = None,
    builder: str | None = None,
) -> PulledImage:
    """Build ``dockerfile`` (context: its folder unless given) and return the image in the local store.

    ``args`` are build arguments (``--build-arg``), ``builder`` forces one of
    :data:`BUILDERS`. A failing build raises ImageBuildError ending with the
    builder's last lines; with no builder, ImageToolMissing names the three.
    """
    check_policy(policy)
    progress = progress or _quiet
    args = dict(args or {})
    for key, value in args.items():
        if not isinstance(key, str) or not key or "=" in key or not isinstance(value, str):
            raise InvalidArgument(f"build argument {key!r}={value!r}: give NAME (no '=') and a text value")
    dockerfile = _dockerfile_path(dockerfile)
    context = Path(os.path.abspath(context)) if context is not None else dockerfile.parent
    if not context.is_dir():
        raise ImageNotFound(f"the build context {context} of {dockerfile} is not a folder; check the path")
    key = str(ImageReference("dockerfile", str(dockerfile)))
    stamp = build_stamp(dockerfile, context, args)
    if policy != "always":
        cached = store.lookup(key, stamp=None if policy == "never" else stamp)
        if cached is not None:
            return cached
        if policy == "never":
            raise ImageNotPulled(
                f"{key} was never built and the pull policy is 'never'; build it with `forkd image pull {key}`"
            )
    name = _choose_builder(builder, key)
    tag = build_tag(dockerfile)
    workdir = private.make_dir(store.store_dir() / "tmp")
    with tempfile.TemporaryDirectory(prefix="build-", dir=workdir) as scratch:
        archive = Path(scratch) / "image.tar"
        progress(f"building {key} with {name} (context {context})")
        _run_builder(_build_command(name, dockerfile, context, args, tag), key, name, progress, scratch)
        with store.disk_full_as_error(workdir, f"exporting the image built from {dockerfile}"):
            _run_builder(_export_command(name, tag, archive), key, name, progress, scratch, step="export")
        transport = "docker-archive" if name == "docker" else "oci-archive"
        return import_image(f"{transport}:{archive}", key, stamp=stamp, progress=progress)


def _choose_builder(forced: str | None, key: str) -> str:
    found = available_builders()
    if forced is not None:
        if forced not in BUILDERS:
            raise InvalidArgument(f"builder {forced!r} is not one of {', '.join(BUILDERS)}")
        if forced not in found:
            raise ImageToolMissing(f"building {key} with {forced}: {forced} is not installed or cannot build here")
        return forced
    if not found:
        raise ImageToolMissing(
            f"building {key} needs podman, docker or buildah, and none is installed (or docker's daemon is not "
            "reachable); install one (`apt-get install podman` or `apt-get install buildah`)"
        )
    return found[0]


def _build_command(name: str, dockerfile: Path, context: Path, args: Mapping[str, str], tag: str) -> list[str]:
    program = shutil.which(name) or name
    build_args = [word for key, value in args.items() for word in ("--build-arg", f"{key}={value}")]
    verb = ["bud"] if name == "buildah" else ["build"]
    return [program, *verb, "-f", str(dockerfile), "-t", tag, *build_args, str(context)]


def _export_command(name: str, tag: str, archive: Path) -> list[str]:
    program = shutil.which(name) or name
    if name == "podman":
        return [program, "save", "--quiet", "--format", "oci-archive", "-o", str(archive), tag]
    if name == "docker":
        return [program, "save", "-o", str(archive), tag]
    return [program, "push", "--quiet", tag, f"oci-archive:{archive}"]


def _run_builder(
    command: list[str], key: str, name: str, progress: Progress, scratch: str, *, step: str = "build"
) -> None:
    """Run a builder command, streaming its lines to ``progress``; a failure quotes its last lines."""
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    with private.private_umask():
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=scratch,
        )
    assert process.stdout is not None
    try:
        for raw in process.stdout:
            line = raw.decode(errors="replace").rstrip()
            if line:
                tail.append(line)
                if step == "build":
                    progress(f"building {key}: {line}")
        process.wait()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()
    if process.returncode != 0:
        last = tail[-1] if tail else "no output"
        details = "\n".join(tail)
        if "no space left on device" in details.lower():
            raise ImageStoreFull(f"{name} ran out of disk space during the {step} of {key}: {last}")
        raise ImageBuildError(
            f"{name} failed to {step} {key} (exit status {process.returncode}): {last}"
            f"\n--- last lines of {name} ---\n{details}"
        )
