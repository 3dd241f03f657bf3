"""The agent's process pump: one thread starts every spawned process and follows them all.

Without a VM: the real agent over a socketpair (see tests/agent_pair.py), the
real client and host handles. What a spawn does for its caller is in
test_agent_spawn.py; here, what the pump adds: no thread per process or per
spawn request, processes that need no stdin, one process whose following
breaks leaving the others (and the host) informed, and the thread ending with
the agent once its processes have.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from agent_pair import AgentPair

from pytest_forkd.analysis.transcript import Transcript
from pytest_forkd.core.process import GuestProcess, output_bounds
from pytest_forkd.errors import AgentError, ForkdError
from pytest_forkd.guest.agent import processes
from pytest_forkd.guest.client import AgentClient, spawn_request


class HostVM:
    """The part of a VM a GuestProcess uses, over an agent that runs on this host (as VM.spawn uses it)."""

    name = "host"
    closed = False

    def __init__(self, client: AgentClient) -> None:
        self.agent = client
        self.transcript = Transcript("host")

    def _call(self, what: str, function: Any, *args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    def spawn(self, command: list[str], **options: Any) -> GuestProcess:
        window, guest_limit = output_bounds(1 << 20)
        process = GuestProcess(self, command, pty=False, max_output=1 << 20, window=window)  # type: ignore[arg-type]
        process._start(spawn_request(command, max_output=guest_limit, **options))
        return process


@pytest.fixture
def pair() -> Iterator[AgentPair]:
    with AgentPair() as agent_pair:
        yield agent_pair


@pytest.fixture
def vm(pair: AgentPair) -> Iterator[HostVM]:
    with AgentClient(pair.host_end) as client:
        yield HostVM(client)


def _agent_threads(pair: AgentPair) -> list[str]:
    return sorted(thread.name for thread in threading.enumerate() if thread.name.startswith(("process-", "spawned-")))


def test_a_process_spawned_without_stdin_reads_end_of_file_at_once(vm: HostVM) -> None:
    proc = vm.spawn(["cat"], stdin=False)  # cat would wait for input forever with a pipe
    assert proc.stdout.read(timeout=10) == b""
    assert proc.wait(timeout=10) == 0
    with_stdin = vm.spawn(["cat"])
    with_stdin.write_stdin(b"typed\n")
    with_stdin.close_stdin()
    assert with_stdin.stdout.read(timeout=10) == b"typed\n"


def test_writing_to_a_process_without_stdin_is_refused(vm: HostVM) -> None:
    proc = vm.spawn(["sleep", "30"], stdin=False)
    with pytest.raises(AgentError, match="stdin of process .* was already closed"):
        proc.write_stdin(b"x")
    proc.kill()
    assert proc.wait(timeout=10) < 0


def test_stdin_must_be_a_boolean(vm: HostVM) -> None:
    request = {"op": "spawn", "argv": ["true"], "max_output": 1024, "stdin": "no"}
    call = vm.agent.spawn(request, listener=_Ignored())
    with pytest.raises(AgentError, match="'stdin' must be true or false"):
        call.wait_started(10)


def test_one_thread_follows_every_process_each_with_its_own_output(pair: AgentPair, vm: HostVM) -> None:
    procs = [vm.spawn(["cat"]) for _ in range(6)]
    assert _agent_threads(pair) == ["process-pump"]  # no thread per process, none per spawn request
    for number, proc in enumerate(procs):
        proc.write_stdin(f"to {number}\n")
    for number, proc in reversed(list(enumerate(procs))):
        assert proc.stdout.readline(timeout=10) == f"to {number}\n".encode()
        proc.close_stdin()
        assert proc.wait(timeout=10) == 0 and proc.stdout.read(timeout=10) == b""
    assert _agent_threads(pair) == ["process-pump"]


def test_a_process_whose_following_breaks_is_killed_and_the_others_go_on(
    vm: HostVM, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = vm.spawn(["cat"])
    healthy = vm.spawn(["cat"])
    ready = processes._Spawned.ready

    def failing(spawned: processes._Spawned, fd: int) -> None:
        if spawned.pid == broken.pid:
            raise RuntimeError("a bug in following it")
        ready(spawned, fd)

    monkeypatch.setattr(processes._Spawned, "ready", failing)
    broken.write_stdin(b"wakes the pump\n")
    with pytest.raises(ForkdError, match="stopped following process .*a bug in following it"):
        broken.wait(timeout=10)
    healthy.write_stdin(b"still followed\n")
    assert healthy.stdout.readline(timeout=10) == b"still followed\n"
    listed = {entry["pid"] for entry in vm.agent.processes()}
    assert broken.pid not in listed and healthy.pid in listed
    healthy.close_stdin()
    assert healthy.wait(timeout=10) == 0


def test_the_pump_ends_with_the_agent_once_its_processes_have() -> None:
    pair = AgentPair()
    with AgentClient(pair.host_end) as client:
        proc = HostVM(client).spawn(["true"])
        assert proc.wait(timeout=10) == 0
    assert pair.close(timeout=10)  # every thread the agent started has ended, the pump with them


class _Ignored:
    """A process listener that drops everything (for a spawn refused before it starts)."""

    def on_output(self, fd: int, data: bytes, skipped: int) -> None:
        pass

    def on_eof(self, fd: int) -> None:
        pass

    def on_exit(self, exit_code: int) -> None:
        pass

    def on_end(self, call: object) -> None:
        pass


def test_frames_written_together_arrive_whole_and_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_write_frames`` with more buffers than one writev takes, and a channel that takes few bytes at a time."""
    import os

    from pytest_forkd.guest.agent import common

    parts = [bytes([number % 251]) * (number % 7) for number in range(2500)]  # empty ones included
    real_writev = os.writev
    calls = []

    def stingy(fd: int, buffers: list[memoryview]) -> int:
        calls.append(len(buffers))
        return real_writev(fd, [buffers[0][:3]])  # a partial write every time

    monkeypatch.setattr(os, "writev", stingy)  # the module the agent calls it through
    read_end, write_end = os.pipe()
    received = bytearray()
    reader = threading.Thread(target=lambda: received.extend(_read_all(read_end)))
    reader.start()
    try:
        common._write_frames(write_end, parts)
    finally:
        os.close(write_end)
        reader.join(10)
        os.close(read_end)
    assert bytes(received) == b"".join(parts)
    assert max(calls) <= common._IOV_MAX


def _read_all(fd: int) -> bytes:
    import os

    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)
