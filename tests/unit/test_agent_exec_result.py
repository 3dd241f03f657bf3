from __future__ import annotations

import dataclasses

import pytest

from pytest_forkd.errors import ExecError, ExecTimeout
from pytest_forkd.guest.exec_result import ExecResult, describe_outcome


def make(exit_code: int = 0, stdout: bytes = b"", stderr: bytes = b"", **fields) -> ExecResult:
    return ExecResult(("make", "test"), exit_code, stdout, stderr, 12.5, **fields)


def test_output_is_decoded_as_utf8_with_replacement() -> None:
    result = make(stdout="héllo".encode() + b"\xff", stderr=b"\xfe!")

    assert result.stdout == "héllo\ufffd"
    assert result.stderr == "\ufffd!"


@pytest.mark.parametrize(
    ("exit_code", "timed_out", "ok"), [(0, False, True), (1, False, False), (-9, False, False), (0, True, False)]
)
def test_ok_needs_exit_code_zero_and_no_timeout(exit_code: int, timed_out: bool, ok: bool) -> None:
    assert make(exit_code, timed_out=timed_out).ok is ok


def test_check_returns_the_result_when_ok() -> None:
    result = make(0, b"fine")

    assert result.check() is result


def test_check_raises_with_command_exit_code_and_stderr_tail() -> None:
    stderr = "".join(f"line {n}\n" for n in range(100)).encode()
    result = make(2, b"ignored", stderr)

    with pytest.raises(ExecError) as caught:
        result.check()

    message = str(caught.value)
    assert "'make test' exited with code 2" in message
    assert "line 99" in message and "line 80" in message
    assert "line 79" not in message
    assert caught.value.result is result
    assert not isinstance(caught.value, ExecTimeout)


def test_check_shows_stdout_when_stderr_is_empty() -> None:
    with pytest.raises(ExecError, match="last lines of stdout ---\nFAILED test_x"):
        make(1, b"FAILED test_x\n").check()


def test_check_of_a_timed_out_result_raises_exec_timeout() -> None:
    with pytest.raises(ExecTimeout, match="timed out"):
        make(-9, timed_out=True).check()


def test_signal_deaths_are_named() -> None:
    assert describe_outcome(-11) == "was killed by SIGSEGV"
    assert describe_outcome(-200) == "was killed by signal 200"
    assert describe_outcome(3) == "exited with code 3"


def test_repr_stays_short_for_huge_output() -> None:
    text = repr(make(stdout=b"x" * 10_000_000, stderr=b"small"))

    assert len(text) < 200
    assert "<10000000 bytes>" in text
    assert "'small'" in text


def test_command_line_quotes_argv_and_keeps_shell_strings() -> None:
    assert ExecResult(("echo", "a b"), 0, b"", b"", 1.0).command_line == "echo 'a b'"
    assert ExecResult("echo a | wc -l", 0, b"", b"", 1.0).command_line == "echo a | wc -l"


def test_result_is_immutable() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        make().exit_code = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("fields", "status"),
    [
        ({"exit_code": 0}, 0),
        ({"exit_code": 3}, 3),
        ({"exit_code": -15}, 143),
        ({"exit_code": -9, "oom_killed": True}, 137),
        ({"exit_code": -9, "timed_out": True}, 124),
    ],
)
def test_exit_status_is_what_a_shell_would_report(fields: dict, status: int) -> None:
    assert make(**fields).exit_status == status


def test_signal_follows_a_negative_exit_code() -> None:
    assert (make(-11).signal, make(2).signal) == (11, None)


def test_oom_kill_and_truncation_show_in_repr_and_failure_message() -> None:
    result = make(-9, oom_killed=True, truncated=True, stdout=b"x" * 100)

    assert "oom_killed=True" in repr(result) and "truncated=True" in repr(result)
    with pytest.raises(ExecError, match="out-of-memory killer"):
        result.check()
