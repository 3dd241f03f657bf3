"""Container image references: Docker's normalisation, the local transports, hostile text refused in one line."""

from __future__ import annotations

import os

import pytest

from pytest_forkd.errors import InvalidArgument
from pytest_forkd.image.oci import is_reference, parse_reference, plain_http_allowed
from pytest_forkd.image.oci.reference import ImageReference, names_container_image

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    ("text", "canonical", "registry"),
    [
        ("python:3.12-slim", "docker://docker.io/library/python:3.12-slim", "docker.io"),
        ("python", "docker://docker.io/library/python:latest", "docker.io"),
        ("docker://python", "docker://docker.io/library/python:latest", "docker.io"),
        ("user/app:v1", "docker://docker.io/user/app:v1", "docker.io"),
        ("docker.io/python", "docker://docker.io/library/python:latest", "docker.io"),
        ("index.docker.io/library/python:3", "docker://docker.io/library/python:3", "docker.io"),
        ("ghcr.io/owner/tool:1.2", "docker://ghcr.io/owner/tool:1.2", "ghcr.io"),
        ("127.0.0.1:5000/some/busybox:tag", "docker://127.0.0.1:5000/some/busybox:tag", "127.0.0.1:5000"),
        ("localhost/x", "docker://localhost/x:latest", "localhost"),
        ("localhost:5000/x", "docker://localhost:5000/x:latest", "localhost:5000"),
        ("[::1]:5000/x:1", "docker://[::1]:5000/x:1", "[::1]:5000"),
        (f"python@{DIGEST}", f"docker://docker.io/library/python@{DIGEST}", "docker.io"),
        (f"python:3.12@{DIGEST}", f"docker://docker.io/library/python:3.12@{DIGEST}", "docker.io"),
        ("my-registry:5000/a__b/c.d-e:T_1.x", "docker://my-registry:5000/a__b/c.d-e:T_1.x", "my-registry:5000"),
    ],
)
def test_docker_names_are_normalised_as_docker_reads_them(text: str, canonical: str, registry: str) -> None:
    reference = parse_reference(text)
    assert str(reference) == canonical
    assert reference.registry == registry
    assert parse_reference(str(reference)) == reference  # the canonical text reads back the same


def test_a_digest_pin_has_no_default_tag() -> None:
    reference = parse_reference(f"docker://python@{DIGEST}")
    assert (reference.tag, reference.digest, reference.repository) == (None, DIGEST, "library/python")


