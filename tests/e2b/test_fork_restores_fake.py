"""``sandbox.fork(count)`` answers once the branch is taken; each child is restored in the background.

On the fake engine, with the factory's restores held at a gate, so that a
child is caught while it is being restored: its calls wait for it, a restore
that fails surfaces as the child's start error, a kill during the restore
leaves nothing, the source can go at once, and a server that stops meanwhile
leaves no VM. The SDK is the official one throughout (see
test_server_fake.py for the rest of the server).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

e2b = pytest.importorskip("e2b")

pytestmark = pytest.mark.slow  # no QEMU, but a server and fake-engine VMs
from e2b import Sandbox, SandboxNotFoundException, SandboxNotRunningException  # noqa: E402

from pytest_forkd.e2b.server import E2BServer  # noqa: E402
from pytest_forkd.errors import VMStartError  # noqa: E402

#: Long enough for a call that does not wait to have finished on the fake engine (a few ms), and no longer.
STILL_WAITING_S = 0.5


class RestoreGate:
    """Stands in for ``factory.fork_snapshot``: each restore waits at the gate, then runs (or fails)."""

    def __init__(self, real: Callable[..., Any], failure: Exception | None = None) -> None:
        self.real = real
        self.failure = failure
        self.opened = threading.Event()
        self.arrived = threading.Semaphore(0)
        self.snapshots: list[Any] = []

    def __call__(self, snapshot: Any, n: int = 1, **kwargs: Any) -> Any:
        self.snapshots.append(snapshot)
        self.arrived.release()
        if not self.opened.wait(60):
            raise AssertionError("the test never opened the restore gate")
        if self.failure is not None:
            raise self.failure
        return self.real(snapshot, n, **kwargs)

    def wait_for(self, count: int) -> None:
        for _ in range(count):
            assert self.arrived.acquire(timeout=30), "a fork's restore never began"


@pytest.fixture
def gate(fake_e2b: E2BServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., RestoreGate]]:
    """Installs a :class:`RestoreGate` on the server's factory (after the test made its sources)."""
    factory = fake_e2b.session.factory
    made: list[RestoreGate] = []

    def install(failure: Exception | None = None) -> RestoreGate:
        made.append(RestoreGate(factory.fork_snapshot, failure))
        monkeypatch.setattr(factory, "fork_snapshot", made[-1])
        return made[-1]

    yield install
    for each in made:  # nothing is left waiting at a gate after the test
        each.opened.set()


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=4, thread_name_prefix="test-fork-client") as executor:
        yield executor


def guest_dir(server: E2BServer, sandbox: Any) -> str:
    return str(server.vm(sandbox.sandbox_id).exec("pwd").stdout.strip())


def test_fork_answers_before_the_restores_and_the_childrens_calls_wait_for_them(
    fake_e2b: E2BServer, gate: Callable[..., RestoreGate], pool: ThreadPoolExecutor
) -> None:
    source = Sandbox.create()
    where = guest_dir(fake_e2b, source)
    source.files.write(f"{where}/state", "before")
    restores = gate()
    children = source.fork(count=2)  # answered with both restores held at the gate
    restores.wait_for(2)
    ids = {child.sandbox_id for child in children}
    listed = {item.sandbox_id: item.state.value for item in Sandbox.list().next_items()}
    assert {listed[sandbox_id] for sandbox_id in ids} == {"running"}  # E2B has no starting state
    assert children[0].get_info().state.value == "running"
    command = pool.submit(children[0].commands.run, "echo restored")
    time.sleep(STILL_WAITING_S)
    assert not command.done()  # waits for the child's restore
    source.files.write(f"{where}/state", "after the fork")  # the source runs on meanwhile
    restores.opened.set()
    assert command.result(60).stdout == "restored\n"
    for child in children:
        assert child.files.read(f"{guest_dir(fake_e2b, child)}/state") == "before"
    assert source.files.read(f"{where}/state") == "after the fork"


