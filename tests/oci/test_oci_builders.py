"""``dockerfile:`` references, built with the host's real podman (or buildah) and imported into the store.

The Dockerfiles start ``FROM scratch`` with the static busybox, since no base
image can be pulled from Docker Hub here; their RUN steps run in the builder's
real runtime (runc: see scripts/setup.sh --test-tools for the podman set-up).
"""

from __future__ import annotations

import gzip
import io
import os
import pwd
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import oci_images
import pytest
from registry import needs_registry

from pytest_forkd.errors import ImageBuildError, ImageNotPulled, ImageToolMissing
from pytest_forkd.image.oci import list_pulled, pull_image
from pytest_forkd.image.oci.builders import available_builders, build_dockerfile, build_tag
from pytest_forkd.image.oci.store import Layer

pytestmark = [pytest.mark.slow, needs_registry]

DOCKERFILE = """\
FROM scratch
COPY busybox /bin/busybox
RUN ["/bin/busybox", "--install", "-s", "/bin"]
ARG GREETING=hello
RUN echo "$GREETING from a RUN step" > /greeting && mkdir -p /app && chown 1000:1000 /app
COPY data.txt /app/data.txt
ENV BUILT_BY=forkd-tests
WORKDIR /app
USER 1000
CMD ["sh"]
"""


def builder_problem(name: str) -> str | None:
    """Why ``name`` cannot build here, or None."""
    if shutil.which(name) is None:
        return f"{name} is not installed (apt-get install {name}, or scripts/setup.sh --test-tools)"
    if os.getuid() != 0:
        user = pwd.getpwuid(os.getuid()).pw_name
        subuids = Path("/etc/subuid").read_text() if Path("/etc/subuid").exists() else ""
        if not any(line.split(":")[0] in (user, str(os.getuid())) for line in subuids.splitlines()):
            return f"rootless {name} needs an /etc/subuid entry for {user} (usermod --add-subuids)"
    info = subprocess.run([name, "info"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        last = (info.stderr.strip().splitlines() or ["no output"])[-1]
        return f"{name} is not configured on this host ({last}); see scripts/setup.sh --test-tools"
    return None


def context_folder(folder: Path, dockerfile: str = DOCKERFILE) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    busybox = folder / "busybox"
    busybox.write_bytes(oci_images.busybox_binary())
    busybox.chmod(0o755)
    (folder / "data.txt").write_text("from the build context\n")
    (folder / "Dockerfile").write_text(dockerfile)
    return folder / "Dockerfile"


@pytest.fixture(autouse=True)
def forget_builds(tmp_path: Path) -> Iterator[None]:
    """Remove the builders' tags of the Dockerfiles a test built (their storage is the host's, not the test's)."""
    yield
    for dockerfile in tmp_path.rglob("Dockerfile"):
        for builder in ("podman", "buildah"):
            if shutil.which(builder):
                subprocess.run([builder, "rmi", "-f", build_tag(dockerfile)], capture_output=True, timeout=120)


def file_in_layers(layers: tuple[Layer, ...], name: str) -> bytes | None:
    """The content of ``name`` in the topmost layer that has it (gzip or plain tar layers)."""
    for layer in reversed(layers):
        data = layer.path.read_bytes()
        if layer.media_type.endswith("gzip"):
            data = gzip.decompress(data)
        with tarfile.open(fileobj=io.BytesIO(data)) as archive:
            for member in archive:
                if member.name.lstrip("./") == name and member.isfile():
                    extracted = archive.extractfile(member)
                    assert extracted is not None
                    return extracted.read()
    return None


@pytest.mark.parametrize("builder", ["podman", "buildah"])
def test_a_dockerfile_is_built_with_its_context_and_arguments(builder: str, image_store: Path, tmp_path: Path) -> None:
    problem = builder_problem(builder)
    if problem:
        pytest.skip(problem)
    dockerfile = context_folder(tmp_path / "context")
    lines: list[str] = []
    image = build_dockerfile(dockerfile, args={"GREETING": "hi"}, builder=builder, progress=lines.append)

    assert image.reference == f"dockerfile:{dockerfile}"
    assert "BUILT_BY=forkd-tests" in image.config.env
    assert (image.config.working_dir, image.config.user, image.config.cmd) == ("/app", "1000", ("sh",))
    assert file_in_layers(image.layers, "greeting") == b"hi from a RUN step\n"
    assert file_in_layers(image.layers, "app/data.txt") == b"from the build context\n"
    assert any(f"with {builder}" in line for line in lines)
    assert [listed.reference for listed in list_pulled()] == [image.reference]

    # Unchanged: the store answers, no builder runs.
    again: list[str] = []
    assert build_dockerfile(dockerfile, args={"GREETING": "hi"}, builder=builder, progress=again.append) == image
    assert again == []
    # A changed context file builds again.
    (dockerfile.parent / "data.txt").write_text("changed\n")
    rebuilt = build_dockerfile(dockerfile, args={"GREETING": "hi"}, builder=builder)
    assert file_in_layers(rebuilt.layers, "app/data.txt") == b"changed\n"
    assert rebuilt.digest != image.digest


def test_dockerfile_references_go_through_pull_image(image_store: Path, tmp_path: Path) -> None:
    if not available_builders():
        pytest.skip("no builder installed (podman, docker or buildah)")
    problem = builder_problem(available_builders()[0])
    if problem:
        pytest.skip(problem)
    dockerfile = context_folder(tmp_path / "context")
    with pytest.raises(ImageNotPulled, match="never built"):
        pull_image(f"dockerfile:{dockerfile}", policy="never")
    image = pull_image(f"dockerfile:{dockerfile.parent}")  # a folder means its Dockerfile
    assert image.reference == f"dockerfile:{dockerfile}"
    assert file_in_layers(image.layers, "greeting") == b"hello from a RUN step\n"
    assert pull_image(f"dockerfile:{dockerfile}", policy="never") == image


def test_a_failing_build_quotes_the_builders_last_lines(image_store: Path, tmp_path: Path) -> None:
    if not available_builders():
        pytest.skip("no builder installed (podman, docker or buildah)")
    problem = builder_problem(available_builders()[0])
    if problem:
        pytest.skip(problem)
    dockerfile = context_folder(
        tmp_path / "context",
        'FROM scratch\nCOPY busybox /bin/busybox\nRUN ["/bin/busybox", "sh", "-c", "echo the-step-output; exit 3"]\n',
    )
    with pytest.raises(ImageBuildError) as caught:
        build_dockerfile(dockerfile)
    first, _, rest = str(caught.value).partition("\n")
    assert f"failed to build dockerfile:{dockerfile}" in first
    assert "the-step-output" in rest
    assert list_pulled() == []


def test_without_a_builder_one_error_names_the_three(
    image_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert available_builders() == []
    dockerfile = context_folder(tmp_path / "context")
    with pytest.raises(ImageToolMissing) as caught:
        build_dockerfile(dockerfile)
    message = str(caught.value)
    assert "podman, docker or buildah" in message and "\n" not in message


def test_a_docker_client_without_a_daemon_does_not_count() -> None:
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker client installed")
    daemon = subprocess.run([docker, "version", "--format", "{{.Server.Version}}"], capture_output=True, timeout=30)
    assert ("docker" in available_builders()) == (daemon.returncode == 0 and bool(daemon.stdout.strip()))
