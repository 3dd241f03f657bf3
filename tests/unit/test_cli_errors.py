"""The command line's error boundary: one line, exit status 4 (bad input), 1 (a failure) or 2 (a bug),
the traceback only with --debug."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pytest_forkd import cli
from pytest_forkd.errors import ConfigError, GuestCrashed, SnapshotError


def fake_command(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    """Replace the command modules with one command ``boom`` that raises ``error``."""

    def add_parser(subparsers: Any) -> None:
        parser = subparsers.add_parser("boom")
        parser.add_argument("rest", nargs=argparse.REMAINDER)

        def run(args: argparse.Namespace) -> int:
            raise error

        parser.set_defaults(run=run)

    monkeypatch.setattr(cli, "COMMAND_MODULES", ())
    real_build = cli.build_parser

    def build_parser() -> argparse.ArgumentParser:
        parser = real_build()
        subparsers = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
        add_parser(subparsers)
        return parser

    monkeypatch.setattr(cli, "build_parser", build_parser)
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)


@pytest.mark.parametrize(
    ("error", "expected", "status"),
    [
        (SnapshotError("snapshot 'x' is damaged; remove it"), "forkd: error: snapshot 'x' is damaged; remove it", 1),
        (ConfigError("forkd.yaml: snapshots: expected a mapping"), "forkd: error: forkd.yaml: snapshots:", 4),
        (
            RuntimeError("kaput"),
            "forkd: error: unexpected RuntimeError: kaput; rerun with --debug for the "
            "traceback, and please report it as a pytest-forkd bug",
            2,
        ),
        (
            PermissionError(13, "Permission denied", "/srv/store"),
            "forkd: error: Permission denied: /srv/store; check that the path exists and that you may use it "
            "(traceback with --debug)",
            1,
        ),
        (ValueError("Expecting value: line 1 column 1 (char 0)"), "forkd: error: unexpected ValueError", 2),
    ],
)
def test_any_error_is_one_line_with_the_exit_status_of_its_kind(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], error: Exception, expected: str, status: int
) -> None:
    fake_command(monkeypatch, error)

    assert cli.main(["boom"]) == status

    err = capsys.readouterr().err
    assert err.startswith(expected)
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_multi_line_error_keeps_its_first_line_and_says_where_the_rest_is(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_command(monkeypatch, GuestCrashed("VM vm1: guest died", console_tail="line 1\nline 2"))

    assert cli.main(["boom"]) == 1

    err = capsys.readouterr().err
    assert err == "forkd: error: VM vm1: guest died (3 more lines of detail with --debug)\n"


def test_every_mistake_of_a_config_error_is_an_error_line_of_its_own(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    mistakes = "forkd.yaml: snapshot: unknown key; did you mean 'snapshots'?\nforkd.yaml: budgets.fork.p95: unknown key"
    fake_command(monkeypatch, ConfigError(mistakes))

    assert cli.main(["boom"]) != 0  # the status of a usage error

    assert capsys.readouterr().err.splitlines() == [
        "forkd: error: forkd.yaml: snapshot: unknown key; did you mean 'snapshots'?",
        "forkd: error: forkd.yaml: budgets.fork.p95: unknown key",
    ]


@pytest.mark.parametrize("argv", [["--debug", "boom"], ["boom", "--debug"]])
def test_debug_prints_the_traceback_and_the_whole_message(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    fake_command(monkeypatch, GuestCrashed("VM vm1: guest died", console_tail="Kernel panic"))

    assert cli.main(argv) == 1

    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "raise error" in err
    assert err.rstrip().splitlines()[-1] == "Kernel panic"
    assert "forkd: error: VM vm1: guest died" in err


def test_debug_after_double_dash_belongs_to_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    words, debug = cli._take_debug_flag(["exec", "--", "python3", "--debug"])
    assert (words, debug) == (["exec", "--", "python3", "--debug"], False)
    assert cli._take_debug_flag(["exec", "tool", "--debug"]) == (["exec", "tool", "--debug"], False)
    assert cli._take_debug_flag(["--debug", "exec", "tool"]) == (["exec", "tool"], True)


def test_forkd_debug_environment_variable(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake_command(monkeypatch, SnapshotError("bad"))
    monkeypatch.setenv(cli.DEBUG_ENV, "1")

    assert cli.main(["boom"]) == 1
    assert "Traceback" in capsys.readouterr().err


@pytest.mark.slow  # runs the installed command
def test_the_installed_command_prints_one_line_and_exits_1(tmp_path: Path) -> None:
    """Through the real entry point, in a subprocess: a damaged store and an unknown snapshot."""
    env = {**os.environ, "FORKD_STORE": str(tmp_path / "store")}
    env.pop(cli.DEBUG_ENV, None)
    argv = [sys.executable, "-m", "pytest_forkd.cli", "snapshots", "info", "nope"]

    plain = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    debug = subprocess.run([*argv, "--debug"], capture_output=True, text=True, env=env, timeout=60)

    assert plain.returncode == 1 and debug.returncode == 1
    assert plain.stderr.count("\n") == 1 and plain.stderr.startswith("forkd: error: unknown snapshot 'nope'")
    assert "Traceback" in debug.stderr and debug.stderr.rstrip().endswith(plain.stderr.rstrip())


def test_snapshots_verify_reports_damage_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pytest_forkd import private
    from pytest_forkd.storage.snapshot import Snapshot
    from pytest_forkd.storage.store import SnapshotStore

    monkeypatch.setenv("FORKD_STORE", str(tmp_path / "default"))
    store = SnapshotStore(tmp_path / "store")
    for tag in ("good", "bad"):
        with store.begin(tag) as pending:
            private.write_bytes(pending.dir / "state.bin", b"s")
            with open(pending.dir / "memory.ram", "wb") as stream:
                stream.truncate(64 << 20)
            pending.publish(
                Snapshot(
                    tag=tag,
                    path=pending.dir,
                    backend="full",
                    memory_mib=64,
                    vcpus=1,
                    image="default",
                    fingerprint={},
                    state_file="state.bin",
                    memory_file="memory.ram",
                )
            )
    os.truncate(store.root / "bad" / "memory.ram", 4096)

    assert cli.main(["snapshots", "verify", "--store", str(store.root)]) == 1

    out, err = capsys.readouterr()
    assert "good: ok" in out and f"bad: DAMAGED: {store.root / 'bad' / 'memory.ram'} is 4096 bytes" in out
    assert f"forkd snapshots rm TAG --store {store.root}" in err
    assert cli.main(["snapshots", "verify", "good", "--store", str(store.root)]) == 0
