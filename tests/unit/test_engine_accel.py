"""Choosing KVM or TCG: explicit choices, the probe, and the per-host verdict cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_forkd.engine.qemu import accel
from pytest_forkd.engine.qemu.accel import cached_verdict, resolve_accel, validate_accel
from pytest_forkd.engine.qemu.host import Qemu, kernel_release
from pytest_forkd.errors import ConfigError, HostNotReady, VMStartError

QEMU = Qemu(binary="/usr/bin/qemu-system-x86_64", version="7.2.22")


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FORKD_CACHE_DIR", str(tmp_path))
    return tmp_path / "accel.json"


@pytest.fixture
def kvm_device_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(accel, "_kvm_usable", lambda: None)


class Probe:
    """Counts KVM probes and fails them with ``error`` when given."""

    def __init__(self, error: Exception | None = None) -> None:
        self.calls = 0
        self.error = error

    def __call__(self) -> None:
        self.calls += 1
        if self.error is not None:
            raise self.error


def test_unknown_accel_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="accel 'xen' is not one of auto, kvm, tcg"):
        validate_accel("xen")
    with pytest.raises(ConfigError):
        resolve_accel("hvf", QEMU, Probe())


@pytest.mark.usefixtures("kvm_device_usable")
@pytest.mark.parametrize("requested", ["kvm", "tcg"])
def test_explicit_choice_is_taken_without_probe_or_cache(requested: str, private_cache: Path) -> None:
    probe = Probe()

    verdict = resolve_accel(requested, QEMU, probe)

    assert (verdict.accel, verdict.reason, verdict.cached) == (requested, f"requested {requested}", False)
    assert probe.calls == 0
    assert not private_cache.exists()


def test_auto_without_a_usable_kvm_device_uses_tcg_without_probing(
    monkeypatch: pytest.MonkeyPatch, private_cache: Path
) -> None:
    monkeypatch.setattr(accel, "_kvm_usable", lambda: "/dev/kvm does not exist")
    probe = Probe()

    verdict = resolve_accel("auto", QEMU, probe)

    assert verdict.accel == "tcg" and "/dev/kvm does not exist" in verdict.reason
    assert probe.calls == 0
    entry = json.loads(private_cache.read_text())[f"{kernel_release()}|{QEMU.version}"]
    assert entry["accel"] == "tcg"


@pytest.mark.usefixtures("kvm_device_usable")
def test_auto_falls_back_to_tcg_when_the_kvm_probe_fails() -> None:
    probe = Probe(
        VMStartError("VM vm1: the guest agent did not answer within 8 s\n--- console ---\nKVM internal error")
    )

    verdict = resolve_accel("auto", QEMU, probe)

    assert verdict.accel == "tcg"
    assert (
        verdict.reason
        == "KVM unusable: the probe failed (VM vm1: the guest agent did not answer within 8 s); using TCG"
    )
    assert probe.calls == 1


@pytest.mark.usefixtures("kvm_device_usable")
@pytest.mark.parametrize(
    "error, shown",
    [
        (
            ConnectionResetError(104, "Connection reset by peer"),
            "ConnectionResetError: [Errno 104] Connection reset by peer",
        ),
        (json.JSONDecodeError("Expecting value", "", 0), "JSONDecodeError: Expecting value: line 1 column 1 (char 0)"),
        (TimeoutError("timed out"), "TimeoutError: timed out"),
        (RuntimeError(), "RuntimeError: "),
        (
            VMStartError("QEMU exited with status 1 while starting: failed to set MSR 0x10a"),
            "QEMU exited with status 1 while starting: failed to set MSR 0x10a",
        ),
    ],
)
def test_any_probe_failure_means_kvm_unusable_and_tcg(error: Exception, shown: str, private_cache: Path) -> None:
    verdict = resolve_accel("auto", QEMU, Probe(error))

    assert verdict.accel == "tcg"
    assert verdict.reason == f"KVM unusable: the probe failed ({shown}); using TCG"
    assert json.loads(private_cache.read_text())[f"{kernel_release()}|{QEMU.version}"]["accel"] == "tcg"


def test_an_interrupt_during_the_probe_is_not_a_verdict(monkeypatch: pytest.MonkeyPatch, private_cache: Path) -> None:
    monkeypatch.setattr(accel, "_kvm_usable", lambda: None)
    with pytest.raises(KeyboardInterrupt):
        resolve_accel("auto", QEMU, Probe(KeyboardInterrupt()))  # type: ignore[arg-type]
    assert not private_cache.exists()


def test_explicit_kvm_without_access_is_a_one_line_host_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        accel,
        "_kvm_usable",
        lambda: (
            "/dev/kvm is crw-rw---- root:kvm and alice is not in group kvm; "
            "fix: sudo usermod -aG kvm alice, then log in again"
        ),
    )
    with pytest.raises(HostNotReady, match="accel kvm was requested but KVM is unusable: .*usermod -aG kvm") as info:
        resolve_accel("kvm", QEMU, Probe())
    assert "\n" not in str(info.value)


@pytest.mark.usefixtures("kvm_device_usable")
def test_verdict_is_cached_per_kernel_and_qemu_version(private_cache: Path) -> None:
    probe = Probe()

    first = resolve_accel("auto", QEMU, probe)
    again = resolve_accel("auto", QEMU, probe)

    assert (first.accel, first.cached) == ("kvm", False)
    assert (again.accel, again.cached) == ("kvm", True)
    assert probe.calls == 1
    assert cached_verdict(QEMU) == again

    upgraded = Qemu(QEMU.binary, "9.0.0")
    assert cached_verdict(upgraded) is None
    assert resolve_accel("auto", upgraded, probe).cached is False
    assert probe.calls == 2
    assert set(json.loads(private_cache.read_text())) == {f"{kernel_release()}|7.2.22", f"{kernel_release()}|9.0.0"}


@pytest.mark.usefixtures("kvm_device_usable")
def test_an_unreadable_cache_is_probed_again(private_cache: Path) -> None:
    private_cache.write_text("{not json")
    probe = Probe()

    assert resolve_accel("auto", QEMU, probe).accel == "kvm"
    assert probe.calls == 1
    assert cached_verdict(QEMU) is not None
