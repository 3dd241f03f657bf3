"""What a host without QEMU, without /dev/kvm access, with an old QEMU or without userfaultfd gets.

Each is one line naming the cause and the fix, from ``find_qemu`` (so at VM
start) and from ``forkd doctor``; userfaultfd and KVM are probed per process.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from pytest_forkd.cli import doctor_cmd
from pytest_forkd.core.runtime import Runtime
from pytest_forkd.engine.qemu import host
from pytest_forkd.errors import BackendError, HostNotReady


def fake_qemu(directory: Path, version_line: str) -> Path:
    script = directory / "qemu-system-x86_64"
    script.write_text(f"#!{sys.executable}\nprint({version_line!r})\n")
    script.chmod(0o755)
    return script


@pytest.fixture
def no_uffd(monkeypatch: pytest.MonkeyPatch) -> None:
    """userfaultfd(2) refused with EPERM, as for a user when vm.unprivileged_userfaultfd=0."""
    monkeypatch.setattr(host, "_userfaultfd_syscall_errno", lambda: 1)
    monkeypatch.setattr(host, "_uffd_verdicts", {})


@pytest.mark.parametrize("version", ["6.2.0", "7.1.0", "5.2.0 (Debian 1:5.2+dfsg-11)"])
def test_a_qemu_older_than_7_2_is_refused_in_one_line_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    monkeypatch.setenv("FORKD_QEMU", str(fake_qemu(tmp_path, f"QEMU emulator version {version}")))
    with pytest.raises(HostNotReady) as info:
        host.find_qemu()
    message = str(info.value)
    assert "older than 7.2" in message and f"install {host.QEMU_PACKAGE} 7.2 or newer" in message
    assert "\n" not in message
    check = doctor_cmd._check_qemu()
    assert not check.ok and check.required and "older than 7.2" in check.detail


@pytest.mark.parametrize("version", ["7.2.0", "7.2.22", "8.2.2", "10.0.2"])
def test_qemu_7_2_and_newer_are_accepted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    monkeypatch.setenv("FORKD_QEMU", str(fake_qemu(tmp_path, f"QEMU emulator version {version}")))
    assert host.find_qemu().version == version


def test_doctor_without_qemu_names_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FORKD_QEMU", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    check = doctor_cmd._check_qemu()
    assert not check.ok and "not found on PATH" in check.detail
    assert f"apt-get install {host.QEMU_PACKAGE}" in check.fix


@pytest.mark.usefixtures("no_uffd")
def test_without_userfaultfd_the_reason_names_the_sysctl_and_the_uffd_backend_refuses() -> None:
    problem = host.userfaultfd_problem()
    assert problem is not None
    assert "vm.unprivileged_userfaultfd=" in problem and "CAP_SYS_PTRACE" in problem
    assert "sudo sysctl -w vm.unprivileged_userfaultfd=1" in problem
    uffd = Runtime().backends.get("uffd")
    assert uffd.unavailable_reason() == problem
    with pytest.raises(
        BackendError, match="storage backend 'uffd' is unavailable on this host: .*vm.unprivileged_userfaultfd"
    ):
        uffd.require_available()
    check = doctor_cmd._check_userfaultfd()
    assert not check.ok and not check.required
    assert "uffd backend is unavailable" in check.detail and "vm.unprivileged_userfaultfd=1" in check.fix


def test_userfaultfd_is_probed_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(host, "_uffd_verdicts", {})
    monkeypatch.setattr(host, "_userfaultfd_syscall_errno", lambda: calls.append(1) or 0)
    assert host.userfaultfd_problem() is None and host.userfaultfd_problem() is None
    assert calls == [1]
    monkeypatch.setattr(host, "_uffd_verdicts", {os.getpid() + 1: "another process's answer"})
    assert host.userfaultfd_problem() is None and len(calls) == 2


def test_the_userfaultfd_probe_matches_what_this_process_may_do() -> None:
    """Root (or CAP_SYS_PTRACE, or the sysctl at 1) may; the real probe must say so, and vice versa."""
    allowed = host._has_capability(host.CAP_SYS_PTRACE) or host._sysctl(host.USERFAULTFD_SYSCTL) == "1"
    assert (host._userfaultfd_problem_now() is None) == allowed


@pytest.mark.parametrize(
    "mode, groups, expected, fix",
    [
        (0o660, [], "alice is not in group kvm", "sudo usermod -aG kvm alice, then log in again"),
        (0o660, [4242], "this process lacks group kvm (log in again", None),
        (0o600, [], "crw------- root:kvm, not readable and writable by alice", 'KERNEL=="kvm", GROUP="kvm"'),
    ],
)
def test_kvm_access_is_explained_with_its_fix(
    monkeypatch: pytest.MonkeyPatch, mode: int, groups: list[int], expected: str, fix: str | None
) -> None:
    import grp
    import pwd
    import stat as stat_module

    class FakeStat:
        st_mode = stat_module.S_IFCHR | mode
        st_uid = 0
        st_gid = 4242

    monkeypatch.setattr(host.os.path, "exists", lambda path: True)
    monkeypatch.setattr(host.os, "access", lambda path, how: False)
    monkeypatch.setattr(host.os, "stat", lambda path: FakeStat())
    monkeypatch.setattr(host.os, "getgroups", lambda: groups)
    monkeypatch.setattr(grp, "getgrgid", lambda gid: grp.struct_group(("kvm", "x", gid, [])))
    monkeypatch.setattr(
        pwd,
        "getpwuid",
        lambda uid: pwd.struct_passwd(("alice" if uid != 0 else "root", "x", uid, uid, "", "/home/alice", "/bin/sh")),
    )
    monkeypatch.setattr(host.os, "getuid", lambda: 1000)

    problem = host.kvm_access_problem()
    assert problem is not None and expected in problem and "\n" not in problem
    if fix:
        assert fix in problem
    check = doctor_cmd._check_kvm()
    assert not check.ok and not check.required and "VMs run under TCG" in check.detail


def test_a_missing_kvm_device_means_tcg(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host.os.path, "exists", lambda path: False)
    assert host.kvm_access_problem() == "/dev/kvm does not exist (no KVM on this host, or the kvm module is not loaded)"
