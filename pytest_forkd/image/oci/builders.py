"""Building a Dockerfile with the host's podman, docker or buildah, into the local image store.

forkd does not build images itself: the user's builder does, with its own
cache, base image pulls and credentials. The first one installed is used, in
the order podman, docker, buildah; a docker client whose daemon cannot be
reached does not count. Podman and buildah run with a configuration that
works for the user running forkd (:mod:`.builder_config`). The built image is
exported to an archive (``podman save --format oci-archive``, ``docker
save``, ``buildah push oci-archive:``) and imported into the store as any
other source.

A build is stored under what it is built from: ``dockerfile:PATH@sha256:KEY``,
KEY hashing the Dockerfile, the files of the context the builder would send
(``.dockerignore`` applied as Docker applies it), the build arguments, the
target and the platform (:mod:`.build_context`). Two builds of one
Dockerfile with other arguments are two images, each served from the store
again while nothing it is made of changes; the pull policy ``always`` builds
again, ``never`` never runs a builder. Builds of one key are serialized
across processes (a file lock per key, with a line saying what is awaited).

What a build leaves in the builder's own storage: the built image, tagged
``localhost/forkd-build/<key>`` (so the builder's layer cache serves the
next build of a changed context), and the base images the builder pulled for
it. Both are recorded in the store, and ``forkd image prune`` removes them
(:mod:`.builder_storage`).

Build arguments are passed on the builder's command line, as ``docker build
--build-arg`` does: they are not a place for secrets.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Final

from filelock import Timeout

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
from .build_context import build_key
from .builder_config import builder_environment, builder_fix
from .builder_storage import build_lock, record_pulls, record_tag
from .importer import import_image
from .store import PulledImage, PullPolicy, check_policy

__all__ = [
    "BUILDERS",
    "available_builders",
    "build_dockerfile",
    "build_reference",
    "build_tag",
    "probe_builder",
]

BUILDERS: Final = ("podman", "docker", "buildah")
DOCKERFILE_NAMES: Final = ("Dockerfile", "Containerfile")
#: The builder-side name of every image forkd builds (``<prefix><key>:latest``).
TAG_PREFIX: Final = "localhost/forkd-build/"
#: The one platform forkd runs, and the names a build may give it.
PLATFORM: Final = "linux/amd64"
PLATFORM_NAMES: Final = frozenset({PLATFORM, "linux/x86_64", "amd64"})
#: Lines of the builder's output an error quotes.
TAIL_LINES: Final = 15
DAEMON_PROBE_TIMEOUT: Final = 10
PROBE_TIMEOUT: Final = 300
BUILDER_COMMAND_TIMEOUT: Final = 120
#: While another process builds the same key, a line says so this often (seconds).
LOCK_REPORT_S: Final = 30.0
#: How builders say they pulled a base image: podman/buildah, and docker's classic builder.
_PULLED: Final = (
    re.compile(r"^Trying to pull (\S+?)\.\.\.$"),
    re.compile(r"^Status: Downloaded newer image for (\S+)$"),
)
_TARGET: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
Progress = Callable[[str], None]


def _quiet(_line: str) -> None:
    return None


#: Whether docker's daemon answered, per client, and when it was asked: asked again after a minute.
_daemons: dict[str, tuple[bool, float]] = {}
DAEMON_ANSWER_TTL_S: Final = 60.0


def _docker_daemon_reachable(docker: str) -> bool:
    """True when ``docker`` answers with a server version (a client alone cannot build)."""
    known = _daemons.get(docker)
    if known is not None and time.monotonic() - known[1] < DAEMON_ANSWER_TTL_S:
        return known[0]
    reachable = _ask_docker_daemon(docker)
    _daemons[docker] = (reachable, time.monotonic())
    return reachable


def _ask_docker_daemon(docker: str) -> bool:
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


def build_reference(dockerfile: Path, key: str) -> str:
    """The store's reference of the build of ``dockerfile`` whose inputs hash to ``key``."""
    return f"dockerfile:{dockerfile}@sha256:{key}"


