"""Hosts pytest-forkd cannot use say so in one line, with the fix, at VM start and in `forkd doctor`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

FORKD = str(Path(sys.executable).parent / "forkd")


@pytest.fixture
def shm_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="forkd-itest-host-", dir="/dev/shm"))
    yield root
    subprocess.run(["rm", "-rf", str(root)], check=False)


def forkd(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([FORKD, *args], capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture
def old_qemu(tmp_path: Path) -> Path:
    script = tmp_path / "qemu-system-x86_64"
    script.write_text(f"#!{sys.executable}\nprint('QEMU emulator version 6.2.0 (Debian 1:6.2+dfsg-2ubuntu6)')\n")
    script.chmod(0o755)
    return script


def test_an_old_qemu_is_refused_at_vm_start_in_one_line(old_qemu: Path, shm_root: Path) -> None:
    result = forkd(
        "exec", "--", "true", env={**os.environ, "FORKD_QEMU": str(old_qemu), "FORKD_SHM_DIR": str(shm_root)}
    )

    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("forkd: error: ")
    assert "QEMU 6.2.0, older than 7.2" in lines[0] and "qemu-system-x86 7.2 or newer" in lines[0]
    assert os.listdir(shm_root) == []


def test_doctor_fails_on_an_old_qemu_and_says_what_to_install(old_qemu: Path, shm_root: Path) -> None:
    result = forkd("doctor", env={**os.environ, "FORKD_QEMU": str(old_qemu), "FORKD_SHM_DIR": str(shm_root)})

    assert result.returncode == 1
    assert "[FAIL] qemu" in result.stdout and "older than 7.2" in result.stdout
    assert "fix: sudo apt-get install qemu-system-x86 (QEMU 7.2 or newer)" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


def test_explicit_kvm_without_access_is_refused_in_one_line(shm_root: Path) -> None:
    """Only testable where /dev/kvm is out of this user's reach (normal users in the host matrix)."""
    if os.access("/dev/kvm", os.R_OK | os.W_OK):
        pytest.skip("this user can open /dev/kvm")
    result = forkd("exec", "--accel", "kvm", "--", "true", env={**os.environ, "FORKD_SHM_DIR": str(shm_root)})

    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "accel kvm was requested but KVM is unusable: /dev/kvm" in lines[0]
    assert "fix:" in lines[0]


def test_doctor_json_tells_scripts_the_accelerator(shm_root: Path) -> None:
    result = forkd("doctor", "--json", env={**os.environ, "FORKD_SHM_DIR": str(shm_root)})

    document = json.loads(result.stdout)
    assert result.returncode == (0 if document["ready"] else 1)
    assert document["accel"] in ("kvm", "tcg")
    names = {check["name"] for check in document["checks"]}
    assert {"qemu", "accel", "kvm", "userfaultfd", "runtime dir", "backend uffd"} <= names
    uffd = next(check for check in document["checks"] if check["name"] == "userfaultfd")
    assert uffd["ok"] or "vm.unprivileged_userfaultfd" in uffd["detail"] + uffd["fix"]


def test_doctor_json_without_a_usable_qemu_has_no_accelerator(old_qemu: Path, shm_root: Path) -> None:
    result = forkd("doctor", "--json", env={**os.environ, "FORKD_QEMU": str(old_qemu), "FORKD_SHM_DIR": str(shm_root)})

    document = json.loads(result.stdout)
    assert result.returncode == 1 and document["ready"] is False and document["accel"] is None
