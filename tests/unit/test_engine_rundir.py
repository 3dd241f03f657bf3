"""Run directories: owned by one process, removed on close, cleaned up after their owner died."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tenacity import Retrying, retry_if_result, stop_after_delay, wait_fixed

from pytest_forkd.engine.rundir import OWNER_FILE, RunDir, clean_stale


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
    started = Retrying(stop=stop_after_delay(30), wait=wait_fixed(0.01), retry=retry_if_result(lambda ok: not ok),
                       reraise=True)
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


def test_clean_stale_of_a_missing_root_does_nothing(tmp_path: Path) -> None:
    assert clean_stale(tmp_path / "never-created") == []
