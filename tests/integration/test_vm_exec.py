"""Running commands and moving files in a real guest: what agent test suites do all day."""

from __future__ import annotations

import hashlib
import os

import pytest

from pytest_forkd.core.vm import VM
from pytest_forkd.errors import ExecError, ExecTimeout


def test_argv_is_passed_verbatim_and_a_string_runs_under_sh(vm: VM) -> None:
    argv = vm.exec(["printf", "[%s]", "two words", "$HOME", "*", ""])
    shell = vm.exec("for word in a b; do printf '%s-' $word; done; echo $((6 * 7))")

    assert argv.stdout == "[two words][$HOME][*][]"
    assert shell.stdout == "a-b-42\n"


def test_stdout_stderr_and_exit_code_are_kept_apart(vm: VM) -> None:
    result = vm.exec("echo out; echo err >&2; echo more-out; exit 5")

    assert (result.exit_code, result.ok) == (5, False)
    assert result.stdout == "out\nmore-out\n"
    assert result.stderr == "err\n"


def test_a_signal_kills_the_command_not_the_agent(vm: VM) -> None:
    result = vm.exec("kill -9 $$")

    assert result.exit_code == -9
    assert vm.exec("echo still here").stdout == "still here\n"


def test_env_cwd_and_stdin(vm: VM) -> None:
    result = vm.exec(
        ["sh", "-c", 'echo "$GREETING"; pwd; cat; echo "${HOME:+home is set}"'],
        env={"GREETING": "hello guest"},
        cwd="/tmp",
        stdin=b"piped\x00bytes\n",
    )

    assert result.stdout_bytes == b"hello guest\n/tmp\npiped\x00bytes\nhome is set\n"


def test_check_raises_exec_error_with_the_result(vm: VM) -> None:
    assert vm.exec("true", check=True).exit_code == 0
    with pytest.raises(ExecError) as caught:
        vm.exec("echo diagnosis >&2; exit 7", check=True)

    assert not isinstance(caught.value, ExecTimeout)
    assert caught.value.result.exit_code == 7
    assert "exited with code 7" in str(caught.value) and "diagnosis" in str(caught.value)


def test_bash_is_the_static_build(vm: VM) -> None:
    result = vm.exec(["bash", "-l", "-c", 'echo "$BASH_VERSION"; readlink /usr/bin/bash'], check=True)
    version, target = result.stdout.split()
    assert version.startswith("5.") and target == "bash-static"


def test_python_runs_in_the_guest_for_root_and_other_users(vm: VM) -> None:
    assert vm.exec(["python3", "-c", "print(6*7)"], check=True).stdout == "42\n"
    # the image's library and the agent's files are readable by everyone, whatever umask built them
    assert vm.exec(["python3", "-c", "import json; print(json.dumps(7))"], user="65534", check=True).stdout == "7\n"


def test_binary_files_round_trip_and_reach_the_guest_intact(vm: VM) -> None:
    small = bytes(range(256)) + b"\r\n\x00\xff"
    large = os.urandom(5 * 1024 * 1024)

    vm.write_file("/root/small.bin", small)
    vm.write_file("/root/large.bin", large, mode=0o600)

    assert vm.read_file("/root/small.bin") == small
    assert vm.read_file("/root/large.bin") == large
    guest_view = vm.exec("sha256sum /root/large.bin; stat -c %a:%s /root/large.bin", check=True).stdout.split()
    assert guest_view == [hashlib.sha256(large).hexdigest(), "/root/large.bin", f"600:{len(large)}"]


def test_timeout_kills_the_command_keeps_partial_output_and_the_vm(vm: VM) -> None:
    with pytest.raises(ExecTimeout) as caught:
        vm.exec("echo partial; echo half-err >&2; sleep 300; echo never", timeout=1)

    result = caught.value.result
    assert result.timed_out and result.stdout == "partial\n" and result.stderr == "half-err\n"
    assert vm.exec("echo usable").stdout == "usable\n"
    # The whole process group went, so nothing is left sleeping.
    assert vm.exec("pidof sleep").exit_code == 1


def test_huge_output_on_both_streams_comes_back_intact(vm: VM) -> None:
    writer = (
        "import sys\n"
        "for _ in range(40):\n"
        "    sys.stdout.buffer.write(b'o' * 1000000)\n"
        "    sys.stderr.buffer.write(b'e' * 100000)\n"
    )

    result = vm.exec(["python3", "-c", writer], check=True, max_output=40_000_000)

    assert not result.truncated
    assert len(result.stdout_bytes) == 40_000_000 and set(result.stdout_bytes) == {ord("o")}
    assert len(result.stderr_bytes) == 4_000_000 and set(result.stderr_bytes) == {ord("e")}
