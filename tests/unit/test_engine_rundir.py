"""Run directories: owned by one process, removed on close, cleaned up after their owner died."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest
from tenacity import Retrying, retry_if_result, stop_after_delay, wait_fixed

from pytest_forkd.engine import rundir
from pytest_forkd.engine.qemu.host import Qemu
from pytest_forkd.engine.qemu.machine import Machine, MachineSpec
from pytest_forkd.engine.rundir import OWNER_FILE, RunDir, clean_stale, private_listener
from pytest_forkd.errors import HostNotReady, VMStartError
from pytest_forkd.paths import shm_root


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def fake_run_dir(root: Path, owner: dict[str, object] | None) -> Path:
    """A run directory as another process would have left it, with a RAM file."""
    directory = root / f"run-{owner['pid'] if owner else 0}-abc123"
    directory.mkdir(parents=True)
    if owner is not None:
        (directory / OWNER_FILE).write_text(json.dumps(owner))
    (directory / "vm1.ram").write_bytes(b"guest memory")
    return directory


def process_mentioning(path: Path) -> subprocess.Popen:
    """A long-running process whose command line names ``path``, as a QEMU of that run would.

    Returns once the new program runs: until its exec, /proc shows the command line of this process.
    """
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", f"mem-path={path}"])
    needle = str(path).encode()
    started = Retrying(
        stop=stop_after_delay(30), wait=wait_fixed(0.01), retry=retry_if_result(lambda ok: not ok), reraise=True
    )
    started(lambda: needle in Path(f"/proc/{process.pid}/cmdline").read_bytes())
    return process


def test_run_dir_records_its_owner_and_is_removed_on_close(tmp_path: Path) -> None:
    run = RunDir(tmp_path)

    assert run.path.parent == tmp_path and run.path.name.startswith(f"run-{os.getpid()}-")
    owner = json.loads((run.path / OWNER_FILE).read_text())
    assert owner["pid"] == os.getpid() and owner["start_time"]
    assert [run.new_name("vm"), run.new_name("child"), run.new_name()] == ["vm1", "child2", "vm3"]
    run.close()
    assert not run.path.exists()


def test_a_run_dir_left_open_is_removed_when_the_interpreter_exits(tmp_path: Path) -> None:
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from pytest_forkd.engine.rundir import RunDir\n"
        "run = RunDir(Path(sys.argv[1]))\n"
        "print(run.path, flush=True)\n"
        "raise KeyboardInterrupt  # as an interrupt that comes after a session closed its VMs\n"
    )
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True)
    assert result.returncode != 0 and "KeyboardInterrupt" in result.stderr
    path = Path(result.stdout.strip())
    assert path.parent == tmp_path and path.name.startswith("run-")
    assert not path.exists()


def test_close_kills_processes_still_using_the_run_dir(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    straggler = process_mentioning(run.path / "vm1.ram")
    try:
        run.close()
        assert straggler.wait(timeout=10) == -signal.SIGKILL
    finally:
        straggler.kill()
        straggler.wait()


def test_stale_run_dir_of_a_dead_owner_is_removed_and_its_qemu_killed(tmp_path: Path) -> None:
    stale = fake_run_dir(tmp_path, {"pid": dead_pid(), "start_time": "12345"})
    straggler = process_mentioning(stale / "vm1.ram")
    try:
        assert clean_stale(tmp_path) == [stale]
        assert not stale.exists()
        assert straggler.wait(timeout=10) == -signal.SIGKILL
    finally:
        straggler.kill()
        straggler.wait()


def test_a_reused_pid_does_not_keep_a_run_dir_alive(tmp_path: Path) -> None:
    """Our own pid with another start time: the owner died and its pid went to us."""
    stale = fake_run_dir(tmp_path, {"pid": os.getpid(), "start_time": "1"})

    assert clean_stale(tmp_path) == [stale]


def test_run_dir_without_owner_record_is_stale(tmp_path: Path) -> None:
    stale = fake_run_dir(tmp_path, None)

    assert clean_stale(tmp_path) == [stale]


def test_creating_a_run_dir_removes_stale_ones_and_keeps_live_ones(tmp_path: Path) -> None:
    live = RunDir(tmp_path)
    stale = fake_run_dir(tmp_path, {"pid": dead_pid(), "start_time": "12345"})
    unrelated = tmp_path / "notes"
    unrelated.mkdir()
    try:
        second = RunDir(tmp_path)
        assert not stale.exists()
        assert live.path.is_dir() and second.path.is_dir() and unrelated.is_dir()
        second.close()
    finally:
        live.close()


def test_the_root_goes_with_its_last_stale_run(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    stale = fake_run_dir(root, {"pid": dead_pid(), "start_time": "12345"})
    assert clean_stale(root) == [stale]
    assert not root.exists()


def test_a_root_with_a_live_run_stays(tmp_path: Path) -> None:
    live = RunDir(tmp_path)
    try:
        stale = fake_run_dir(tmp_path, {"pid": dead_pid(), "start_time": "12345"})
        assert clean_stale(tmp_path) == [stale]
        assert tmp_path.is_dir() and live.path.is_dir()
    finally:
        live.close()


def test_clean_stale_of_a_missing_root_does_nothing(tmp_path: Path) -> None:
    assert clean_stale(tmp_path / "never-created") == []


# -- private files: a per-user root 0700, run directories 0700, files 0600 -----------------------


@pytest.fixture
def open_umask() -> Iterator[None]:
    """umask 0 while the test runs: modes must come from how files are created, not from the umask."""
    previous = os.umask(0)
    yield
    os.umask(previous)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_default_root_is_per_user(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FORKD_SHM_DIR", raising=False)
    assert shm_root() == Path(f"/dev/shm/pytest-forkd-{os.getuid()}")


@pytest.mark.usefixtures("open_umask")
def test_root_run_dir_and_owner_file_are_private_from_creation(tmp_path: Path) -> None:
    root = tmp_path / "shm" / "pytest-forkd-test"
    run = RunDir(root)
    try:
        assert mode(root) == 0o700 and mode(run.path) == 0o700
        assert mode(run.path / OWNER_FILE) == 0o600
    finally:
        run.close()


@pytest.mark.usefixtures("open_umask")
def test_a_listening_socket_is_created_0600(tmp_path: Path) -> None:
    listener = private_listener(tmp_path / "agent.sock")
    try:
        assert stat.S_ISSOCK(os.lstat(tmp_path / "agent.sock").st_mode)
        assert mode(tmp_path / "agent.sock") == 0o600
    finally:
        listener.close()


def test_a_root_left_open_by_an_older_version_is_narrowed(tmp_path: Path) -> None:
    root = tmp_path / "legacy"
    root.mkdir()
    root.chmod(0o755)
    run = RunDir(root)
    try:
        assert mode(root) == 0o700
    finally:
        run.close()


def test_a_symbolic_link_in_place_of_the_root_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    root = tmp_path / "pytest-forkd-1000"
    root.symlink_to(target)
    with pytest.raises(HostNotReady, match="not a directory .*FORKD_SHM_DIR"):
        RunDir(root)
    assert list(target.iterdir()) == []


@pytest.mark.skipif(os.getuid() != 0, reason="making a directory of another user needs root")
def test_a_root_owned_by_another_user_is_refused_and_left_alone(tmp_path: Path) -> None:
    root = tmp_path / "taken"
    root.mkdir(mode=0o777)
    os.chown(root, 65534, 65534)
    stranger = fake_run_dir(root, {"pid": dead_pid(), "start_time": "1"})
    with pytest.raises(HostNotReady, match=r"belongs to uid 65534.*FORKD_SHM_DIR"):
        RunDir(root)
    assert clean_stale(root) == [] and stranger.exists()


@pytest.mark.usefixtures("open_umask")
def test_qemu_creates_its_files_private(tmp_path: Path) -> None:
    """The RAM file, console log and monitor socket QEMU creates, and the files made for it, are 0600."""
    record = tmp_path / "modes.json"
    script = tmp_path / "fake-qemu"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, os, socket, stat, sys\n"
        "argv = sys.argv[1:]\n"
        "value = lambda prefix: next(a for a in argv if a.startswith(prefix))\n"
        "ram = value('memory-backend-file').split('mem-path=')[1].split(',')[0]\n"
        "console = value('file,id=console').split('path=')[1]\n"
        "qmp = argv[argv.index('-qmp') + 1].split(':', 1)[1].split(',')[0]\n"
        "agent = value('socket,id=agent').split('path=')[1].split(',')[0]\n"
        "os.close(os.open(ram, os.O_RDWR | os.O_CREAT, 0o644))\n"
        "open(console, 'w').close()\n"
        "socket.socket(socket.AF_UNIX).bind(qmp)\n"
        "directory = os.path.dirname(ram)\n"
        "modes = {name: stat.S_IMODE(os.lstat(os.path.join(directory, name)).st_mode) for name in os.listdir(directory)}\n"
        f"json.dump(modes, open({str(record)!r}, 'w'))\n"
        "sys.exit(1)\n"
    )
    script.chmod(0o755)
    short = Path(tempfile.mkdtemp(prefix="forkd-"))  # socket paths must fit in 107 bytes; tmp_path may not
    run = RunDir(short / "root")
    try:
        with pytest.raises(VMStartError):
            Machine.launch(
                MachineSpec(qemu=Qemu(str(script), "7.2.22"), accel="tcg"),
                run.path,
                "vm1",
                kernel=Path("/k"),
                initrd=Path("/i"),
                ram_path=run.path / "vm1.ram",
                share=True,
                owns_ram=True,
            )
    finally:
        run.close()
        shutil.rmtree(short)
    assert json.loads(record.read_text()) == {
        OWNER_FILE: 0o600,
        "vm1.ram": 0o600,
        "vm1.console": 0o600,
        "vm1.qmp": 0o600,
        "vm1.agent": 0o600,
        "vm1.stderr": 0o600,
    }


def test_a_socket_path_too_long_for_unix_sockets_is_a_clear_error(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    with pytest.raises(HostNotReady, match="FORKD_SHM_DIR") as caught:
        private_listener(deep / "vm1.agent")
    assert str(deep / "vm1.agent") in str(caught.value)
    assert list(deep.iterdir()) == []


def test_stale_runs_in_the_shared_root_of_older_versions_are_cleaned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    legacy = tmp_path / "pytest-forkd"
    stale = fake_run_dir(legacy, {"pid": dead_pid(), "start_time": "1"})
    monkeypatch.setattr(rundir, "LEGACY_ROOT", legacy)
    monkeypatch.delenv("FORKD_SHM_DIR", raising=False)
    monkeypatch.setattr(rundir, "shm_root", lambda: tmp_path / "pytest-forkd-uid")
    run = RunDir()
    try:
        assert not stale.exists() and not legacy.exists()
    finally:
        run.close()
