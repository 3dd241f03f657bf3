"""Pulling container images from a real registry (docker-registry on 127.0.0.1) with the real skopeo.

No VM: these check what lands in the local store and what is refused, with
images the tests make themselves (tests/oci_images.py) and push with skopeo.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import site
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import oci_images
import pytest
from oci_images import LayerTar, push, skopeo_env, write_layout
from registry import PASSWORD, USER, Registry, needs_registry

from pytest_forkd.errors import (
    DigestMismatch,
    ImageNotFound,
    ImageNotPulled,
    NoMatchingPlatform,
    RegistryAuthRequired,
    RegistryUnreachable,
)
from pytest_forkd.image.oci import importer, list_pulled, pull_image, store

pytestmark = [pytest.mark.slow, needs_registry]


def sha256_of(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def small_image(
    layout: Path, text: str, *, tag: str = "1", platforms: list[str] | None = None
) -> oci_images.WrittenImage:
    return write_layout(layout, [(LayerTar().file("hello.txt", text), "gzip")], tag=tag, platforms=platforms)


def assert_nothing_listed_for(reference: str) -> None:
    assert all(image.reference != reference for image in list_pulled())
    assert reference not in store.read_index()


def test_pull_by_tag_stores_verified_layers_and_the_config(
    registry: Registry, busybox_image: str, image_store: Path
) -> None:
    lines: list[str] = []
    image = pull_image(busybox_image, progress=lines.append)

    assert image.reference == busybox_image
    facts = oci_images.BUSYBOX_FACTS
    assert image.config.env[1:] == facts["env"]
    assert image.config.working_dir == facts["working_dir"]
    assert image.config.cmd == ("sh",)
    assert [layer.media_type.rsplit(".", 1)[-1] for layer in image.layers] == ["tar+gzip", "tar+zstd", "tar+gzip"]
    for layer in image.layers:
        assert layer.path.parent == image_store / "layout" / "blobs" / "sha256"
        assert sha256_of(layer.path) == layer.digest
        assert layer.path.stat().st_size == layer.size
    assert sha256_of(store.blob_path(image.digest)) == image.digest
    assert image.size == sum(layer.size for layer in image.layers)
    assert [listed.reference for listed in list_pulled()] == [busybox_image]
    # Progress: bytes done of the total, per layer.
    assert any("layer sha256:" in line and " of " in line and "MiB" in line for line in lines), lines
    # The store is private, as the rest of the cache.
    from pytest_forkd.private import exposed

    assert exposed(image_store) == []


def test_a_second_pull_uses_the_store_without_the_registry(
    private_registry: Registry, image_store: Path, tmp_path: Path
) -> None:
    reference = private_registry.reference("cached/image:1")
    push(small_image(tmp_path / "layout", "cached"), reference)
    first = pull_image(reference)
    with private_registry.stopped():
        assert pull_image(reference) == first  # policy missing: no network at all
        assert pull_image(reference, policy="never") == first
        with pytest.raises(RegistryUnreachable) as caught:
            pull_image(reference, policy="always")
        assert private_registry.host in str(caught.value)
        assert "\n" not in str(caught.value)
    assert pull_image(reference, policy="always").digest == first.digest


def test_always_follows_a_moved_tag_and_never_does_not_fetch(
    registry: Registry, image_store: Path, tmp_path: Path
) -> None:
    reference = registry.reference("moving/tag:1")
    push(small_image(tmp_path / "one", "first"), reference)
    first = pull_image(reference)
    push(small_image(tmp_path / "two", "second"), reference)
    assert pull_image(reference).digest == first.digest  # missing: the cached one
    moved = pull_image(reference, policy="always")
    assert moved.digest != first.digest
    assert pull_image(reference, policy="never").digest == moved.digest
    with pytest.raises(ImageNotPulled, match="pull policy is 'never'"):
        pull_image(registry.reference("moving/other:1"), policy="never")


def test_pull_by_digest(registry: Registry, image_store: Path, tmp_path: Path) -> None:
    written = small_image(tmp_path / "layout", "pinned")
    push(written, registry.reference("pinned/image:1"))
    image = pull_image(f"{registry.host}/pinned/image@{written.digest}")
    assert image.digest == written.digest
    assert image.reference == registry.reference(f"pinned/image@{written.digest}")
    wrong = "sha256:" + "0" * 64
    with pytest.raises(ImageNotFound):
        pull_image(f"{registry.host}/pinned/image@{wrong}")


def test_a_manifest_list_resolves_to_linux_amd64(registry: Registry, image_store: Path, tmp_path: Path) -> None:
    written = small_image(tmp_path / "layout", "multi", platforms=["linux/arm64/v8", "linux/amd64", "linux/s390x"])
    push(written, registry.reference("multi/arch:1"))
    image = pull_image(registry.reference("multi/arch:1"))
    assert image.digest == written.manifests["linux/amd64"]
    assert image.source_digest == written.manifests["linux/amd64"]


def test_an_image_without_amd64_names_the_platforms_it_offers(
    registry: Registry, image_store: Path, tmp_path: Path
) -> None:
    written = small_image(tmp_path / "layout", "arm", platforms=["linux/arm64", "linux/arm/v7"])
    reference = registry.reference("arm/only:1")
    push(written, reference)
    with pytest.raises(NoMatchingPlatform) as caught:
        pull_image(reference)
    message = str(caught.value)
    assert "no linux/amd64 image" in message and "linux/arm64" in message and "linux/arm/v7" in message
    assert caught.value.platforms == ["linux/arm/v7", "linux/arm64"]
    assert_nothing_listed_for(reference)


def test_unknown_tag_and_repository(registry: Registry, busybox_image: str, image_store: Path) -> None:
    for name in ("forkd-tests/busybox:no-such-tag", "forkd-tests/no-such-repository:1"):
        with pytest.raises(ImageNotFound) as caught:
            pull_image(registry.reference(name))
        assert "no such repository or tag" in str(caught.value) and "\n" not in str(caught.value)
        assert_nothing_listed_for(registry.reference(name))


def test_a_registry_that_is_down_is_named(image_store: Path) -> None:
    from registry import free_port

    host = f"127.0.0.1:{free_port()}"
    with pytest.raises(RegistryUnreachable) as caught:
        pull_image(f"docker://{host}/some/image:1")
    assert f"registry {host} is unreachable" in str(caught.value)


def test_a_tampered_layer_is_refused_and_nothing_is_listed(
    private_registry: Registry, image_store: Path, tmp_path: Path
) -> None:
    written = write_layout(
        tmp_path / "layout",
        [(LayerTar().file("a.txt", "x" * 10000), "gzip"), (LayerTar().file("b.txt", "y" * 10000), "gzip")],
        tag="1",
    )
    reference = private_registry.reference("tampered/image:1")
    push(written, reference)
    victim = written.layer_digests[1]
    blob = private_registry.blob_file(victim)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other content
    blob.write_bytes(bytes(data))

    with pytest.raises(DigestMismatch) as caught:
        pull_image(reference)
    assert victim in str(caught.value)
    assert_nothing_listed_for(reference)
    assert not store.blob_path(victim).exists()
    assert not list((image_store / "layout").glob("oci-put-blob*"))

    # A good pull still works afterwards.
    good = private_registry.reference("good/image:1")
    push(small_image(tmp_path / "good", "good"), good)
    assert pull_image(good).reference == good


def test_a_damaged_blob_in_the_store_is_caught_and_copied_again(
    registry: Registry, image_store: Path, tmp_path: Path
) -> None:
    reference = registry.reference("store/tamper:1")
    written = small_image(tmp_path / "layout", "store tamper " * 1000)
    push(written, reference)
    image = pull_image(reference)
    layer = written.layer_digests[0]
    blob = store.blob_path(layer)
    good = blob.read_bytes()
    damaged = bytearray(good)
    damaged[-10] ^= 0xFF
    blob.write_bytes(bytes(damaged))
    with pytest.raises(DigestMismatch, match=layer):
        store.verify(image)  # what a disk build calls before it reads the layers
    assert not blob.exists()  # removed, so that no later copy reuses it

    blob.write_bytes(bytes(damaged))
    # skopeo would reuse a blob the layout already has; forkd's own hash catches it and copies it again.
    assert pull_image(reference, policy="always").layers[0].digest == layer
    assert blob.read_bytes() == good


def test_an_interrupted_pull_leaves_nothing_listed(
    registry: Registry, image_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written = write_layout(tmp_path / "layout", [(LayerTar().file("big", os.urandom(48 << 20)), "none")], tag="1")
    reference = registry.reference("interrupted/image:1")
    push(written, reference)
    monkeypatch.setattr(importer, "POLL_SECONDS", 0.001)
    monkeypatch.setattr(importer, "REPORT_SECONDS", 0.0)
    header_seen = []

    def interrupt(line: str) -> None:
        if header_seen:
            raise KeyboardInterrupt
        header_seen.append(line)  # the first line comes before the copy starts

    with pytest.raises(KeyboardInterrupt):
        pull_image(reference, progress=interrupt)
    assert_nothing_listed_for(reference)
    assert store.lookup(reference) is None
    assert not list((image_store / "layout").glob("oci-put-blob*"))
    from support import processes_mentioning

    assert processes_mentioning(image_store) == []
    assert pull_image(reference).reference == reference


def test_docker_v2_media_types_are_read(registry: Registry, image_store: Path, tmp_path: Path) -> None:
    written = write_layout(
        tmp_path / "layout",
        [(LayerTar().file("one", "1"), "gzip"), (LayerTar().file("two", "2"), "gzip")],
        tag="1",
        config=oci_images.ImageConfigSpec(
            env=("A=1",), working_dir="/w", user="1000:1000", entrypoint=("/bin/sh", "-c")
        ),
    )
    reference = registry.reference("docker/format:1")
    push(written, reference, docker_format=True)
    raw = subprocess.run(
        ["skopeo", "inspect", "--raw", "--tls-verify=false", reference],
        capture_output=True,
        check=True,
        env=skopeo_env(),
    ).stdout
    assert json.loads(raw)["mediaType"] == "application/vnd.docker.distribution.manifest.v2+json"
    image = pull_image(reference)
    assert image.source_digest == "sha256:" + hashlib.sha256(raw).hexdigest()
    assert [layer.digest for layer in image.layers] == list(written.layer_digests)
    assert image.config.env == ("A=1",)
    assert (image.config.working_dir, image.config.user, image.config.entrypoint) == (
        "/w",
        "1000:1000",
        ("/bin/sh", "-c"),
    )


def test_local_sources_oci_oci_archive_and_docker_archive(image_store: Path, tmp_path: Path) -> None:
    written = small_image(tmp_path / "layout", "local source", tag="v1")
    from_layout = pull_image(f"oci:{written.layout}:v1")
    assert from_layout.digest == written.digest
    assert from_layout.reference == f"oci:{written.layout}:v1"

    archive = tmp_path / "image.tar"
    with tarfile.open(archive, "w") as tar:
        for entry in sorted(written.layout.iterdir()):
            tar.add(entry, arcname=entry.name)
    assert pull_image(f"oci-archive:{archive}:v1").digest == written.digest

    saved = tmp_path / "saved.tar"
    subprocess.run(
        ["skopeo", "copy", "--quiet", f"oci:{written.layout}:v1", f"docker-archive:{saved}:saved/image:v1"],
        check=True,
        capture_output=True,
        env=skopeo_env(),
    )
    from_docker = pull_image(f"docker-archive:{saved}")
    assert from_docker.reference == f"docker-archive:{saved}"
    assert len(from_docker.layers) == 1

    # A local source that changed is imported again under the default policy.
    changed = small_image(tmp_path / "layout", "changed", tag="v1")
    assert pull_image(f"oci:{written.layout}:v1").digest == changed.digest != written.digest

    with pytest.raises(ImageNotFound, match="no OCI image layout at"):
        pull_image(f"oci:{tmp_path / 'missing'}:v1")
    with pytest.raises(ImageNotFound):
        pull_image(f"oci:{written.layout}:no-such-name")


def test_authentication_required_says_how_to_log_in(
    auth_registry: Registry, image_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    authfile = auth_registry.authfile(tmp_path)
    reference = auth_registry.reference("private/image:1")
    push(small_image(tmp_path / "layout", "private"), reference, authfile=authfile)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("REGISTRY_AUTH_FILE", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("DOCKER_CONFIG", raising=False)

    with pytest.raises(RegistryAuthRequired) as caught:
        pull_image(reference)
    message = str(caught.value)
    assert f"skopeo login {auth_registry.host}" in message and "docker login" in message and "podman login" in message
    assert_nothing_listed_for(reference)

    wrong = auth_registry.authfile(tmp_path / "home", password="not-the-password-42")
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(wrong))
    with pytest.raises(RegistryAuthRequired) as caught:
        pull_image(reference)
    assert "not-the-password-42" not in str(caught.value)


def test_credentials_from_docker_and_podman_files_never_leak(
    auth_registry: Registry, image_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pushed_with = auth_registry.authfile(tmp_path)
    reference = auth_registry.reference("secret/image:1")
    push(small_image(tmp_path / "layout", "secret"), reference, authfile=pushed_with)
    home = tmp_path / "home"
    (home / ".docker").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("REGISTRY_AUTH_FILE", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("DOCKER_CONFIG", raising=False)
    shutil.copy(pushed_with, home / ".docker" / "config.json")  # where `docker login` writes

    lines: list[str] = []
    image = pull_image(reference, progress=lines.append)
    assert image.reference == reference

    # podman's file, through REGISTRY_AUTH_FILE, for another reference of the same registry.
    (home / ".docker" / "config.json").unlink()
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(pushed_with))
    pull_image(reference, policy="always", progress=lines.append)

    token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    for secret in (PASSWORD, token):
        assert not any(secret in line for line in lines)
        for path in image_store.rglob("*"):
            if path.is_file():
                assert secret.encode() not in path.read_bytes(), path


def unprivileged_python() -> str:
    """An interpreter of this Python version that another user may run (a pyenv under /root is not one)."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (sys.executable, shutil.which(version, path="/usr/local/bin:/usr/bin")):
        if not candidate:
            continue
        real = Path(candidate).resolve()
        if all(os.stat(folder).st_mode & 0o001 for folder in real.parents) and os.stat(real).st_mode & 0o001:
            return str(real)
    pytest.skip(f"no {version} that an unprivileged user may run (this one is {sys.executable})")