def build_tag(key: str) -> str:
    """The builder's tag of the image of build ``key`` (kept until ``forkd image prune``: its cache)."""
    return f"{TAG_PREFIX}{key[:16]}:latest"


def _check_inputs(args: Mapping[str, str], target: str | None, platform: str | None) -> str | None:
    for key, value in args.items():
        if not isinstance(key, str) or not key or "=" in key or not isinstance(value, str):
            raise InvalidArgument(f"build argument {key!r}={value!r}: give NAME (no '=') and a text value")
    if target is not None and (not isinstance(target, str) or not _TARGET.fullmatch(target)):
        raise InvalidArgument(f"build target {target!r}: give the name of a stage of the Dockerfile")
    if platform is None:
        return None
    if platform not in PLATFORM_NAMES:
        raise InvalidArgument(f"build platform {platform!r}: forkd runs {PLATFORM} images only")
    return PLATFORM


def build_dockerfile(
    dockerfile: Path,
    *,
    context: Path | None = None,
    args: Mapping[str, str] | None = None,
    target: str | None = None,
    platform: str | None = None,
    policy: PullPolicy = "missing",
    progress: Progress | None = None,
    builder: str | None = None,
    pinned: str | None = None,
) -> PulledImage:
    """Build ``dockerfile`` (context: its folder unless given) and return the image in the local store.

    ``args`` are build arguments (``--build-arg``), ``target`` the stage to
    build, ``platform`` must be linux/amd64 when given, ``builder`` forces one
    of :data:`BUILDERS`. ``pinned`` (``sha256:KEY``, from a reference
    ``dockerfile:PATH@sha256:KEY``) asks for that stored build. A failing
    build raises ImageBuildError ending with the builder's last lines; with
    no builder, ImageToolMissing names the three.
    """
    check_policy(policy)
    progress = progress or _quiet
    args = dict(args or {})
    platform = _check_inputs(args, target, platform)
    dockerfile = _dockerfile_path(dockerfile)
    context = Path(os.path.abspath(context)) if context is not None else dockerfile.parent
    if not context.is_dir():
        raise ImageNotFound(f"the build context {context} of {dockerfile} is not a folder; check the path")
    plain = f"dockerfile:{dockerfile}"
    if pinned is not None:
        stored = store.lookup(f"{plain}@{pinned}")
        if stored is not None and policy != "always":
            return stored
    elif policy == "never":
        return _stored_build(dockerfile, plain, args, target, platform, context, builder)
    key_builder = builder or next(iter(available_builders()), "podman")
    key = _key(dockerfile, context, args, target, platform, key_builder)
    if pinned is not None and (pinned != f"sha256:{key}" or policy == "never"):
        raise ImageNotPulled(
            f"{plain}@{pinned} is a build the store no longer has (of {dockerfile} with inputs other than its "
            "folder's now, or the pull policy is 'never'); build it again from what names those inputs "
            "(the compose file)"
        )
    reference = build_reference(dockerfile, key)
    if policy != "always":
        cached = store.lookup(reference)
        if cached is not None:
            return cached
    with _build_lock(key, plain, progress) as waited:
        if waited:
            cached = store.lookup(reference)  # built by the process we waited for
            if cached is not None:
                return cached
        name = _choose_builder(builder, plain)
        if name != key_builder:  # the builder forced or found differs: its ignore file may too
            key = _key(dockerfile, context, args, target, platform, name)
            reference = build_reference(dockerfile, key)
        return _build(name, dockerfile, context, args, target, platform, key, reference, progress)


