"""The asyncio API against real guests: concurrency, cancellation, checkpoints, misuse.

Each test drives its own event loop with asyncio.run, so these tests need no
async pytest plugin (the plugin's fixtures are tested under pytest-asyncio and
anyio in tests/plugin).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import pytest
from support import is_running, processes_mentioning

from pytest_forkd import AsyncSnapshot, AsyncVM, VMError, WrongEventLoop, aboot
from pytest_forkd.core.vm import VM
from pytest_forkd.errors import AgentError, NetworkError, WaitTimeout
from pytest_forkd.storage.snapshot import Snapshot
from pytest_forkd.waiting import poll_until

T = TypeVar("T")

# busybox ps lists "PID USER TIME COMMAND"; the brackets keep grep from finding itself.
COUNT_SLEEPERS = "ps | grep -c '[s]leep 30' || true"


def run(main: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(main())


async def guest_interval(vm: AsyncVM, command: str) -> tuple[float, float]:
    """When ``command`` ran, in host monotonic seconds: its end, less the duration the guest measured."""
    result = await vm.exec(command)
    ended = time.monotonic()
    assert result.ok, result.stderr
    return ended - result.duration_ms / 1000, ended


def all_overlap(intervals: list[tuple[float, float]]) -> bool:
    """Whether some instant lies inside every interval: the commands ran at the same time."""
    return max(start for start, _ in intervals) < min(end for _, end in intervals)


@pytest.fixture
def children(base_snapshot: Snapshot) -> Iterator[list[VM]]:
    vms = base_snapshot.fork(3)
    yield vms
    for vm in vms:
        vm.close()


def test_commands_in_three_vms_run_at_the_same_time(children: list[VM]) -> None:
    async def main() -> list[tuple[float, float]]:
        vms = [AsyncVM(child) for child in children]
        await asyncio.gather(*(vm.exec("true") for vm in vms))  # first commands translate code: keep them out
        return await asyncio.gather(*(guest_interval(vm, "sleep 1") for vm in vms))

    intervals = run(main)

    assert all_overlap(intervals), f"the three commands ran one after another: {intervals}"


def test_commands_in_one_vm_run_at_the_same_time(vm: VM) -> None:
    async def main() -> list[tuple[float, float]]:
        avm = AsyncVM(vm)
        await avm.exec("true")
        return await asyncio.gather(*(guest_interval(avm, "sleep 1") for _ in range(3)))

    intervals = run(main)

    assert all_overlap(intervals), f"the three commands ran one after another: {intervals}"


def test_the_event_loop_keeps_running_while_a_command_runs(vm: VM) -> None:
    async def main() -> int:
        avm = AsyncVM(vm)
        ticks = 0
        command = asyncio.create_task(avm.exec("sleep 1"))
        while not command.done():
            ticks += 1
            await asyncio.sleep(0.01)
        await command
        return ticks

    assert run(main) > 10


def test_cancelled_exec_kills_the_command_and_the_vm_goes_on(vm: VM) -> None:
    async def main() -> tuple[str, str]:
        avm = AsyncVM(vm)
        command = asyncio.create_task(avm.exec("sleep 30 & sleep 30"))
        while (await avm.exec(COUNT_SLEEPERS)).stdout.strip() != "2":
            await asyncio.sleep(0.05)
        command.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(command, timeout=10)  # far below the command's 30 s
        left = (await avm.exec(COUNT_SLEEPERS)).stdout.strip()
        return left, (await avm.exec("echo next")).stdout

    left, following = run(main)

    assert left == "0", "the cancelled command (or its background child) still runs in the guest"
    assert following == "next\n"


def test_a_timeout_around_exec_cancels_the_command(vm: VM) -> None:
    async def main() -> str:
        avm = AsyncVM(vm)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(avm.exec("sleep 30"), timeout=0.5)
        return (await avm.exec(COUNT_SLEEPERS)).stdout.strip()

    assert run(main) == "0"


def test_an_anyio_cancel_scope_kills_the_command(vm: VM) -> None:
    anyio = pytest.importorskip("anyio")

    async def main() -> str:
        avm = AsyncVM(vm)
        with anyio.move_on_after(0.5) as scope:  # re-delivers the cancellation at every loop turn
            await avm.exec("sleep 30")
        assert scope.cancelled_caught
        return (await avm.exec(COUNT_SLEEPERS)).stdout.strip()

    assert anyio.run(main) == "0"


def test_cancelled_upload_leaves_old_contents_or_new_never_part(vm: VM) -> None:
    data = bytes(range(256)) * (24 * 4096)  # 24 MiB: many frames, takes a while under emulation

    async def main() -> tuple[bytes, str]:
        avm = AsyncVM(vm)
        await avm.write_file("/root/big", b"old")
        upload = asyncio.create_task(avm.write_file("/root/big", data))
        await asyncio.sleep(0.2)
        upload.cancel()
        with pytest.raises(asyncio.CancelledError):
            await upload
        contents = await avm.read_file("/root/big")
        listing = (await avm.exec(["ls", "-a", "/root"])).stdout
        return contents, listing

    contents, listing = run(main)

    assert contents in (b"old", data)
    assert "forkd-upload" not in listing, "the cancelled upload left its temporary file"
    assert vm.exec("echo usable").stdout == "usable\n"


def test_cancelled_read_leaves_the_vm_usable(vm: VM) -> None:
    vm.exec("head -c 20000000 /dev/zero > /root/zeros")

    async def main() -> str:
        avm = AsyncVM(vm)
        read = asyncio.create_task(avm.read_file("/root/zeros"))
        await asyncio.sleep(0.05)
        read.cancel()
        with pytest.raises(asyncio.CancelledError):
            await read
        return (await avm.exec("echo usable")).stdout

    assert run(main) == "usable\n"


def test_files_branch_and_fork(vm: VM) -> None:
    async def main() -> list[bytes]:
        avm = AsyncVM(vm)
        await avm.write_file("/root/state", "parent\n")
        snapshot = await avm.branch()
        assert isinstance(snapshot, AsyncSnapshot) and snapshot.tag == snapshot.sync.tag
        forks = await snapshot.fork(2)
        try:
            await forks[0].write_file("/root/state", "first child\n")
            return [await child.read_file("/root/state") for child in (avm, *forks)]
        finally:
            await asyncio.gather(*(child.close() for child in forks))

    assert run(main) == [b"parent\n", b"first child\n", b"parent\n"]


def test_checkpoint_rolls_back_and_keep_keeps(vm: VM) -> None:
    async def main() -> tuple[int, bytes]:
        avm = AsyncVM(vm)
        async with avm.checkpoint():
            await avm.exec("rm -rf /root/marker")
        rolled_back = (await avm.exec(["test", "-e", "/root/marker"])).exit_code
        async with avm.checkpoint() as checkpoint:
            await avm.write_file("/root/kept", "yes")
            checkpoint.keep()
        return rolled_back, await avm.read_file("/root/kept")

    assert run(main) == (0, b"yes")


def test_forks_of_a_checkpoint_are_independent(vm: VM) -> None:
    async def main() -> list[str]:
        avm = AsyncVM(vm)
        checkpoint = await avm.checkpoint()
        children = await checkpoint.fork(3)
        try:
            await asyncio.gather(*(child.write_file("/root/who", str(n)) for n, child in enumerate(children)))
            return [(await child.read_file("/root/who")).decode() for child in children]
        finally:
            await asyncio.gather(*(child.close() for child in children))

    assert run(main) == ["0", "1", "2"]


def test_cancelled_fork_leaks_no_vm(vm: VM) -> None:
    factory = vm.factory
    before = set(factory.vms)

    async def main() -> None:
        avm = AsyncVM(vm)
        fork = asyncio.create_task(avm.fork(2))
        await asyncio.sleep(0.01)
        fork.cancel()
        with pytest.raises(asyncio.CancelledError):
            await fork

    run(main)

    try:
        poll_until(lambda: not set(factory.vms) - before, timeout=60, interval=0.1, what="the children to close")
    except WaitTimeout:
        pytest.fail("the children of a cancelled fork were left running")


def test_closed_vm_says_so(base_snapshot: Snapshot) -> None:
    child = base_snapshot.fork(1)[0]

    async def main() -> None:
        avm = AsyncVM(child)
        await avm.close()
        await avm.close()  # idempotent
        with pytest.raises(VMError, match="is closed"):
            await avm.exec("true")

    run(main)
    assert not is_running(child.machine.pid)


def test_closing_while_a_command_runs_says_the_vm_was_closed(base_snapshot: Snapshot) -> None:
    child = base_snapshot.fork(1)[0]

    async def main() -> None:
        avm = AsyncVM(child)
        command = asyncio.create_task(avm.exec("sleep 30"))
        await asyncio.sleep(0.3)
        await avm.close()
        with pytest.raises(VMError, match="was closed while running"):
            await command

    try:
        run(main)
    finally:
        child.close()


def test_a_handle_belongs_to_one_event_loop(vm: VM) -> None:
    async def first_use() -> AsyncVM:
        avm = AsyncVM(vm)
        await avm.exec("true")
        return avm

    avm = run(first_use)

    with pytest.raises(WrongEventLoop, match="belongs to the event loop that first used it"):
        run(lambda: avm.exec("true"))
    # The VM itself is fine: a new handle works in this loop.
    assert run(lambda: AsyncVM(avm.sync).exec("echo ok")).stdout == "ok\n"


def test_a_handle_used_from_another_thread_is_refused(vm: VM) -> None:
    errors: list[BaseException] = []

    async def main() -> None:
        avm = AsyncVM(vm)
        await avm.ping()

        def other_thread() -> None:
            try:
                asyncio.run(avm.ping())
            except BaseException as exc:  # noqa: BLE001 - inspected below
                errors.append(exc)

        thread = threading.Thread(target=other_thread)
        thread.start()
        await asyncio.to_thread(thread.join)

    run(main)
    assert len(errors) == 1 and isinstance(errors[0], WrongEventLoop)


def test_aboot_closes_the_vm_when_the_block_ends() -> None:
    async def main() -> tuple[str, int]:
        async with aboot() as vm:
            output = (await vm.exec("echo booted")).stdout
            pid = vm.sync.machine.pid
        assert vm.closed
        return output, pid

    output, pid = run(main)

    assert output == "booted\n"
    assert not is_running(pid)


def test_a_cancelled_aboot_closes_the_vm_once_it_is_up() -> None:
    from pytest_forkd.core.factory import default_factory

    factory = default_factory()
    before = set(factory.vms)

    async def main() -> None:
        booting = asyncio.create_task(aboot().__aenter__())
        await asyncio.sleep(0.5)
        booting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await booting

    run(main)

    def booting() -> list[threading.Thread]:
        return [thread for thread in threading.enumerate() if thread.name.startswith("forkd-async-boot")]

    assert booting(), "the boot should still be under way when its task was cancelled"
    # The boot finishes in the background, then the VM is closed.
    poll_until(lambda: not booting(), timeout=120, interval=0.1, what="the cancelled boot to finish")
    assert not set(factory.vms) - before, "the VM of a cancelled aboot() was left running"
    assert not [line for line in processes_mentioning(factory.run_dir.path) if "qemu-system" in line]


def test_per_vm_env_and_cwd_are_the_vms(vm: VM) -> None:
    async def main() -> str:
        avm = AsyncVM(vm)
        avm.env = {"GREETING": "hi"}
        avm.cwd = "/tmp"
        return (await avm.exec('echo "$GREETING $(pwd)"')).stdout

    assert run(main) == "hi /tmp\n"
    assert vm.env == {"GREETING": "hi"} and vm.cwd == "/tmp"


def test_the_async_handle_takes_what_the_sync_one_takes(vm: VM) -> None:
    """The parameters and members that tests/unit/test_async_parity.py requires, against a real guest."""

    async def main() -> None:
        avm = AsyncVM(vm)
        assert (await avm.exec("tty", pty=True)).stdout.startswith("/dev/pts/")
        await avm.write_file("/tmp/big", b"x" * 100)
        with pytest.raises(AgentError, match="more than the 10 the host accepts"):
            await avm.read_file("/tmp/big", max_size=10)
        assert await avm.read_file("/tmp/big", max_size=100) == b"x" * 100

        async with avm.checkpoint(manifest=True) as cp:
            await avm.write_file("/root/new-file", b"new\n")
            assert "/root/new-file" in (await cp.changes(include=["/root"])).added
            assert "/root/new-file" in (await avm.changes(cp, include=["/root"])).added
        assert (await avm.exec("test -e /root/new-file")).exit_code == 1, "the checkpoint did not roll back"

        assert avm.defaults() == vm.defaults() and avm.protocol_errors == {}
        assert avm.machine is vm.machine and avm.factory is vm.factory and avm.agent is vm.agent
        assert avm.network.has_card is False and avm.forwards == {}
        with pytest.raises(NetworkError, match="no network"):
            _ = avm.host_address
        with pytest.raises(NetworkError, match="no network"):
            await avm.forward(8000)
        with pytest.raises(NetworkError, match="no network card"):
            await avm.fork(1, network="outbound")

    run(main)


def test_async_forks_take_a_network_policy_and_forward_ports(outbound_snapshot: Snapshot) -> None:
    async def main() -> None:
        asnap = AsyncSnapshot(outbound_snapshot)
        (avm,) = await asnap.fork(1, network={"mode": "host", "allow": [8080]})
        async with avm:
            assert avm.network.mode == "host" and avm.network.allow == (8080,)
            assert avm.host_address == "10.0.2.100"
            host_port = await avm.forward(9000, check=False)
            assert avm.forwards == {9000: host_port}
            (child,) = await avm.fork(1, network="outbound")
            async with child:
                assert child.host_address == "10.0.2.2"
                assert 9000 in child.forwards, "a child keeps the forwards of its parent"

    run(main)