def test_local_transports_keep_absolute_paths_and_tags(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert parse_reference("oci:layout:v1") == ImageReference("oci", f"{tmp_path}/layout", tag="v1")
    assert parse_reference("oci:/x/layout") == ImageReference("oci", "/x/layout")
    assert str(parse_reference("oci-archive:img.tar:name")) == f"oci-archive:{tmp_path}/img.tar:name"
    assert str(parse_reference("docker-archive:saved.tar")) == f"docker-archive:{tmp_path}/saved.tar"
    reference = parse_reference("dockerfile:sub/Dockerfile")
    assert (reference.transport, reference.location, reference.registry) == (
        "dockerfile",
        f"{tmp_path}/sub/Dockerfile",
        None,
    )


def test_is_reference_needs_a_transport() -> None:
    assert is_reference("docker://python")
    assert is_reference("oci:dir")
    assert is_reference("oci-archive:f.tar")
    assert is_reference("docker-archive:f.tar")
    assert is_reference("dockerfile:Dockerfile")
    for forkd_name in ("default", "base", "python:3.12", "docker:python"):
        assert not is_reference(forkd_name)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("", "is empty"),
        ("   ", "is empty"),
        ("Python:3", "repository names must be lowercase"),
        ("python:", "the tag ''"),
        ("python:-bad", "the tag '-bad'"),
        ("python@sha256:abc", "is not sha256: followed by 64"),
        (f"python@md5:{'a' * 32}", "is not sha256"),
        ("python@" + DIGEST.upper(), "is not sha256"),
        ("docker://", "no image name"),
        ("py thon", "white space"),
        ("python\n:3", "control character"),
        ("python\x1b[31m", "control character"),
        ("reg.io/" + "a" * 300, "characters long"),
        ("x" * 5000, "5000 characters long"),
        ("a//b", "is not a repository name component"),
        ("https://ghcr.io/x", "without a URL scheme"),
        ("docker://https://ghcr.io/x", "without a URL scheme"),
        ("ghcr.io:bad:port/x", "is not a registry host[:port]"),
        ("oci:", "needs a path"),
        ("oci:dir:bad name", "is not a valid OCI image name"),
        ("docker-archive:a:b", "cannot contain ':'"),
        ("dockerfile:", "needs a path"),
    ],
)
def test_malformed_references_get_one_line_saying_what_is_wrong(text: str, said: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        parse_reference(text)
    message = str(caught.value)
    assert said in message
    assert "\n" not in message
    assert "docker-archive:FILE" in message or "characters long" in message  # the accepted forms, or the limit
    assert len(message) < 600


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("dokcer://127.0.0.1:5000/x:1", "unknown transport 'dokcer' in the image reference"),
        ("dokcer://x", "did you mean 'docker'?"),
        ("oic:/srv/layout:1", "did you mean 'oci'?"),
        ("dockerfiel:./Dockerfile", "did you mean 'dockerfile'?"),
        ("docker:/x", "write docker://..."),
        ("s3://bucket/image", "unknown transport 's3'"),
    ],
)
def test_an_unknown_transport_is_named_as_such_with_the_known_ones(text: str, said: str) -> None:
    for bare in ("docker", None):
        with pytest.raises(InvalidArgument) as caught:
            parse_reference(text, bare=bare)
        message = str(caught.value)
        assert said in message and "\n" not in message
        assert "the transports are docker://, oci:, oci-archive:, docker-archive:, dockerfile:" in message


def test_names_that_only_look_like_transports_are_docker_names() -> None:
    # a registry's port and a tag follow a colon too, never a path
    assert str(parse_reference("localhost:5000/x")) == "docker://localhost:5000/x:latest"
    assert str(parse_reference("registry:5000/a/b:1")) == "docker://registry:5000/a/b:1"
    assert str(parse_reference("docker:python")) == "docker://docker.io/library/docker:python"


@pytest.mark.parametrize(
    ("text", "is_container"),
    [
        ("default", False),
        ("my-image_2", False),
        ("busybox", False),
        ("busybox:latest", True),
        ("127.0.0.1:5055/trial/bb:1", True),
        ("ghcr.io/o/x", True),
        (f"python@{DIGEST}", True),
        ("docker://busybox", True),
        ("oci:layout", True),
        ("dokcer://x", True),  # then refused, naming the transport
    ],
)
def test_a_container_reference_is_told_from_a_forkd_image_name(text: str, is_container: bool) -> None:
    assert names_container_image(text) is is_container


def test_a_transport_is_required_when_bare_is_none() -> None:
    with pytest.raises(InvalidArgument, match="names no transport"):
        parse_reference("python:3.12", bare=None)
    assert parse_reference("docker://python:3.12", bare=None).tag == "3.12"


def test_non_text_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="must be text, not int"):
        parse_reference(5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("registry", "insecure", "allowed"),
    [
        ("localhost", (), True),
        ("localhost:5000", (), True),
        ("127.0.0.1:5000", (), True),
        ("127.3.4.5", (), True),
        ("[::1]:5000", (), True),
        ("docker.io", (), False),
        ("128.0.0.1:5000", (), False),
        ("localhost.evil.com", (), False),
        ("registry.lan:5000", ("registry.lan:5000",), True),
        ("registry.lan:5000", ("registry.lan",), True),
        ("registry.lan:5001", ("registry.lan:5000",), False),
        ("other.lan", ("registry.lan",), False),
    ],
)
def test_plain_http_only_on_this_machine_or_when_listed(
    registry: str, insecure: tuple[str, ...], allowed: bool
) -> None:
    assert plain_http_allowed(registry, insecure) is allowed
