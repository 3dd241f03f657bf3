"""Room for guest RAM and snapshots: the checks, the fallback run directory, and the words for a full filesystem.

The filesystems are faked by replacing :func:`space.filesystem_of` (the real
ones, small tmpfs mounts with real VMs, are in
tests/integration/test_constrained_hosts.py).
"""

from __future__ import annotations

import errno
import os
import signal
import warnings
from pathlib import Path

import pytest

from pytest_forkd import filesystems
from pytest_forkd.cli import doctor_cmd
from pytest_forkd.engine import rundir, space
from pytest_forkd.errors import HostNotReady

MIB = 1 << 20


def fake_filesystems(monkeypatch: pytest.MonkeyPatch, free_by_prefix: dict[str, tuple[str, int]]) -> None:
    """Make filesystem_of answer (type, free bytes) by the longest matching path prefix."""

    def filesystem_of(path: str | os.PathLike[str]) -> space.Filesystem:
        text = str(path)
        prefix = max((p for p in free_by_prefix if text.startswith(p)), key=len)
        kind, free = free_by_prefix[prefix]
        return space.Filesystem(Path(path), prefix, kind, free, max(free, 64 * MIB))

    monkeypatch.setattr(space, "filesystem_of", filesystem_of)


def test_filesystem_of_a_directory_not_created_yet_is_its_parents(tmp_path: Path) -> None:
    here = space.filesystem_of(tmp_path)
    later = space.filesystem_of(tmp_path / "not" / "yet")
    assert (later.mount_point, later.type) == (here.mount_point, here.type)
    assert later.size > 0 and 0 <= later.free <= later.size


def test_room_is_checked_against_what_the_vm_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_filesystems(monkeypatch, {"/": ("ext4", 1 << 40), "/small": ("tmpfs", 64 * MIB)})
    space.check_room("/roomy/run", 256 * MIB, "a VM")
    with pytest.raises(HostNotReady) as caught:
        space.check_room("/small/run", 256 * MIB, "a VM with 256 MiB of RAM")
    message = str(caught.value)
    assert "\n" not in message
    assert "a VM with 256 MiB of RAM needs up to 256 MiB in /small/run, on tmpfs at /small (64 MiB free" in message
    assert "--shm-size" in message and "FORKD_SHM_DIR" in message and "memory_mib" in message


def test_a_sigbus_death_names_the_filesystem_and_the_fix(tmp_path: Path) -> None:
    text = space.exit_text(-signal.SIGBUS, tmp_path / "vm1.ram")
    assert text.startswith("status -7: QEMU was killed by SIGBUS")
    assert str(tmp_path / "vm1.ram") in text and "MiB free of" in text and "--shm-size" in text
    assert space.exit_text(1, tmp_path / "vm1.ram") == "status 1"
    assert space.exit_text(-signal.SIGKILL, tmp_path / "vm1.ram") == "status -9"


def test_no_space_names_the_place_its_room_and_the_fix(tmp_path: Path) -> None:
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    text = space.no_space_text(full, tmp_path, "freezing VM vm1 into snapshot 'x'")
    assert text.startswith(f"freezing VM vm1 into snapshot 'x' failed: no space left in {tmp_path}, on ")
    assert "MiB free of" in text and "forkd snapshots rm" in text
    quota = space.no_space_text(OSError(errno.EDQUOT, "quota"), tmp_path, "exporting", "export elsewhere")
    assert "the disk quota is exhausted" in quota and quota.endswith("export elsewhere")
    assert space.is_no_space(full) and space.is_no_space(OSError(errno.EDQUOT, "q"))
    assert not space.is_no_space(OSError(errno.EACCES, "denied")) and not space.is_no_space(ValueError())


def test_one_classifier_for_full_over_quota_and_read_only_writes(tmp_path: Path) -> None:
    """pytest_forkd.filesystems tells the three apart from an OSError, an errno, or what a tool printed."""
    assert filesystems.unwritable_reason(OSError(errno.ENOSPC, "full")) == "no space"
    assert filesystems.unwritable_reason(errno.EDQUOT) == "quota"
    assert filesystems.unwritable_reason(OSError(errno.EROFS, "ro")) == "read-only"
    assert filesystems.unwritable_reason("mke2fs: No space left on device while writing") == "no space"
    assert filesystems.unwritable_reason('level=fatal msg="write /x: read-only file system"') == "read-only"
    assert filesystems.unwritable_reason(OSError(errno.EACCES, "denied")) is None
    assert filesystems.unwritable_reason(ValueError("no space left on device")) is None
    assert filesystems.is_read_only(errno.EROFS) and not filesystems.is_no_space(errno.EROFS)
    remedy = filesystems.Remedy(room="free space there", elsewhere="write elsewhere")
    read_only = filesystems.unwritable_text(OSError(errno.EROFS, "ro"), tmp_path, "writing the index", remedy)
    assert read_only == (
        f"writing the index failed: {tmp_path} is on a read-only filesystem "
        f"({filesystems.filesystem_of(tmp_path).describe()}); write elsewhere"
    )
    assert filesystems.unwritable_text(OSError(errno.EACCES, "denied"), tmp_path, "x", remedy) is None


