"""VM.spawn through the whole VM layer on the fake engine (the real agent as a host process): fast, no QEMU.

What needs a real guest (forks carrying the process, cgroups, terminals in
the image) is tested in tests/integration/test_vm_spawn.py.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from pytest_forkd.core.factory import VMFactory
from pytest_forkd.core.vm import VM
from pytest_forkd.errors import CommandNotFound, NoSuchProcess, ProcessTimeout, VMError


@pytest.fixture
def vm() -> Iterator[VM]:
    factory = VMFactory(engine="fake")
    try:
        yield factory.boot()
    finally:
        factory.close()


def test_spawn_uses_the_vm_defaults_and_records_the_transcript(vm: VM) -> None:
    vm.env = {"GREETING": "hello"}
    vm.cwd = "/"
    proc = vm.spawn('echo "$GREETING from $(pwd)"; cat')
    assert proc.stdout.readline(timeout=30) == b"hello from /\n"
    proc.write_stdin("echoed\n")
    assert proc.stdout.readline(timeout=30) == b"echoed\n"
    with pytest.raises(ProcessTimeout):
        proc.wait(timeout=0.05)
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGTERM
    kinds = [entry["kind"] for entry in vm.transcript.entries]
    assert kinds[-2:] == ["spawn", "signal"]
    assert vm.transcript.entries[-2]["env_keys"] == ["GREETING"] and vm.transcript.entries[-2]["pid"] == proc.pid
    assert vm.process(proc.pid) is proc


def test_missing_program_and_unknown_pid_leave_the_vm_usable(vm: VM) -> None:
    with pytest.raises(CommandNotFound, match="no-such-binary-7"):
        vm.spawn(["no-such-binary-7"])
    with pytest.raises(NoSuchProcess, match="no spawned process 4242424"):
        vm.process(4242424)
    assert vm.exec(["echo", "ok"]).stdout == "ok\n"


def test_closing_the_vm_ends_the_handle_with_a_clear_error(vm: VM) -> None:
    proc = vm.spawn(["sleep", "100"])
    vm.close()
    with pytest.raises(VMError, match="closed"):
        proc.wait(timeout=30)
