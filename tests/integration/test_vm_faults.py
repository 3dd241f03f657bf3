"""Faults against real VMs and the CLI: crashes, dead or missing QEMU, killed owners. Nothing may leak.

Each fault is provoked in a VM of a private factory (a child of the session's
base snapshot, so no extra boot), whose run directory is then checked: no
process may still mention it and nothing but its owner record may be left.
CLI runs get their own run-directory root on /dev/shm, which must be empty
when the command has exited.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Mapping

import pytest
from support import is_running, processes_mentioning, wait_until_dead

from pytest_forkd.core.factory import VMFactory
from pytest_forkd.engine.qemu.host import QEMU_PACKAGE, Qemu
from pytest_forkd.engine.qemu.machine import Machine, MachineSpec
from pytest_forkd.engine.rundir import OWNER_FILE
from pytest_forkd.errors import GuestCrashed, UnknownImage, VMStartError
from pytest_forkd.storage.snapshot import Snapshot

FORKD = [sys.executable, "-m", "pytest_forkd.cli"]


# -- leak checks -----------------------------------------------------------------


def assert_no_leaks(factory_or_run_dir: VMFactory | Path) -> None:
    """No process uses the run directory and it holds nothing but its owner record (if it still exists).

    Pass a factory that is still open, or the path of a run directory.
    """
    run_dir = factory_or_run_dir.run_dir.path if isinstance(factory_or_run_dir, VMFactory) else factory_or_run_dir
    assert processes_mentioning(run_dir) == []
    leftovers = sorted(entry.name for entry in run_dir.iterdir()) if run_dir.exists() else []
    assert set(leftovers) <= {OWNER_FILE}, f"stray files in {run_dir}: {leftovers}"


# -- fixtures ----------------------------------------------------------------------


@pytest.fixture
def private_factory(factory: VMFactory) -> Iterator[VMFactory]:
    """A factory of its own, so its run directory holds only what the test started."""
    private = VMFactory(accel=factory.requested_accel)
    run_dir = private.run_dir.path
    yield private
    private.close()
    assert not run_dir.exists()
    assert processes_mentioning(run_dir) == []


@pytest.fixture
def shm_root() -> Iterator[Path]:
    """A private parent for run directories, on /dev/shm like the real one."""
    root = Path(tempfile.mkdtemp(prefix="forkd-itest-", dir="/dev/shm"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def forkd(
    *args: str, shm_root: Path, env_changes: Mapping[str, str | None] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Run the ``forkd`` CLI in a subprocess whose run directories go under ``shm_root``.

    ``env_changes`` sets variables, or unsets those given as None.
    """
    environment = {**os.environ, "FORKD_SHM_DIR": str(shm_root)}
    for name, value in (env_changes or {}).items():
        if value is None:
            environment.pop(name, None)
        else:
            environment[name] = value
    return subprocess.run([*FORKD, *args], env=environment, capture_output=True, text=True, timeout=timeout)


def assert_nothing_left_under(shm_root: Path) -> None:
    """No process uses ``shm_root`` and nothing is left in it (the last run also removes it)."""
    assert processes_mentioning(shm_root) == []
    assert not shm_root.exists() or os.listdir(shm_root) == []


# -- guest crashes -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "console_says"),
    [("echo c > /proc/sysrq-trigger", "Kernel panic"), ("poweroff -f", "Power down")],
    ids=["panic", "poweroff"],
)
def test_guest_dying_mid_command_raises_guest_crashed_with_the_console_tail(
    private_factory: VMFactory, base_snapshot: Snapshot, command: str, console_says: str
) -> None:
    vm = private_factory.fork_snapshot(base_snapshot, 1)[0]
    pid = vm.machine.pid

    with pytest.raises(GuestCrashed) as caught:
        vm.exec(command, timeout=20)  # a guest that hangs instead would end in a timeout, not a QEMU exit

    assert "QEMU exited with status" in str(caught.value)
    assert console_says in caught.value.console_tail
    assert console_says in str(caught.value)
    assert vm.closed and not is_running(pid)
    assert_no_leaks(private_factory)


def test_killed_qemu_is_reported_on_next_use_and_its_sibling_still_works(
    private_factory: VMFactory, base_snapshot: Snapshot
) -> None:
    doomed, sibling = private_factory.fork_snapshot(base_snapshot, 2)
    os.kill(doomed.machine.pid, signal.SIGKILL)

    with pytest.raises(GuestCrashed, match=f"VM {doomed.name}: guest died .*QEMU exited with status -9"):
        doomed.exec("echo hello")

    assert doomed.closed
    assert sibling.exec("cat /root/marker").stdout == "from-base\n"
    sibling.close()
    assert_no_leaks(private_factory)


# -- VMs that cannot start --------------------------------------------------------------


def test_unknown_image_says_how_to_build_it(private_factory: VMFactory) -> None:
    with pytest.raises(UnknownImage, match="build it with `forkd image build --name no-such-image"):
        private_factory.boot("no-such-image")

    assert_no_leaks(private_factory)


