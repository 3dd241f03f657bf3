"""Arguments are checked before anything is built, probed or started."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

import pytest_forkd.image as image_package
from pytest_forkd.core import validate
from pytest_forkd.core.factory import VMFactory
from pytest_forkd.engine.qemu import engine as engine_module
from pytest_forkd.engine.qemu import machine as qemu_module
from pytest_forkd.errors import ConfigError, ForkdError, InvalidArgument
from pytest_forkd.image import Image

MIB = 1 << 20


@pytest.fixture
def no_qemu(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Make starting, finding or probing QEMU (and building an image) fail the test loudly."""
    calls: list[Any] = []

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        raise AssertionError(f"QEMU or an image build was reached with {args!r}")

    monkeypatch.setattr(qemu_module, "spawn", forbidden)
    monkeypatch.setattr(engine_module, "find_qemu", forbidden)
    monkeypatch.setattr(image_package, "ensure_image", forbidden)
    monkeypatch.setattr(engine_module, "resolve_accel", forbidden)
    return calls


def fake_image(tmp_path: Path, initrd_mib: int) -> Image:
    initrd = tmp_path / "initrd.cpio"
    with open(initrd, "wb") as stream:
        stream.truncate(initrd_mib * MIB)  # sparse: the size is what counts
    kernel = tmp_path / "vmlinuz"
    kernel.write_bytes(b"k")
    return Image(
        name="big",
        key="k" * 16,
        path=tmp_path,
        kernel=kernel,
        initrd=initrd,
        stub_kernel=kernel,
        stub_initrd=initrd,
        kernel_args=(),
        env={},
        fingerprint="k" * 16,
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"memory_mib": 0}, "memory_mib=0 is too small"),
        ({"memory_mib": -1}, "memory_mib=-1 is too small"),
        ({"memory_mib": 100000}, "memory_mib=100000 is more than this host allows"),
        ({"memory_mib": 256.5}, "memory_mib must be a whole number"),
        ({"memory_mib": "256"}, "memory_mib must be a whole number"),
        ({"vcpus": 0}, "vcpus=0: a VM needs at least 1 vCPU"),
        ({"vcpus": 10_000}, "vcpus=10000 is more than"),
        ({"vcpus": True}, "vcpus must be a whole number"),
        ({"timeout": 0}, "timeout=0 is not a positive number"),
        ({"timeout": -5}, "timeout=-5 is not a positive number"),
        ({"timeout": float("nan")}, "timeout=nan is not a positive number"),
        ({"image": ""}, "invalid image name '' \\(it is empty\\)"),
        ({"image": "dokcer://x"}, "unknown transport 'dokcer'.*did you mean 'docker'"),
    ],
)
def test_boot_refuses_bad_arguments_before_qemu(
    no_qemu: list[Any], kwargs: dict[str, Any], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(validate, "host_memory_mib", lambda: 24 * 1024)  # a 24 GiB host
    monkeypatch.delenv(validate.MAX_MEMORY_ENV, raising=False)
    factory = VMFactory(accel="tcg")
    try:
        with pytest.raises(InvalidArgument, match=message) as caught:
            factory.boot(**kwargs)
    finally:
        factory.close()
    assert isinstance(caught.value, ConfigError) and isinstance(caught.value, ValueError)
    assert no_qemu == [] and factory._run_dir is None


def test_an_initramfs_too_big_for_the_memory_is_refused_up_front(no_qemu: list[Any], tmp_path: Path) -> None:
    factory = VMFactory(accel="tcg")
    try:
        with pytest.raises(InvalidArgument) as caught:
            factory.boot(fake_image(tmp_path, 130), memory_mib=256)
    finally:
        factory.close()
    message = str(caught.value)
    assert "memory_mib=256 is too small for image 'big'" in message and "initramfs is 130 MiB" in message
    assert f"use memory_mib >= {2 * 130 + validate.KERNEL_AND_AGENT_MIB}" in message
    assert no_qemu == []


def test_the_same_image_passes_the_memory_check_with_enough_memory(tmp_path: Path) -> None:
    image = fake_image(tmp_path, 130)
    floor = validate.initramfs_floor_mib(image.initrd)

    assert validate.memory_mib(floor, initrd=image.initrd) == floor
    with pytest.raises(InvalidArgument):
        validate.memory_mib(floor - 1, initrd=image.initrd)


def test_the_default_image_floor_is_above_what_was_measured_to_hang(tmp_path: Path) -> None:
    """36.3 MiB of initramfs: 136 MiB hung before the agent answered, 140 MiB booted (see initramfs_floor_mib)."""
    image = tmp_path / "initrd"
    with open(image, "wb") as stream:
        stream.truncate(38091800)

    assert 136 < validate.initramfs_floor_mib(image) <= 144


def test_the_host_memory_limit_can_be_raised_on_purpose(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(validate, "host_memory_mib", lambda: 24 * 1024)
    monkeypatch.delenv(validate.MAX_MEMORY_ENV, raising=False)
    with pytest.raises(InvalidArgument, match=f"half of its 24576 MiB.*{validate.MAX_MEMORY_ENV}"):
        validate.memory_mib(100000)

    monkeypatch.setenv(validate.MAX_MEMORY_ENV, "200000")
    assert validate.memory_mib(100000) == 100000
    monkeypatch.setenv(validate.MAX_MEMORY_ENV, "lots")
    with pytest.raises(InvalidArgument, match="not a whole number of MiB"):
        validate.memory_mib(256)


def test_fork_count_is_checked(no_qemu: list[Any]) -> None:
    factory = VMFactory(accel="tcg")
    try:
        for bad in (0, -1, 1.5, None):
            with pytest.raises(InvalidArgument, match="need at least 1|whole number"):
                factory.fork_snapshot(object(), bad)  # type: ignore[arg-type]
    finally:
        factory.close()


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("relative/file", "is relative"),
        ("/tmp/a\0b", "NUL byte"),
        (b"/bytes", "must be a str"),
        ("/" + "a" * 5000, "Linux paths stop at 4096"),
    ],
)
def test_guest_paths_must_be_absolute_str_without_nul(path: Any, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        validate.guest_path(path)


@pytest.mark.parametrize(
    ("command", "message"),
    [
        ("", "empty"),
        ([], "empty list"),
        (["ls", 3], r"command\[1\] must be a str"),
        ("a\0b", "NUL"),
        (b"ls", "str or a list"),
    ],
)
def test_commands_are_checked(command: Any, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        validate.command(command)


def test_environment_names_and_values_are_checked() -> None:
    assert validate.environment({"A": "1"}) == {"A": "1"}
    for bad in ({"": "x"}, {"A=B": "x"}, {"A": 1}, {"A": "a\0"}):
        with pytest.raises(InvalidArgument):
            validate.environment(bad)


def test_timeouts_accept_none_and_positive_numbers() -> None:
    assert validate.timeout(None) is None
    assert validate.timeout(2) == 2.0
    with pytest.raises(InvalidArgument, match="pass e.g. 30"):
        validate.timeout(None, optional=False)
    with pytest.raises(InvalidArgument):
        validate.timeout(math.inf)


def test_every_argument_error_is_a_forkd_error() -> None:
    assert issubclass(InvalidArgument, ForkdError) and issubclass(InvalidArgument, ValueError)


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ("default", "default"),
        ("tools_2", "tools_2"),
        ("busybox", "busybox"),  # a plain word stays a forkd image name
        ("127.0.0.1:5055/trial/bb:1", "docker://127.0.0.1:5055/trial/bb:1"),  # read as --forkd-image reads it
        ("python:3.12-slim", "docker://docker.io/library/python:3.12-slim"),
        ("docker://busybox", "docker://docker.io/library/busybox:latest"),
    ],
)
def test_an_image_is_a_forkd_image_name_or_a_reference_read_as_docker_reads_it(given: str, named: str) -> None:
    assert validate.image_name(given) == named


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ("dokcer://127.0.0.1:5055/x:1", "unknown transport 'dokcer'"),
        ("ocii:./layout", "unknown transport 'ocii'"),
        ("docker:/x", "write docker://"),
        ("Bad Name", "invalid image name"),
    ],
)
def test_an_unknown_transport_is_named_with_the_known_ones(given: str, said: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        validate.image_name(given)
    assert said in str(caught.value)
    if "transport" in said or "docker://" in said:
        assert "docker://, oci:, oci-archive:, docker-archive:, dockerfile:" in str(caught.value)