def _stored_build(
    dockerfile: Path,
    plain: str,
    args: Mapping[str, str],
    target: str | None,
    platform: str | None,
    context: Path,
    builder: str | None,
) -> PulledImage:
    """Pull policy ``never``: the stored build of these inputs, else (inputs not given) the newest of the Dockerfile."""
    key_builder = builder or next(iter(available_builders()), "podman")
    key = _key(dockerfile, context, args, target, platform, key_builder)
    exact = store.lookup(build_reference(dockerfile, key))
    if exact is not None:
        return exact
    if not args and target is None and platform is None:
        builds = [entry for name, entry in store.read_index().items() if name.startswith(f"{plain}@")]
        for entry in sorted(builds, key=lambda entry: entry.get("pulled_unix", 0), reverse=True):
            found = store.lookup(str(entry["reference"]))
            if found is not None:
                return found
    raise ImageNotPulled(
        f"{plain} was never built with these inputs and the pull policy is 'never'; "
        f"build it with `forkd image pull {plain}` or use the pull policy 'missing'"
    )


def _key(
    dockerfile: Path, context: Path, args: Mapping[str, str], target: str | None, platform: str | None, builder: str
) -> str:
    """The build's key; a context file forkd cannot read is ImageNotFound naming it (the builder could not either)."""
    try:
        return build_key(dockerfile, context, args=args, target=target, platform=platform, builder=builder)
    except OSError as exc:
        where = exc.filename or context
        raise ImageNotFound(
            f"cannot read {where} of the build context {context} of dockerfile:{dockerfile} "
            f"({exc.strerror or exc}); make it readable or exclude it in .dockerignore"
        ) from None


@contextmanager
def _build_lock(key: str, plain: str, progress: Progress) -> Iterator[bool]:
    """Hold build ``key``'s lock (another process's build of it first ends); yields whether we had to wait."""
    lock = build_lock(key)
    waited = False
    try:
        lock.acquire(timeout=0)
    except Timeout:
        waited = True
        progress(f"waiting for another process's build of {plain} (the same Dockerfile, context and arguments)")
        while True:
            try:
                lock.acquire(timeout=LOCK_REPORT_S)
                break
            except Timeout:
                progress(f"still waiting for another process's build of {plain}")
    try:
        yield waited
    finally:
        lock.release()


def _build(
    name: str,
    dockerfile: Path,
    context: Path,
    args: Mapping[str, str],
    target: str | None,
    platform: str | None,
    key: str,
    reference: str,
    progress: Progress,
) -> PulledImage:
    tag = build_tag(key)
    workdir = private.make_dir(store.store_dir() / "tmp")
    pulled: list[str] = []
    with tempfile.TemporaryDirectory(prefix="build-", dir=workdir) as scratch:
        archive = Path(scratch) / "image.tar"
        progress(f"building dockerfile:{dockerfile} with {name} (context {context}, key {key[:12]})")
        command = _build_command(name, dockerfile, context, args, tag, target=target, platform=platform)
        record_tag(name, tag, key)  # before it exists: a killed build's tag is pruned too
        try:
            _run_builder(command, dockerfile, name, progress, scratch, pulled=pulled)
        finally:
            record_pulls(name, pulled)
        with store.disk_full_as_error(workdir, f"exporting the image built from {dockerfile}"):
            _run_builder(_export_command(name, tag, archive), dockerfile, name, progress, scratch, step="export")
        transport = "docker-archive" if name == "docker" else "oci-archive"
        image = import_image(f"{transport}:{archive}", reference)
    progress(f"built {image.digest[:19]} ({len(image.layers)} layers, {image.size / 2**20:.1f} MiB)")
    return image


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


def _build_command(
    name: str,
    dockerfile: Path,
    context: Path,
    args: Mapping[str, str],
    tag: str,
    *,
    target: str | None = None,
    platform: str | None = None,
    no_cache: bool = False,
) -> list[str]:
    program = shutil.which(name) or name
    options = [word for key, value in args.items() for word in ("--build-arg", f"{key}={value}")]
    if target is not None:
        options += ["--target", target]
    if platform is not None:
        options += ["--platform", platform]
    if no_cache:
        options.append("--no-cache")
    verb = ["bud"] if name == "buildah" else ["build"]
    return [program, *verb, "-f", str(dockerfile), "-t", tag, *options, str(context)]