def test_qmp_socket_that_never_appears_fails_the_start_and_kills_qemu(
    private_factory: VMFactory, tmp_path: Path
) -> None:
    """A QEMU stand-in that keeps its arguments (so the leak scan would see it) and just sleeps."""
    pid_file = tmp_path / "fake-qemu.pid"
    fake = tmp_path / "qemu-system-x86_64"
    fake.write_text(
        f"#!{sys.executable}\nimport os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)\n"
    )
    fake.chmod(0o755)
    spec = MachineSpec(qemu=Qemu(binary=str(fake), version="7.2.22"), accel="tcg")
    run_dir = private_factory.run_dir
    start_timeout = 1.5

    # The message names the deadline waited for: start_timeout, not the default of 20 s.
    with pytest.raises(VMStartError, match=r"QMP socket .* did not appear within 2 s"):
        Machine.launch(
            spec,
            run_dir.path,
            run_dir.new_name("vm"),
            kernel=tmp_path / "vmlinuz",
            initrd=tmp_path / "initrd",
            ram_path=run_dir.path / "vm.ram",
            share=True,
            owns_ram=True,
            start_timeout=start_timeout,
        )

    assert not is_running(int(pid_file.read_text()))
    assert_no_leaks(private_factory)


@pytest.mark.parametrize(
    "env_changes",
    [{"FORKD_QEMU": "/nonexistent/qemu-system-x86_64"}, {"FORKD_QEMU": None, "PATH": "/nonexistent/bin"}],
    ids=["FORKD_QEMU-points-nowhere", "PATH-without-qemu"],
)
def test_cli_without_qemu_names_the_package_to_install(shm_root: Path, env_changes: dict[str, str | None]) -> None:
    result = forkd("exec", "--", "true", shm_root=shm_root, env_changes=env_changes)

    assert result.returncode != 0
    assert result.stderr.startswith("forkd: error: ") and QEMU_PACKAGE in result.stderr
    assert "Traceback" not in result.stderr
    assert_nothing_left_under(shm_root)


# -- the CLI on a real VM ----------------------------------------------------------------


def test_cli_exec_relays_output_exit_status_and_timings_and_cleans_up(shm_root: Path) -> None:
    """One real ``forkd exec``: the output, the status and the timings of a cold boot; the ways a command can end
    (killed, timed out, truncated) and their statuses are checked on the fake engine (tests/unit/test_exec_cmd.py)."""
    result = forkd("exec", "--timings", "--", "sh", "-c", "echo hi; echo err >&2; exit 3", shm_root=shm_root)

    assert result.returncode == 3, result.stderr
    assert result.stdout == "hi\n"
    lines = result.stderr.splitlines()
    assert "err" in lines
    timings = json.loads(lines[-1])
    assert timings["mode"] == "cold_boot" and timings["accel"] in ("kvm", "tcg")
    assert timings["memory_mib"] == 256
    assert timings["start_to_first_reply_ms"] > 0 and timings["exec_ms"] > 0
    assert_nothing_left_under(shm_root)


def test_cli_doctor_reports_the_accelerator_verdict(shm_root: Path) -> None:
    result = forkd("doctor", shm_root=shm_root)

    assert result.returncode == 0, result.stdout + result.stderr
    # KVM is [ok]; TCG works but is several times slower, so it is a [warn] (see troubleshooting)
    verdicts = re.findall(r"^\[(ok  |warn)\] accel +(\w+): ", result.stdout, re.M)
    assert verdicts in ([("ok  ", "kvm")], [("warn", "tcg")]), result.stdout
    assert result.stdout.splitlines()[-1] == "ready"
    assert_nothing_left_under(shm_root)


# -- a killed owner ------------------------------------------------------------------------

OWNER_SCRIPT = """
import sys, time
import pytest_forkd
from pytest_forkd.core.factory import default_factory
from pytest_forkd.storage.snapshot import Snapshot
snapshot_dir, accel = sys.argv[1:]
root = pytest_forkd.boot(accel=accel)
child = default_factory(accel).fork_snapshot(Snapshot.load_from(snapshot_dir), 1)[0]
print(root.machine.pid, child.machine.pid, default_factory(accel).run_dir.path, flush=True)
time.sleep(600)
"""


def test_killed_owner_takes_its_vms_along_and_its_run_dir_is_cleaned_next_time(
    shm_root: Path, factory: VMFactory, base_snapshot: Snapshot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A booted root VM and a forked child (started from a worker thread) both die with their owner."""
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER_SCRIPT, str(base_snapshot.path), factory.requested_accel],
        env={**os.environ, "FORKD_SHM_DIR": str(shm_root)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = owner.stdout.readline().split()  # type: ignore[union-attr]
        assert len(line) == 3, "the owner process failed to start its VMs"
        qemu_pids, stale_run_dir = [int(line[0]), int(line[1])], Path(line[2])
        assert all(is_running(pid) for pid in qemu_pids)
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
    finally:
        owner.kill()
        owner.wait()
        owner.stdout.close()  # type: ignore[union-attr]

    for pid in qemu_pids:
        assert wait_until_dead(pid, seconds=10), f"QEMU {pid} outlived its owner"
    assert stale_run_dir.is_dir()  # nobody has cleaned up yet

    monkeypatch.setenv("FORKD_SHM_DIR", str(shm_root))
    next_run = VMFactory(accel=factory.requested_accel)
    try:
        fresh = next_run.run_dir.path
        assert not stale_run_dir.exists()
        assert fresh.parent == shm_root
    finally:
        next_run.close()
    assert_nothing_left_under(shm_root)
