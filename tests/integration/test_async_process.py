"""AsyncGuestProcess against real guests: ``proc = await avm.spawn(...)``, ``async for line in proc.stdout``."""

from __future__ import annotations

import asyncio
import signal

import pytest

from pytest_forkd.aio import AsyncGuestProcess, AsyncVM
from pytest_forkd.core.vm import VM
from pytest_forkd.errors import CommandNotFound, ProcessTimeout


def test_async_for_over_stdout_wait_stdin_and_kill(vm: VM) -> None:
    async def main() -> None:
        avm = AsyncVM(vm)
        proc = await avm.spawn("for i in 1 2 3; do echo line$i; done; echo done >&2")
        assert isinstance(proc, AsyncGuestProcess) and proc.pid > 1
        assert [line async for line in proc.stdout] == [b"line1\n", b"line2\n", b"line3\n"]
        assert await proc.stderr.read() == b"done\n"
        assert await proc.wait() == 0

        cat = await avm.spawn(["cat"])
        await cat.write_stdin(b"ping\n")
        assert await cat.stdout.readline(timeout=60) == b"ping\n"
        await cat.close_stdin()
        assert await cat.wait(timeout=60) == 0

        sleeper = await avm.spawn(["sleep", "1000"])
        with pytest.raises(ProcessTimeout):
            await sleeper.wait(timeout=0.5)
        await sleeper.kill()
        assert await sleeper.wait(timeout=60) == -signal.SIGTERM
        assert sleeper.returncode == -signal.SIGTERM

        with pytest.raises(CommandNotFound, match="no-such-program"):
            await avm.spawn(["no-such-program"])
        assert (await avm.exec("echo usable")).stdout == "usable\n"

    asyncio.run(main())


def test_reading_several_processes_at_once_and_cancelling_a_read_loses_nothing(vm: VM) -> None:
    async def main() -> None:
        avm = AsyncVM(vm)
        slow = await avm.spawn("sleep 2; echo late")
        quick = await avm.spawn("echo early")
        # Both read concurrently: the quick one does not wait behind the slow one.
        late = asyncio.create_task(slow.stdout.readline())
        done, _ = await asyncio.wait(
            {late, asyncio.create_task(quick.stdout.readline())}, return_when=asyncio.FIRST_COMPLETED
        )
        assert [task.result() for task in done] == [b"early\n"]
        assert await late == b"late\n"

        feeder = await avm.spawn(["cat"])
        reader = asyncio.create_task(feeder.stdout.readline())
        await asyncio.sleep(0.2)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        await feeder.write_stdin("kept\n")
        assert await feeder.stdout.readline(timeout=60) == b"kept\n"
        async with feeder:
            assert feeder.returncode is None
        assert feeder.returncode == -signal.SIGKILL  # the block killed it
        assert await slow.wait(timeout=60) == 0

    asyncio.run(main())
