"""``dockerfile:`` references, built with the host's real podman (or buildah) and imported into the store.

The Dockerfiles start ``FROM scratch`` with the static busybox (or FROM the
tests' registry), since no base image can be pulled from Docker Hub here;
their RUN steps run in the builder's real runtime (runc: see
scripts/setup.sh --test-tools for the podman set-up). Builds are keyed by
what they are built from (one Dockerfile with two arguments is two images),
serialized per key across processes, and what they leave in the builder's
storage is removed by ``forkd image prune``. As a normal user, podman runs
through the configuration forkd writes where crun cannot run (a fake crun
stands in for the broken one).
"""

from __future__ import annotations

import gzip
import io
import json
import os
import pwd
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import oci_images
import pytest
from registry import needs_registry

from pytest_forkd.cli import doctor_cmd, main
from pytest_forkd.errors import ImageBuildError, ImageNotPulled, ImageToolMissing
from pytest_forkd.image.oci import builder_config, list_pulled, pull_image
from pytest_forkd.image.oci.builder_storage import leftovers, remove_leftovers
from pytest_forkd.image.oci.builders import available_builders, build_dockerfile, build_tag, probe_builder
from pytest_forkd.image.oci.prune import prune_store
from pytest_forkd.image.oci.store import Layer, PulledImage

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


def key_of(image: PulledImage) -> str:
    """The build key in a build's reference ``dockerfile:PATH@sha256:KEY``."""
    return image.reference.rpartition("@sha256:")[2]


@pytest.fixture(autouse=True)
def forget_builds(image_store: Path) -> Iterator[None]:
    """Remove the builders' tags of what a test built (their storage is the host's, not the test's store)."""
    yield
    keys = [key_of(image) for image in list_pulled() if "@sha256:" in image.reference]
    for key in keys:
        for builder in ("podman", "buildah"):
            if shutil.which(builder):
                subprocess.run([builder, "rmi", "-f", build_tag(key)], capture_output=True, timeout=120)


def usable_builder() -> str:
    if not available_builders():
        pytest.skip("no builder installed (podman, docker or buildah)")
    builder = available_builders()[0]
    problem = builder_problem(builder)
    if problem:
        pytest.skip(problem)
    return builder


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

    assert image.reference.startswith(f"dockerfile:{dockerfile}@sha256:")
    assert "BUILT_BY=forkd-tests" in image.config.env
    assert (image.config.working_dir, image.config.user, image.config.cmd) == ("/app", "1000", ("sh",))
    assert file_in_layers(image.layers, "greeting") == b"hi from a RUN step\n"
    assert file_in_layers(image.layers, "app/data.txt") == b"from the build context\n"
    assert any(f"with {builder}" in line for line in lines)
    # The Dockerfile is named once: in the first line, not again in every line of the builder.
    assert sum(str(dockerfile) in line for line in lines) == 1, lines
    assert any(line.startswith(f"{builder}: ") for line in lines)
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
    usable_builder()
    dockerfile = context_folder(tmp_path / "context")
    with pytest.raises(ImageNotPulled, match="never built"):
        pull_image(f"dockerfile:{dockerfile}", policy="never")
    image = pull_image(f"dockerfile:{dockerfile.parent}")  # a folder means its Dockerfile
    assert image.reference == f"dockerfile:{dockerfile}@sha256:{key_of(image)}"
    assert file_in_layers(image.layers, "greeting") == b"hello from a RUN step\n"
    assert pull_image(f"dockerfile:{dockerfile}", policy="never") == image
    assert pull_image(image.reference, policy="never") == image  # the build itself, by its key


ARGS_DOCKERFILE = """\
FROM scratch
COPY busybox /bin/busybox
ARG V=unset
RUN ["/bin/busybox", "sh", "-c", "echo $V > /v"]
"""