def test_the_engine_and_the_foundation_share_the_filesystem_facts(tmp_path: Path) -> None:
    assert space.filesystem_of is filesystems.filesystem_of and space.is_no_space is filesystems.is_no_space
    assert space.filesystem_of(tmp_path / "not" / "yet").mount_point == filesystems.mount_of(tmp_path)[0]


def test_a_small_default_shm_moves_run_directories_to_a_roomy_tmpfs_first_and_warns_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("FORKD_SHM_DIR", raising=False)
    monkeypatch.setattr(rundir, "shm_root", lambda: Path("/shm/pytest-forkd-0"))
    monkeypatch.setattr(rundir, "fallback_roots", lambda: [tmp_path / "disk", tmp_path / "ram"])
    monkeypatch.setattr(rundir, "_warned_roots", set())
    fake_filesystems(
        monkeypatch,
        {"/": ("ext4", 1 << 40), "/shm": ("tmpfs", 64 * MIB), str(tmp_path / "ram"): ("tmpfs", 4096 * MIB)},
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = rundir.choose_root()
        second = rundir.choose_root()
    assert first[0] == second[0] == tmp_path / "ram"
    assert first[1] is not None and "/shm is tmpfs at /shm (64 MiB free" in first[1]
    said = [str(w.message) for w in caught if issubclass(w.category, rundir.RuntimeSpaceWarning)]
    assert len(said) == 1 and "--shm-size" in said[0]


def test_without_a_tmpfs_the_fallback_is_on_disk_and_says_what_that_costs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("FORKD_SHM_DIR", raising=False)
    monkeypatch.setattr(rundir, "shm_root", lambda: Path("/shm/pytest-forkd-0"))
    monkeypatch.setattr(rundir, "fallback_roots", lambda: [tmp_path / "disk"])
    fake_filesystems(monkeypatch, {"/": ("ext4", 1 << 40), "/shm": ("tmpfs", 64 * MIB)})
    root, reason = rundir.choose_root(warn=False)
    assert root == tmp_path / "disk"
    assert reason is not None and "slower" in reason and "uffd" in reason


def test_an_explicit_or_roomy_runtime_directory_is_kept(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake_filesystems(monkeypatch, {"/": ("ext4", 1 << 40), str(tmp_path): ("tmpfs", 64 * MIB)})
    monkeypatch.setenv("FORKD_SHM_DIR", str(tmp_path / "mine"))
    assert rundir.choose_root(warn=False) == (tmp_path / "mine", None)  # VM starts refuse instead
    monkeypatch.delenv("FORKD_SHM_DIR")
    monkeypatch.setattr(rundir, "shm_root", lambda: Path("/roomy/pytest-forkd-0"))
    assert rundir.choose_root(warn=False) == (Path("/roomy/pytest-forkd-0"), None)


def test_doctor_checks_the_filesystem_of_the_runtime_directory_it_will_use(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("FORKD_SHM_DIR", str(tmp_path / "small" / "forkd"))
    fake_filesystems(monkeypatch, {"/": ("ext4", 1 << 40), str(tmp_path / "small"): ("tmpfs", 64 * MIB)})
    check = doctor_cmd._check_runtime_space()
    assert not check.ok and check.required
    assert str(tmp_path / "small" / "forkd") in check.detail and "64 MiB free" in check.detail
    assert "--shm-size" in check.fix and "FORKD_SHM_DIR" in check.fix and "memory_mib" in check.fix

    fake_filesystems(monkeypatch, {"/": ("ext4", 1 << 40), str(tmp_path / "small"): ("tmpfs", 700 * MIB)})
    tight = doctor_cmd._check_runtime_space()
    assert not tight.ok and not tight.required and "room for 2 parent VM(s)" in tight.detail

    fake_filesystems(monkeypatch, {"/": ("ext4", 1 << 40), str(tmp_path / "small"): ("tmpfs", 8192 * MIB)})
    assert doctor_cmd._check_runtime_space().ok
