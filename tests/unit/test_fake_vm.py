"""The VM handle and the factory on the fake engine: the API users call, its checks and its failures."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import tenacity

from pytest_forkd.core.factory import VMFactory
from pytest_forkd.core.vm import VM
from pytest_forkd.engine.fake import FakeEngine, FakeMachine, guest_path
from pytest_forkd.errors import (
    ConfigError,
    GuestCrashed,
    InvalidArgument,
    NetworkError,
    SnapshotError,
    VMError,
    VMStartError,
)
from pytest_forkd.guest.client import AgentTimeout
from pytest_forkd.storage import local_copy
from pytest_forkd.storage.snapshot import Snapshot

MEMORY_MIB = 64


@pytest.fixture(scope="module")
def base(factory: VMFactory) -> Snapshot:
    root = factory.boot(memory_mib=MEMORY_MIB)
    root.exec(["sh", "-c", "echo base > marker"])
    return root.freeze("vm-api-base", keep_running=False)


@pytest.fixture
def vm(base: Snapshot) -> Iterator[VM]:
    (child,) = base.fork()
    yield child
    child.close()


def test_exec_takes_stdin_env_cwd_and_a_shell_string(vm: VM) -> None:
    assert vm.exec(["cat"], stdin=b"fed").stdout == "fed"
    assert vm.exec("echo $ONE", env={"ONE": "1"}).stdout == "1\n"
    assert vm.exec("pwd", cwd=guest_path(vm, "tmp")).stdout.strip() == guest_path(vm, "tmp")
    assert vm._exec_untracked(["echo", "quiet"]).stdout == "quiet\n"
    assert vm._read_file_untracked(guest_path(vm, "marker")) == b"base\n"
    kinds = [entry["kind"] for entry in vm.transcript.entries]
    assert kinds.count("exec") == 3  # bookkeeping commands are not in the transcript


def test_bad_arguments_are_refused_before_the_guest_is_asked(vm: VM) -> None:
    with pytest.raises(InvalidArgument):
        vm.write_file(guest_path(vm, "x"), b"", mode=0o10000)
    with pytest.raises(InvalidArgument):
        vm.write_file("relative/path", b"")
    with pytest.raises(InvalidArgument):
        vm.exec("true", timeout=-1)
    with pytest.raises(InvalidArgument):
        vm.fork(0)
    with pytest.raises(InvalidArgument):
        vm.env = {"A": 1}  # type: ignore[dict-item]


def test_a_large_read_is_refused_past_max_size(vm: VM) -> None:
    path = guest_path(vm, "big")
    vm.write_file(path, b"x" * 4096)
    assert len(vm.read_file(path)) == 4096
    with pytest.raises(VMError):
        vm.read_file(path, max_size=100)


def test_the_handle_describes_itself(vm: VM) -> None:
    assert vm.name in repr(vm) and "closed" not in repr(vm)
    assert vm.memory_mib == MEMORY_MIB and vm.protocol_errors == {}
    assert vm.console_tail() == "" or isinstance(vm.console_tail(), str)
    assert vm.factory.engine.name == "fake"
    with vm as same:
        assert same is vm
    assert vm.closed and "closed" in repr(vm)


def test_a_child_that_cannot_map_its_snapshot_restores_from_a_local_copy(
    factory: VMFactory, base: Snapshot, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local_copy, "unmappable_reason", lambda snapshot: "read-only for this test")
    other = VMFactory(engine="fake")
    try:
        (child,) = base.with_owner(other).fork()
        assert child.machine.memory_layout().path != base.memory_path
        assert child.exec("cat marker").stdout == "base\n"
        child.close()
    finally:
        other.close()


def test_a_guest_that_never_answers_fails_the_start_with_its_console(
    factory: VMFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    def silent_agent(self: FakeMachine) -> None:
        self._guest_end.close()  # nobody will ever answer on the channel
        self._paused = False

    monkeypatch.setattr(FakeMachine, "_start_agent", silent_agent)
    with pytest.raises((VMStartError, GuestCrashed)):
        factory.boot(memory_mib=MEMORY_MIB, timeout=2)


def test_a_factory_closed_while_a_vm_starts_kills_it() -> None:
    closed = VMFactory(engine="fake")
    closed.close()
    with pytest.raises(VMStartError, match="closed"):
        closed.boot(memory_mib=MEMORY_MIB)


def test_children_cannot_get_a_network_their_snapshot_had_no_card_for(base: Snapshot) -> None:
    with pytest.raises(NetworkError, match="no network card"):
        base.fork(network="outbound")


def test_a_detached_snapshot_cannot_fork(base: Snapshot) -> None:
    with pytest.raises(SnapshotError):
        Snapshot.load_from(base.path).fork()


def test_a_factory_knows_its_vms(factory: VMFactory, base: Snapshot) -> None:
    (child,) = base.fork()
    try:
        assert child in factory.vms and child.exec("echo up").stdout == "up\n"
    finally:
        child.close()
    assert child not in factory.vms


def test_a_guest_killed_under_a_running_exec_is_a_crash(vm: VM) -> None:
    pid = vm.machine.agent_pid
    assert pid is not None
    os.kill(pid, 9)
    with pytest.raises((GuestCrashed, AgentTimeout, VMError)) as caught:
        vm.exec("true", timeout=5)
    assert "exited" in str(caught.value) or vm.closed


def test_the_fake_engine_describes_itself() -> None:
    facts = FakeEngine().describe()
    assert facts["engine"] == "fake" and facts["version"].startswith("fake-")
    assert FakeEngine().unavailable_reason() is None


def test_files_of_a_closed_vm_are_gone(factory: VMFactory, base: Snapshot) -> None:
    (child,) = base.fork()
    root = Path(guest_path(child))
    assert root.is_dir()
    child.close()
    assert not root.exists()


def test_background_processes_of_the_guest_pause_with_it_and_die_with_it(base: Snapshot) -> None:
    (child,) = base.fork()
    pid = int(child.exec("sleep 300 >/dev/null 2>&1 & echo $!").stdout)
    state = Path(f"/proc/{pid}/stat")
    child.machine.stop()
    for attempt in tenacity.Retrying(stop=tenacity.stop_after_delay(10), wait=tenacity.wait_fixed(0.01), reraise=True):
        with attempt:  # SIGSTOP takes effect once the process is scheduled
            assert state.read_text().rsplit(")", 1)[1].split()[0] == "T"  # stopped with the guest
    child.machine.resume()
    child.close()
    for attempt in tenacity.Retrying(stop=tenacity.stop_after_delay(10), wait=tenacity.wait_fixed(0.01), reraise=True):
        with attempt:  # SIGKILL, like SIGSTOP, takes effect once the process is scheduled
            assert not state.exists() or state.read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_the_accelerator_of_a_fake_factory_is_a_clear_error(factory: VMFactory) -> None:
    assert factory.engine.describe()["engine"] == "fake"
    with pytest.raises(ConfigError, match="runs the fake engine, which has no accelerator choice"):
        factory.accel_verdict(factory.engine.image("default"))


def test_a_snapshot_records_its_machine_as_the_engine_describes_it(vm: VM) -> None:
    snapshot = vm.branch()

    assert snapshot.machine == {"engine": "fake", "memory_mib": vm.memory_mib, "vcpus": 1}
    assert Snapshot.load_from(snapshot.path).machine == snapshot.machine
    (child,) = snapshot.fork(1)
    with child:
        assert child.origin is not None and child.origin.machine == snapshot.machine


def test_a_vms_default_backend_is_its_own_and_its_forks(vm: VM) -> None:
    factory_default = vm.factory.default_backend
    other = "full" if factory_default != "full" else "diff"
    vm.default_backend = other

    snapshot = vm.branch()
    children = vm.fork(1)

    assert snapshot.backend == other
    assert vm.factory.default_backend == factory_default  # the shared factory is left alone
    with children[0] as child:
        assert child.default_backend == other