def test_one_dockerfile_with_two_arguments_is_two_images_each_kept(image_store: Path, tmp_path: Path) -> None:
    builder = usable_builder()
    dockerfile = context_folder(tmp_path / "context", ARGS_DOCKERFILE)
    lines: list[str] = []
    one = build_dockerfile(dockerfile, args={"V": "1"}, builder=builder, progress=lines.append)
    two = build_dockerfile(dockerfile, args={"V": "2"}, builder=builder, progress=lines.append)
    assert (file_in_layers(one.layers, "v"), file_in_layers(two.layers, "v")) == (b"1\n", b"2\n")
    assert one.digest != two.digest and one.reference != two.reference
    # V=1 again: its own image, from the store, without running the builder.
    again: list[str] = []
    assert build_dockerfile(dockerfile, args={"V": "1"}, builder=builder, progress=again.append) == one
    assert again == []
    assert sorted(image.reference for image in list_pulled()) == sorted([one.reference, two.reference])
    # A target or a platform is part of what is built, too.
    targeted = build_dockerfile(dockerfile, args={"V": "1"}, platform="linux/amd64", builder=builder)
    assert targeted.reference != one.reference


def test_what_dockerignore_excludes_builds_nothing_again(image_store: Path, tmp_path: Path) -> None:
    builder = usable_builder()
    dockerfile = context_folder(tmp_path / "task", "FROM scratch\nCOPY . /task\n")
    task = dockerfile.parent
    (task / ".dockerignore").write_text("# Inspect writes its logs beside the task\nlogs/\n**/*.pyc\n!keep.pyc\n")
    (task / "logs").mkdir()
    (task / "logs" / "2026-01-01.eval").write_text("{}")
    first = build_dockerfile(dockerfile, builder=builder)
    assert file_in_layers(first.layers, "task/logs/2026-01-01.eval") is None
    # Inspect writes another log, and Python a .pyc: both excluded, so the store answers, no builder runs.
    (task / "logs" / "2026-01-02.eval").write_text("{}")
    (task / "cache.pyc").write_bytes(b"x")
    lines: list[str] = []
    assert build_dockerfile(dockerfile, builder=builder, progress=lines.append) == first
    assert lines == []
    # The exception brings keep.pyc back: a change there builds again.
    (task / "keep.pyc").write_bytes(b"kept")
    rebuilt = build_dockerfile(dockerfile, builder=builder)
    assert rebuilt.reference != first.reference and file_in_layers(rebuilt.layers, "task/keep.pyc") == b"kept"


BUILD_SCRIPT = """\
import json, sys
from pathlib import Path
from pytest_forkd.image.oci.builders import build_dockerfile

lines = []
image = build_dockerfile(Path(sys.argv[1]), builder=sys.argv[2], progress=lines.append)
print(json.dumps({"digest": image.digest, "lines": lines}))
"""


def test_two_processes_building_one_key_build_it_once(image_store: Path, tmp_path: Path) -> None:
    builder = usable_builder()
    dockerfile = context_folder(
        tmp_path / "context", 'FROM scratch\nCOPY busybox /bin/busybox\nRUN ["/bin/busybox", "sleep", "3"]\n'
    )
    script = tmp_path / "build.py"
    script.write_text(BUILD_SCRIPT)
    environ = {**os.environ, "FORKD_CACHE_DIR": str(image_store.parent)}
    first = subprocess.Popen(
        [sys.executable, str(script), str(dockerfile), builder], stdout=subprocess.PIPE, text=True, env=environ
    )
    time.sleep(0.5)  # the first most likely holds the build's lock by now; either way one waits for the other
    second = subprocess.Popen(
        [sys.executable, str(script), str(dockerfile), builder], stdout=subprocess.PIPE, text=True, env=environ
    )
    results = [json.loads(process.communicate(timeout=600)[0]) for process in (first, second)]
    assert first.returncode == second.returncode == 0
    assert results[0]["digest"] == results[1]["digest"]
    building = [any(line.startswith("building ") for line in result["lines"]) for result in results]
    assert sorted(building) == [False, True], results  # one build; the other waited, then took it from the store
    waited = results[building.index(False)]["lines"]
    assert any("waiting for another process's build" in line for line in waited), waited
    assert len(list_pulled()) == 1


