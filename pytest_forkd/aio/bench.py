"""``forkd bench`` figures of the asyncio API: how concurrent awaited commands really are.

Three ``exec("sleep 1")`` gathered in three VMs, and three in one VM, take
about one second each when they run at the same time and three when they run
one after another; ``async_cancel_ms`` is how long a cancelled
``exec("sleep 30")`` keeps its awaiting task waiting (the command killed in
the guest and reaped).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from .vm import AsyncVM

if TYPE_CHECKING:
    from pytest_forkd.storage.snapshot import Snapshot


async def _gathered_ms(vms: list[AsyncVM], command: str) -> float:
    started = time.perf_counter()
    await asyncio.gather(*(vm.exec(command) for vm in vms))
    return (time.perf_counter() - started) * 1000


async def _cancel_ms(vm: AsyncVM) -> float:
    command = asyncio.create_task(vm.exec("sleep 30"))
    await asyncio.sleep(0.3)
    started = time.perf_counter()
    command.cancel()
    try:
        await command
    except asyncio.CancelledError:
        pass
    return (time.perf_counter() - started) * 1000


def measure_async(base: Snapshot, repeats: int) -> dict[str, list[float]]:
    """Samples (ms) of the async figures, in three children of ``base`` that are closed afterwards."""

    async def main() -> dict[str, list[float]]:
        vms = [AsyncVM(child) for child in base.fork(3)]
        try:
            await asyncio.gather(*(vm.exec("true") for vm in vms))  # first commands translate code
            samples: dict[str, list[float]] = {
                "async_gather_3vm_ms": [],
                "async_gather_1vm_ms": [],
                "async_cancel_ms": [],
            }
            for _ in range(repeats):
                samples["async_gather_3vm_ms"].append(await _gathered_ms(vms, "sleep 1"))
                samples["async_gather_1vm_ms"].append(await _gathered_ms([vms[0]] * 3, "sleep 1"))
                samples["async_cancel_ms"].append(await _cancel_ms(vms[1]))
            return samples
        finally:
            await asyncio.gather(*(vm.close() for vm in vms))

    return asyncio.run(main())
