"""Finding QEMU: ``$FORKD_QEMU``, then PATH; every failure names the package to install."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pytest_forkd.engine.qemu.host import QEMU_PACKAGE, find_qemu, qemu_binary
from pytest_forkd.errors import HostNotReady


def fake_qemu(directory: Path, version_line: str) -> Path:
    script = directory / "qemu-system-x86_64"
    script.write_text(f"#!{sys.executable}\nprint({version_line!r})\n")
    script.chmod(0o755)
    return script


def test_forkd_qemu_must_be_an_executable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    not_executable = tmp_path / "qemu"
    not_executable.write_text("")
    for value in ("/nonexistent/qemu-system-x86_64", str(not_executable)):
        monkeypatch.setenv("FORKD_QEMU", value)
        with pytest.raises(HostNotReady, match=f"FORKD_QEMU={value} is not an executable file.*{QEMU_PACKAGE}"):
            qemu_binary()


def test_missing_qemu_on_path_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FORKD_QEMU", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))

    with pytest.raises(HostNotReady, match=f"not found on PATH; install it with `sudo apt-get install {QEMU_PACKAGE}`"):
        qemu_binary()


def test_qemu_is_found_on_path_with_its_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = fake_qemu(tmp_path, "QEMU emulator version 9.1.2 (Debian 1:9.1.2+ds-1)")
    monkeypatch.delenv("FORKD_QEMU", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))

    qemu = find_qemu()

    assert (qemu.binary, qemu.version) == (str(script), "9.1.2")


def test_a_binary_without_a_version_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORKD_QEMU", str(fake_qemu(tmp_path, "hello")))

    with pytest.raises(HostNotReady, match="printed no version"):
        find_qemu()


def test_a_qemu_replaced_at_the_same_path_is_asked_its_version_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FORKD_QEMU", str(fake_qemu(tmp_path, "QEMU emulator version 8.2.2")))
    assert find_qemu().version == "8.2.2"

    replacement = tmp_path / "new" / "qemu-system-x86_64"
    replacement.parent.mkdir()
    fake_qemu(replacement.parent, "QEMU emulator version 9.1.2")
    replacement.replace(tmp_path / "qemu-system-x86_64")  # a new file (inode) under the same name

    assert find_qemu().version == "9.1.2"