@pytest.fixture
def private_builder_storage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A builder storage of the test's own (podman and buildah read CONTAINERS_STORAGE_CONF).

    Rootless podman whose database already names another storage keeps that one, so a test does not
    count on being alone in it.
    """
    root = tmp_path / "containers"
    conf = tmp_path / "storage.conf"
    conf.write_text(f'[storage]\ndriver = "vfs"\ngraphroot = "{root}/storage"\nrunroot = "{root}/run"\n')
    monkeypatch.setenv("CONTAINERS_STORAGE_CONF", str(conf))
    return root


def test_prune_removes_the_builds_tags_and_the_bases_they_pulled(
    image_store: Path,
    tmp_path: Path,
    busybox_image: str,
    private_builder_storage: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    builder = usable_builder()
    if builder == "docker":
        pytest.skip("docker's BuildKit keeps its bases in its own cache, not as images")
    base = busybox_image.removeprefix("docker://")
    dockerfile = tmp_path / "context" / "Dockerfile"
    dockerfile.parent.mkdir()
    dockerfile.write_text(f"FROM {base}\nRUN echo pruned > /marker\n")
    image = build_dockerfile(dockerfile, builder=builder)
    left = {(leftover.image, leftover.key) for leftover in leftovers()}
    assert left == {(build_tag(key_of(image)), key_of(image)), (base, None)}, left  # its tag, and the base it pulled
    assert {leftover.image for leftover in remove_leftovers(dry_run=True)} == {image for image, _key in left}
    assert main(["image", "prune", "--store", str(tmp_path / "snapshots")]) == 0
    printed = capsys.readouterr().out
    for name, _key in left:
        assert f"removed {name} from {builder}'s storage" in printed, printed
    assert leftovers() == []
    # Its own names are gone. (Rootless podman keeps the storage its database first recorded, whatever
    # CONTAINERS_STORAGE_CONF says, so other tests' builds may be listed beside them: not this test's.)
    names = subprocess.run([builder, "images", "--format", "{{.Repository}}"], capture_output=True, text=True)
    listed = set(names.stdout.split())
    assert names.returncode == 0, names
    assert not {name.rsplit(":", 1)[0] for name, _key in left} & listed, (left, listed)
    assert list_pulled() == [image]  # the store keeps the image itself


def test_prune_leaves_what_other_stores_builds_made(
    image_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, private_builder_storage: Path
) -> None:
    builder = usable_builder()
    dockerfile = context_folder(tmp_path / "context", "FROM scratch\nCOPY data.txt /data.txt\n")
    image = build_dockerfile(dockerfile, builder=builder)
    (tmp_path / "another-cache" / "oci").mkdir(parents=True)
    monkeypatch.setenv("FORKD_CACHE_DIR", str(tmp_path / "another-cache"))  # another store: its prune is its own
    assert prune_store(dry_run=False).builder_images == []
    monkeypatch.setenv("FORKD_CACHE_DIR", str(image_store.parent))
    assert [leftover.image for leftover in leftovers()] == [build_tag(key_of(image))]


def test_a_failing_build_quotes_the_builders_last_lines(image_store: Path, tmp_path: Path) -> None:
    usable_builder()
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


# -- can a builder run a RUN step here? (forkd doctor) ----------------------------------------------------------

FAILING_PODMAN = """\
#!/bin/sh
case "$1" in
  build) echo 'STEP 3/3: RUN ["/true"]'; echo 'Error: crun: cgroups in hybrid mode not supported, use cgroupfs' >&2; exit 1;;
  info) exit 1;;
  *) exit 0;;
