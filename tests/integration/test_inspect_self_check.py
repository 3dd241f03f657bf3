"""Inspect's own conformance checks for sandbox providers, run against one forkd sample VM.

``inspect_ai.util._sandbox.self_check`` is the suite Inspect ships for
providers (files, limits, errors, exec with input, env, cwd, timeouts,
users). Each check runs in an event loop of its own against the same sample
VM, made by the provider's own ``task_init`` and ``sample_init``, as Inspect's
runner shares one environment across its checks.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("inspect_ai", reason="needs inspect-ai: pip install 'pytest-forkd[inspect]'")

from inspect_ai.util import SandboxUserUnsupportedError  # noqa: E402
from inspect_ai.util._sandbox import self_check  # noqa: E402

from pytest_forkd.integrations.inspect_sandbox import ForkdSandboxEnvironment  # noqa: E402
from pytest_forkd.integrations.sessions import SESSIONS  # noqa: E402

#: Checks whose premise does not hold in forkd's guest, and why.
NOT_APPLICABLE = {
    # Commands run as root, and root reads and writes a file whatever its mode says.
    "test_read_file_not_allowed": "the guest runs commands as root, who may read a file without read permission",
    "test_write_text_file_without_permissions": "the guest runs commands as root, who may replace a read-only file",
    "test_write_binary_file_without_permissions": "the guest runs commands as root, who may replace a read-only file",
    # It runs /etc/passwd, which the default image lacks (so: not found); a file that is not executable is below.
    "test_exec_permission_error": "the default guest image has no /etc/passwd (see test_running_a_file_that_is_not_executable)",
    # The default image has no adduser; users from /etc/passwd are checked below instead.
    "test_exec_as_user": "the default guest image has no adduser (see test_exec_as_a_user_of_the_guests_passwd)",
}


def params() -> list[Any]:
    return [
        pytest.param(name, marks=pytest.mark.xfail(reason=NOT_APPLICABLE[name], strict=True))
        if name in NOT_APPLICABLE
        else name
        for name in self_check.__all__
    ]


@pytest.fixture(scope="module")
def sample_env() -> Iterator[ForkdSandboxEnvironment]:
    async def start() -> ForkdSandboxEnvironment:
        await ForkdSandboxEnvironment.task_init("self-check", None)
        environments = await ForkdSandboxEnvironment.sample_init("self-check", None, {})
        environment = environments["default"]
        assert isinstance(environment, ForkdSandboxEnvironment)
        return environment

    async def stop(environment: ForkdSandboxEnvironment) -> None:
        await ForkdSandboxEnvironment.sample_cleanup("self-check", None, {"default": environment}, False)
        await ForkdSandboxEnvironment.task_cleanup("self-check", None, True)

    environment = asyncio.run(start())
    try:
        yield environment
    finally:
        asyncio.run(stop(environment))
    assert SESSIONS.keys() == []


@pytest.mark.parametrize("check", params())
def test_inspect_conformance(check: str, sample_env: ForkdSandboxEnvironment) -> None:
    asyncio.run(getattr(self_check, check)(sample_env))


def test_exec_as_a_user_of_the_guests_passwd(sample_env: ForkdSandboxEnvironment) -> None:
    async def main() -> None:
        await sample_env.exec(["mkdir", "-p", "/home/agent"])
        await sample_env.write_file(
            "/etc/passwd", "root:x:0:0:root:/root:/bin/sh\nagent:x:1000:1000::/home/agent:/bin/sh\n"
        )
        try:
            who = await sample_env.exec(
                ["sh", "-c", 'id -u; echo "$HOME"; echo "$MARK"; pwd; echo "$PATH"'],
                user="agent",
                env={"MARK": "kept"},
                cwd="/tmp",
            )
            assert who.success, who.stderr
            assert who.stdout.split("\n")[:4] == ["1000", "/home/agent", "kept", "/tmp"]
            assert "/usr/local/bin" in who.stdout.split("\n")[4]  # the image's PATH, not a pinned one
            assert (await sample_env.exec(["id", "-u"], user="root")).stdout == "0\n"
            with pytest.raises(SandboxUserUnsupportedError, match="no user 'nobody-here'"):
                await sample_env.exec(["id"], user="nobody-here")
        finally:
            await sample_env.exec(["rm", "-f", "/etc/passwd"])

    asyncio.run(main())


def test_running_a_file_that_is_not_executable_is_a_permission_error(sample_env: ForkdSandboxEnvironment) -> None:
    async def main() -> None:
        await sample_env.write_file("not-executable", "echo never\n")
        with pytest.raises(PermissionError, match="Permission denied"):
            await sample_env.exec(["/root/not-executable"])
        missing = await sample_env.exec(["no-such-program"])
        assert missing.returncode == 127 and "not found" in missing.stderr
        with pytest.raises(FileNotFoundError, match="/no/such/dir"):
            await sample_env.exec(["true"], cwd="/no/such/dir")

    asyncio.run(main())


def test_the_sample_vm_keeps_forkds_checkpoints(sample_env: ForkdSandboxEnvironment) -> None:
    async def main() -> None:
        await sample_env.write_file("state.txt", "before")
        async with sample_env.vm.checkpoint():
            await sample_env.write_file("state.txt", "after")
            assert await sample_env.read_file("state.txt") == "after"
        assert await sample_env.read_file("state.txt") == "before"  # rolled back when the block ended

    asyncio.run(main())


def test_connection_is_a_forkd_shell_in_a_copy_of_the_samples_starting_state(
    sample_env: ForkdSandboxEnvironment,
) -> None:
    connection = asyncio.run(sample_env.connection())
    assert connection.type == "forkd"
    argv = shlex.split(connection.command)
    assert argv[:2] == ["forkd", "shell"]
    forkd = Path(sys.executable).parent / "forkd"
    shm = Path(f"/dev/shm/forkd-inspect-shell-{os.getpid()}")
    completed = subprocess.run(
        [str(forkd), *argv[1:], "--no-pty"],
        input="uname -r\n",
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "FORKD_SHM_DIR": str(shm)},
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip().endswith("-amd64")
    assert not shm.exists() or os.listdir(shm) == []  # the shell's VM is gone with it
