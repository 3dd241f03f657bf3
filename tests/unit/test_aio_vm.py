"""AsyncVM over a real agent on a socketpair (no QEMU): cancellation paths that a real guest rarely shows."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from collections.abc import Iterator
from typing import Any

import pytest
from agent_pair import AgentPair
from support import wait_until_dead

from pytest_forkd.aio import AsyncVM
from pytest_forkd.aio import vm as aio_vm
from pytest_forkd.errors import VMError
from pytest_forkd.guest.client import AgentClient, AgentTimeout


class HostVM:
    """The part of VM that AsyncVM's guest operations use: a name, an agent client and exec."""

    def __init__(self, client: AgentClient) -> None:
        self.name = "socketpair-vm"
        self.agent = client
        self.closed = False

    def exec(self, command: Any, **options: Any) -> Any:
        options.pop("check")
        options.pop("timing")
        if options.get("max_output") is None:  # VM.exec resolves None to the VM's default
            options.pop("max_output", None)
        return self.agent.exec(command, **options)


@pytest.fixture
def host_vm() -> Iterator[HostVM]:
    with AgentPair() as pair, AgentClient(pair.host_end) as client:
        yield HostVM(client)


def test_a_cancellation_the_guest_does_not_confirm_marks_the_handle_broken(
    host_vm: HostVM, monkeypatch, tmp_path
) -> None:
    def no_answer(client: AgentClient, request_id: int, timeout: float = 0) -> dict:
        raise AgentTimeout("the guest agent did not answer 'cancel' within 15 s")

    monkeypatch.setattr(aio_vm, "cancel_request", no_answer)
    pid_file = tmp_path / "pid"
    running = f"echo $$ > {pid_file}; exec sleep 30"

    async def main() -> None:
        avm = AsyncVM(host_vm)  # type: ignore[arg-type]
        command = asyncio.create_task(avm.exec(running))
        while not pid_file.exists() or not pid_file.read_text().strip():
            await asyncio.sleep(0.02)
        command.cancel()
        with pytest.raises(asyncio.CancelledError):
            await command
        assert avm.broken is not None and "did not answer 'cancel'" in avm.broken
        with pytest.raises(
            VMError, match=re.escape(f"cannot be used for running 'true': cancelling running {running!r}")
        ):
            await avm.exec("true")

    try:
        asyncio.run(main())
    finally:  # the guest never heard of the cancellation: end the command, so the agent's teardown need not wait
        if pid_file.exists() and pid_file.read_text().strip():
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)


def test_a_cancelled_exec_is_killed_and_the_next_one_runs(host_vm: HostVM, tmp_path) -> None:
    pid_file = tmp_path / "pid"

    async def main() -> str:
        avm = AsyncVM(host_vm)  # type: ignore[arg-type]
        command = asyncio.create_task(avm.exec(f"echo $$ > {pid_file}; sleep 30"))
        while not pid_file.exists() or not pid_file.read_text().strip():
            await asyncio.sleep(0.02)
        command.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(command, timeout=10)
        return (await avm.exec("echo next")).stdout

    assert asyncio.run(main()) == "next\n"
    assert wait_until_dead(int(pid_file.read_text())), "the cancelled command still runs"