def test_a_non_root_user_pulls_into_its_own_cache(busybox_image: str, request: pytest.FixtureRequest) -> None:
    if os.getuid() != 0:
        pytest.skip("runs as root to switch to an unprivileged user; as non-root every test here is a non-root pull")
    python = unprivileged_python()
    home = Path(tempfile.mkdtemp(prefix="forkd-nobody-home-"))  # pytest's own folders are root's, 0700
    request.addfinalizer(lambda: shutil.rmtree(home, ignore_errors=True))
    os.chown(home, 65534, 65534)
    script = (
        "import json, os, sys\n"
        "from pytest_forkd.image.oci import pull_image\n"
        "image = pull_image(sys.argv[1])\n"
        "print(json.dumps({'uid': os.getuid(), 'digest': image.digest, 'layer': str(image.layers[0].path)}))\n"
    )
    environment = {
        "HOME": str(home),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "PATH": os.environ["PATH"],
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), *site.getsitepackages()]),
    }
    result = subprocess.run(
        ["runuser", "-u", "nobody", "--", python, "-c", script, busybox_image],
        capture_output=True,
        text=True,
        env=environment,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert answer["uid"] == 65534
    layer = Path(answer["layer"])
    assert layer.is_relative_to(home / ".cache" / "pytest-forkd" / "oci")
    assert layer.stat().st_uid == 65534


def test_a_tag_is_read_once_and_the_image_copied_by_its_digest(
    registry: Registry, image_store: Path, tmp_path: Path
) -> None:
    """The tag moves between the look at the manifest and the copy: what is stored is all the first image."""
    reference = registry.reference("moving/once:1")
    first = small_image(tmp_path / "first", "first")
    second = small_image(tmp_path / "second", "second")
    push(first, reference)
    moved: list[str] = []

    def move_the_tag(line: str) -> None:
        if not moved and line.startswith(f"pulling {reference}: "):  # the copy is about to start
            push(second, reference)
            moved.append(line)

    image = pull_image(reference, progress=move_the_tag)
    assert moved, "the copy never started"
    assert image.digest == first.digest and image.source_digest == first.digest
    assert [layer.digest for layer in image.layers] == list(first.layer_digests)
    assert pull_image(reference, policy="always").digest == second.digest


PULLER = r"""
import json, os, sys, time
from pathlib import Path
from pytest_forkd.image.oci import pull_image

go = Path(sys.argv[2])
while not go.exists():
    time.sleep(0.005)
lines = []
image = pull_image(sys.argv[1], progress=lines.append)
print(json.dumps({"pid": os.getpid(), "digest": image.digest, "lines": lines}))
"""


def test_two_processes_pulling_one_image_at_once_both_get_it_and_one_waits(
    registry: Registry, image_store: Path, tmp_path: Path
) -> None:
    """As pytest-xdist workers do: one copies under the store lock, the other waits saying for whom, then
    finds the image in the store and copies nothing."""
    reference = registry.reference("concurrent/pull:1")
    written = write_layout(tmp_path / "layout", [(LayerTar().file("big", os.urandom(48 << 20)), "none")], tag="1")
    push(written, reference)
    go = tmp_path / "go"
    pullers = [
        subprocess.Popen(
            [sys.executable, "-c", PULLER, reference, str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ),
        )
        for _ in range(2)
    ]
    go.touch()
    answers = []
    for puller in pullers:
        out, err = puller.communicate(timeout=300)
        assert puller.returncode == 0, err
        answers.append(json.loads(out.strip().splitlines()[-1]))
    assert len({answer["digest"] for answer in answers}) == 1  # (skopeo compressed the layer on the push)
    waiting = [answer for answer in answers if any(line.startswith("waiting for") for line in answer["lines"])]
    assert len(waiting) == 1, [answer["lines"] for answer in answers]
    waiter = waiting[0]
    copier = next(answer for answer in answers if answer is not waiter)
    assert waiter["lines"][0].startswith(
        f"waiting for the image store lock held by PID {copier['pid']} (pulling {reference}, for "
    ), waiter["lines"]
    assert not any(line.startswith(f"pulling {reference}: ") for line in waiter["lines"])  # it copied nothing
    assert any(line.startswith(f"pulling {reference}: 1 layers, ") for line in copier["lines"])
