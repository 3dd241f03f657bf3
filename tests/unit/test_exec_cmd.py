"""``forkd exec`` on the fake engine: what it prints and the status it exits with, for every way a command ends.

The command line runs in-process with its VMs on the fake engine (the real
agent as a host process), so each case costs a fake boot, not a QEMU one. One
real ``forkd exec`` (tests/integration/test_vm_faults.py) checks the same path
on a real VM; how a real guest kills, times out and truncates a command is
checked through the API in tests/integration/test_vm_exec.py and
test_guest_limits.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pytest_forkd.cli import exec_cmd, main
from pytest_forkd.core.factory import VMFactory


class Verdict:
    accel = "none (fake engine)"


@pytest.fixture
def run_dirs(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """``forkd exec``'s factories made on the fake engine; the run directory of each, to check the clean-up."""
    made: list[Path] = []

    def fake_factory(accel: str = "auto", progress: Callable[[str], None] | None = None) -> VMFactory:
        factory = VMFactory(engine="fake", progress=progress)
        monkeypatch.setattr(factory, "accel_verdict", lambda image: Verdict())  # the fake has no accelerator
        made.append(factory.run_dir.path)
        return factory

    monkeypatch.setattr(exec_cmd, "VMFactory", fake_factory)
    return made


def forkd_exec(capfd: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``forkd exec ARGV``: its exit status, stdout and stderr."""
    try:
        status: Any = main(["exec", *argv])
    except SystemExit as exc:
        status = exc.code
    out, err = capfd.readouterr()
    return int(status), out, err


def test_output_and_exit_status_are_relayed_and_the_vm_is_gone(
    run_dirs: list[Path], capfd: pytest.CaptureFixture[str]
) -> None:
    status, out, err = forkd_exec(capfd, "--", "sh", "-c", "echo hi; echo err >&2; exit 3")

    assert (status, out) == (3, "hi\n")
    assert "err" in err.splitlines()
    (run_dir,) = run_dirs
    assert not run_dir.exists()


@pytest.mark.parametrize(
    ("argv", "status", "out", "said"),
    [
        (["--", "sh", "-c", "kill -9 $$"], 128 + 9, "", None),
        (["--", "sh", "-c", "kill -TERM $$"], 128 + 15, "", None),
        (
            ["--timeout", "0.2", "--", "sh", "-c", "echo started; sleep 60"],
            124,
            "started\n",
            "did not finish within 0.2 s",
        ),
        (
            ["--max-output", "100", "--", "sh", "-c", "head -c 1000 /dev/zero | tr '\\0' a"],
            0,
            "a" * 100,
            "--max-output",
        ),
    ],
    ids=["killed", "terminated", "timed-out", "truncated"],
)
def test_the_exit_status_follows_the_shell_convention(
    run_dirs: list[Path], capfd: pytest.CaptureFixture[str], argv: list[str], status: int, out: str, said: str | None
) -> None:
    got_status, got_out, err = forkd_exec(capfd, *argv)

    assert (got_status, got_out) == (status, out)
    if said is not None:
        assert said in err
    (run_dir,) = run_dirs
    assert not run_dir.exists()


def test_timings_are_one_json_line_on_stderr_after_the_commands_own(
    run_dirs: list[Path], capfd: pytest.CaptureFixture[str]
) -> None:
    status, out, err = forkd_exec(capfd, "--timings", "--", "sh", "-c", "echo to-stderr >&2")

    assert (status, out) == (0, "")
    lines = err.splitlines()
    assert lines[-2] == "to-stderr"
    timings = json.loads(lines[-1])
    assert timings["mode"] == "cold_boot" and timings["memory_mib"] == 256
    assert timings["start_to_first_reply_ms"] > 0 and timings["exec_ms"] > 0


@pytest.mark.parametrize(
    ("argv", "status", "message"),
    [
        ([], 2, "no command given"),
        (["--timeout=-1", "--", "true"], 4, "--timeout"),
        (["--max-output=-5", "--", "true"], 4, "--max-output must be a number of bytes"),
    ],
)
def test_bad_command_lines_are_refused_before_a_vm_starts(
    run_dirs: list[Path], capfd: pytest.CaptureFixture[str], argv: list[str], status: int, message: str
) -> None:
    got_status, _out, err = forkd_exec(capfd, *argv)

    assert got_status == status and message in err
    assert run_dirs == []
