"""``forkd doctor`` on a fresh install: what the first run will do is said, with its cost, and is no failure.

No VM starts here: without the default image doctor does not probe the
accelerator, and a build is replaced where one is asked for (the real build
and probe are in tests/integration/test_doctor_build.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_forkd import cli
from pytest_forkd.cli import doctor_cmd
from pytest_forkd.errors import ImageError


@pytest.fixture(autouse=True)
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty user cache (no image, no accelerator verdict) and a QEMU this host may lack."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("FORKD_CACHE_DIR", str(cache))
    monkeypatch.setenv("FORKD_SHM_DIR", str(tmp_path / "run"))
    monkeypatch.setattr(doctor_cmd, "_check_qemu", lambda: doctor_cmd.Check("qemu", True, "qemu 8.2.2"))
    monkeypatch.setattr(doctor_cmd, "_check_builders", list)  # no builder runs here (tests/oci tries them)
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    return cache


def doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str]]:
    status = cli.main(["doctor", *args])
    return status, capsys.readouterr().out.splitlines()


def test_a_fresh_install_is_ready_and_says_the_first_run_builds_the_image(
    capsys: pytest.CaptureFixture[str], empty_cache: Path
) -> None:
    status, lines = doctor(capsys)

    assert status == 0, lines
    assert not [line for line in lines if line.startswith("[FAIL]")], lines
    image = next(line for line in lines if line.startswith("[next] image "))
    assert "the first run builds the default image" in image
    assert "50 MB of Debian downloads" in image and f"230 MiB in {empty_cache}" in image
    assert lines[lines.index(image) + 1].strip() == "to do it now: forkd doctor --build"
    accel = next(line for line in lines if line.startswith("[next] accel "))
    assert "probed on the first run" in accel
    assert (
        lines[-1]
        == "ready: nothing is wrong; the first run builds the default image (forkd doctor --build does it now)"
    )
    assert not empty_cache.exists() or not (empty_cache / "images").exists()  # doctor alone builds nothing


def test_json_of_a_fresh_install_is_ready_with_the_first_run_s_work_listed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, lines = doctor(capsys, "--json")

    document = json.loads("\n".join(lines))
    assert status == 0
    assert document["ready"] is True and document["accel"] is None
    assert document["first_run"] == ["image", "accel"]
    image = next(check for check in document["checks"] if check["name"] == "image")
    assert (image["ok"], image["first_run"], image["fix"]) == (False, True, "forkd doctor --build")


def test_a_real_failure_still_fails_beside_the_first_run_s_work(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = doctor_cmd.Check("qemu", False, "no qemu-system-x86_64 on PATH", "sudo apt-get install qemu-system-x86")
    monkeypatch.setattr(doctor_cmd, "_check_qemu", lambda: missing)

    status, lines = doctor(capsys)

    assert status == 1
    assert lines[0].startswith("[FAIL] qemu ")
    assert any(line.startswith("[next] image ") for line in lines)
    assert lines[-1] == "not ready: 1 required check(s) failed"


def test_build_builds_the_missing_image_before_the_checks(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[str] = []

    def fail_to_build() -> object:
        built.append("default")
        raise ImageError("cannot reach the Debian mirror http://deb.example; set FORKD_DEBIAN_MIRROR")

    monkeypatch.setattr(doctor_cmd, "_build_default_image", fail_to_build)

    status, lines = doctor(capsys, "--build")

    assert built == ["default"]
    assert status == 1
    image = next(line for line in lines if " image " in line)
    assert image.startswith("[FAIL] image ") and "cannot reach the Debian mirror" in image
    assert not any(line.startswith("[next]") for line in lines)


def test_a_damaged_image_name_is_a_failure_not_first_run_work(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def unreadable(name: str = "default") -> object:
        raise ImageError(f"image {name!r}: manifest.json is not valid JSON; remove it and build again")

    monkeypatch.setattr("pytest_forkd.image.load_image", unreadable)

    status, lines = doctor(capsys)

    assert status == 1
    assert any(line.startswith("[FAIL] image ") and "not valid JSON" in line for line in lines)


def test_tcg_is_a_warning_and_a_base_not_stored_yet_is_the_first_run_s_work(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, empty_cache: Path
) -> None:
    from pytest_forkd.core.factory import VMFactory
    from pytest_forkd.engine.host import AccelVerdict

    image = doctor_cmd.Check("image", True, "default image 0123456789ab at /cache/images/x")
    monkeypatch.setattr(doctor_cmd, "_check_image", lambda build=False: (image, object()))
    verdict = AccelVerdict("tcg", "KVM unusable: /dev/kvm is missing; using TCG", "6.1", "7.2.22", 0.0, cached=True)
    monkeypatch.setattr(VMFactory, "accel_verdict", lambda self, image: verdict)

    status, lines = doctor(capsys)

    assert status == 0, lines
    accel = next(line for line in lines if " accel " in line)
    assert accel.startswith("[warn] accel ") and "tcg: KVM unusable" in accel
    assert "fix: none needed: VMs work under TCG" in lines[lines.index(accel) + 1]
    snapshot = next(line for line in lines if " snapshot " in line)
    assert snapshot.startswith("[next] snapshot ") and "base not stored yet" in snapshot
    assert str(empty_cache / "snapshots") in snapshot  # the store runs and `forkd snapshots ls` use
    assert lines[-1] == "ready: nothing is wrong; the first run stores snapshot base (forkd doctor --build does it now)"

    status, lines = doctor(capsys, "--json")
    document = json.loads("\n".join(lines))
    assert document["ready"] is True and document["accel"] == "tcg"
    assert document["first_run"] == ["snapshot"]