def test_a_restore_that_fails_is_the_childs_start_error_for_every_call(
    fake_e2b: E2BServer, gate: Callable[..., RestoreGate], pool: ThreadPoolExecutor
) -> None:
    source = Sandbox.create()
    vms_before = set(fake_e2b.session.factory.vms)
    restores = gate(VMStartError("VM child9: the guest agent did not answer within 90 s"))
    child, other = source.fork(count=2)
    restores.wait_for(2)
    waiting = pool.submit(child.commands.run, "true")
    time.sleep(STILL_WAITING_S)
    assert not waiting.done()
    restores.opened.set()
    with pytest.raises(SandboxNotRunningException, match="was not found.*did not answer within 90 s"):
        waiting.result(60)
    with pytest.raises(SandboxNotRunningException, match="did not answer within 90 s"):  # later: the same error
        other.files.read("/etc/hostname")
    with pytest.raises(SandboxNotFoundException):  # the SDK names the id only (the body says why)
        child.get_info()
    assert not {child.sandbox_id, other.sandbox_id} & set(fake_e2b.sandbox_ids())
    assert child.kill() is False
    assert source.commands.run("echo on").stdout == "on\n" and source.is_running()
    assert set(fake_e2b.session.factory.vms) == vms_before
    assert source.kill() is True
    assert not restores.snapshots[0].path.exists()  # the branch went with the last that held it


def test_killing_a_child_during_its_restore_waits_for_it_and_leaves_nothing(
    fake_e2b: E2BServer, gate: Callable[..., RestoreGate], pool: ThreadPoolExecutor
) -> None:
    source = Sandbox.create()
    vms_before = set(fake_e2b.session.factory.vms)
    restores = gate()
    (child,) = source.fork(count=1)
    restores.wait_for(1)
    killing = pool.submit(child.kill)
    time.sleep(STILL_WAITING_S)
    assert not killing.done()  # a kill waits for the restore, then ends the VM it made
    restores.opened.set()
    assert killing.result(60) is True
    assert child.sandbox_id not in fake_e2b.sandbox_ids()
    assert set(fake_e2b.session.factory.vms) == vms_before
    with pytest.raises(SandboxNotFoundException):
        child.get_info()
    assert source.kill() is True
    assert not restores.snapshots[0].path.exists()


def test_the_source_can_be_killed_at_once_and_its_children_come_up(
    fake_e2b: E2BServer, gate: Callable[..., RestoreGate]
) -> None:
    source = Sandbox.create()
    source.files.write(f"{guest_dir(fake_e2b, source)}/state", "from the source")
    restores = gate()
    children = source.fork(count=2)
    assert source.kill() is True  # the source's lock is free once the branch is taken
    restores.wait_for(2)
    restores.opened.set()
    for child in children:
        assert child.files.read(f"{guest_dir(fake_e2b, child)}/state") == "from the source"
        assert child.commands.run("echo up").stdout == "up\n"
    assert source.sandbox_id not in fake_e2b.sandbox_ids()


def test_a_server_stopped_during_a_restore_leaves_no_vm(fake_session: Any, pool: ThreadPoolExecutor) -> None:
    from pytest_forkd.e2b.config import ServerConfig

    factory = fake_session.factory
    vms_before = set(factory.vms)
    server = E2BServer(fake_session, ServerConfig(), prepare_guest=False).start()
    try:
        source = Sandbox.create(api_key=server.api_key, api_url=server.url, sandbox_url=server.url, debug=False)
        restores = RestoreGate(factory.fork_snapshot)
        factory.fork_snapshot = restores
        try:
            source.fork(count=2)
            restores.wait_for(2)
            stopping = pool.submit(server.stop)
            time.sleep(STILL_WAITING_S)
            assert not stopping.done()  # stopping kills every sandbox, each once its restore ended
            restores.opened.set()
            stopping.result(60)
        finally:
            restores.opened.set()
            del factory.fork_snapshot
    finally:
        server.stop()
    assert set(factory.vms) == vms_before