esac
"""


def test_doctor_tries_a_run_step_with_each_builder_and_gives_the_fix_when_it_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "bin" / "podman"
    fake.parent.mkdir()
    fake.write_text(FAILING_PODMAN)
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:/usr/sbin:/sbin")  # the fake podman, and runc if installed
    monkeypatch.setattr(builder_config, "_decided", {})
    assert probe_builder("podman") == "Error: crun: cgroups in hybrid mode not supported, use cgroupfs"
    [check] = doctor_cmd._check_builders()
    assert (check.name, check.ok, check.mark) == ("builder podman", False, "warn")
    assert "a one-line RUN build fails: Error: crun: cgroups in hybrid mode" in check.detail
    if shutil.which("runc"):
        assert 'runtime = "runc"' in check.fix and "CONTAINERS_CONF" in check.fix, check.fix
    else:
        assert "apt-get install runc" in check.fix, check.fix


def test_doctor_says_the_real_builders_run_a_run_step() -> None:
    builder = usable_builder()
    assert probe_builder(builder) is None
    checks = {check.name: check for check in doctor_cmd._check_builders()}
    assert checks[f"builder {builder}"].ok, checks
    assert checks[f"builder {builder}"].detail == "builds dockerfile: images; a RUN step works"


FAKE_CRUN = """\
#!/bin/sh
if [ "$1" = "--version" ]; then echo "crun version 1.8.1"; echo "commit: fake"; exit 0; fi
echo "cgroups in hybrid mode not supported, use cgroupfs" >&2
exit 1
"""


def test_a_normal_user_whose_podman_runs_crun_builds_through_forkds_configuration(
    image_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """crun refuses this host's hybrid cgroups: forkd's own CONTAINERS_CONF (runc, cgroupfs) makes builds work."""
    if os.getuid() == 0:
        pytest.skip("root's podman reads only the system's containers.conf; this is a normal user's case")
    if shutil.which("runc") is None:
        pytest.skip("needs runc (apt-get install runc)")
    usable_builder()
    crun = tmp_path / "bin" / "crun"  # a crun that fails as the real one does on this host's cgroups
    crun.parent.mkdir()
    crun.write_text(FAKE_CRUN)
    crun.chmod(0o755)
    user_conf = tmp_path / "config" / "containers" / "containers.conf"
    user_conf.parent.mkdir(parents=True)
    user_conf.write_text(f'[engine]\nruntime = "crun"\n\n[engine.runtimes]\ncrun = ["{crun}"]\n')
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("CONTAINERS_CONF", raising=False)
    monkeypatch.setattr(builder_config, "_decided", {})
    facts = builder_config.runtime_facts("podman")
    if facts is None or facts[1] != "v1":
        pytest.skip(f"this host's cgroups are not v1 or hybrid ({facts}): crun works here")
    assert facts == ("crun", "v1")
    dockerfile = context_folder(tmp_path / "context")
    # The user's own configuration cannot run a RUN step...
    control = subprocess.run(
        ["podman", "build", "--no-cache", "-t", "localhost/forkd-tests/control", str(dockerfile.parent)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert control.returncode != 0 and "hybrid mode not supported" in control.stdout + control.stderr
    # ...forkd's builds can, through the configuration it writes under its cache.
    image = build_dockerfile(dockerfile, args={"GREETING": "rootless"}, builder="podman")
    assert file_in_layers(image.layers, "greeting") == b"rootless from a RUN step\n"
    written = image_store / "containers.conf"
    assert 'runtime = "runc"' in written.read_text() and (written.stat().st_mode & 0o777) == 0o600
    assert probe_builder("podman") is None
    # A CONTAINERS_CONF the user set is theirs: forkd leaves it alone.
    monkeypatch.setenv("CONTAINERS_CONF", str(user_conf))
    assert builder_config.builder_environment("podman")["CONTAINERS_CONF"] == str(user_conf)