def _export_command(name: str, tag: str, archive: Path) -> list[str]:
    program = shutil.which(name) or name
    if name == "podman":
        return [program, "save", "--quiet", "--format", "oci-archive", "-o", str(archive), tag]
    if name == "docker":
        return [program, "save", "-o", str(archive), tag]
    return [program, "push", "--quiet", tag, f"oci-archive:{archive}"]


def _run_builder(
    command: list[str],
    dockerfile: Path,
    name: str,
    progress: Progress,
    scratch: str,
    *,
    step: str = "build",
    pulled: list[str] | None = None,
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
            env=builder_environment(name),
        )
    assert process.stdout is not None
    try:
        for raw in process.stdout:
            line = raw.decode(errors="replace").rstrip()
            if line:
                tail.append(line)
                if step == "build":
                    progress(f"{name}: {line}")
                if pulled is not None:
                    pulled.extend(match.group(1) for match in (pattern.match(line) for pattern in _PULLED) if match)
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
            raise ImageStoreFull(f"{name} ran out of disk space during the {step} of dockerfile:{dockerfile}: {last}")
        raise ImageBuildError(
            f"{name} failed to {step} dockerfile:{dockerfile} (exit status {process.returncode}): {last}"
            f"\n--- last lines of {name} ---\n{details}\nfix: {builder_fix(name, details)}"
        )


# -- can a builder run a RUN step here? ---------------------------------------------------------------------------


def probe_program() -> bytes:
    """A 129-byte static x86-64 Linux program that exits 0: ``RUN`` it in an image ``FROM scratch``.

    An ELF header, one loadable segment, and ``xor edi, edi; mov eax, 60
    (exit); syscall``: no base image to pull, nothing to download.
    """
    base, header_size, segment_size = 0x400000, 64, 56
    code = bytes([0x31, 0xFF, 0xB8, 0x3C, 0x00, 0x00, 0x00, 0x0F, 0x05])
    total = header_size + segment_size + len(code)
    ident = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)  # 64-bit, little-endian, version 1, System V
    header = ident + struct.pack(
        "<HHIQQQIHHHHHH", 2, 0x3E, 1, base + header_size + segment_size, header_size, 0, 0, header_size,
        segment_size, 1, 0, 0, 0,
    )  # fmt: skip
    segment = struct.pack("<IIQQQQQQ", 1, 5, 0, base, base, total, total, 0x1000)  # PT_LOAD, read + execute
    return header + segment + code


def probe_builder(name: str) -> str | None:
    """Build ``FROM scratch`` with one ``RUN`` step with builder ``name``: None if it works, else its last line."""
    program = shutil.which(name)
    if program is None:
        return f"{name} is not installed"
    with tempfile.TemporaryDirectory(prefix="forkd-probe-") as folder:
        context = Path(folder)
        (context / "true").write_bytes(probe_program())
        (context / "true").chmod(0o755)
        (context / "Dockerfile").write_text('FROM scratch\nCOPY true /true\nRUN ["/true"]\n')
        tag = f"{TAG_PREFIX}probe-{os.getpid()}:latest"
        command = _build_command(name, context / "Dockerfile", context, {}, tag, no_cache=True)
        environ = builder_environment(name)
        try:
            result = subprocess.run(
                command,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=PROBE_TIMEOUT,
                cwd=folder,
                env=environ,
            )
        except subprocess.TimeoutExpired:
            return f"a one-line RUN build did not finish in {PROBE_TIMEOUT} s"
        except OSError as exc:
            return f"cannot run {name}: {exc.strerror or exc}"
        finally:
            subprocess.run(
                [program, "rmi", tag], stdin=subprocess.DEVNULL, capture_output=True, timeout=60, env=environ
            )
    if result.returncode == 0:
        return None
    lines = [line.strip() for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    return lines[-1] if lines else f"{name} build exited with status {result.returncode}"
