"""Session start latency of the OpenAI Agents SDK: forkd's sandbox client against the SDK's UnixLocalSandboxClient.

Measures, per session, the time from ``client.create()`` to the answer of the
first command (``create`` + ``start`` (manifest applied) + ``exec("true")``),
which is what a ``SandboxAgent`` waits for before its first tool call, and
prints one JSON object: p50/p95/max per client, the first forkd session
apart (it restores the ``base`` snapshot), and the host's conditions
(accelerator, cores, load). Sessions are made one after the other and
deleted after their first command, as in a suite of agent tests; forkd keeps
its default pool of one pre-restored child. ``forkd`` creates them back to
back (the pool's restore of the next child competes with the session for
the CPU); ``forkd_pool_ready`` waits before each until the pool has one
ready, as when the agent's own work takes longer than a restore.

    .venv/bin/python scripts/agents_sdk_latency.py [--rounds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from agents.sandbox.sandboxes.unix_local import UnixLocalSandboxClient
from agents.sandbox.session.sandbox_session import SandboxSession

from pytest_forkd.integrations.openai_agents import ForkdSandbox, ForkdSandboxClient, ForkdSandboxClientOptions

#: Pause before each session of the ``forkd_pool_ready`` series: longer than a child's restore under TCG.
POOL_REFILL_S = 1.5


def summary(samples: list[float]) -> dict[str, Any]:
    ordered = sorted(samples)
    return {
        "n": len(ordered),
        "p50_ms": round(statistics.median(ordered), 1),
        "p95_ms": round(ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))], 1),
        "max_ms": round(ordered[-1], 1),
    }


async def first_command_ms(
    create: Callable[[], Awaitable[SandboxSession]], delete: Callable[[SandboxSession], Awaitable[Any]]
) -> tuple[float, SandboxSession]:
    started = time.perf_counter()
    session = await create()
    await session.start()
    result = await session.exec("true")
    elapsed = (time.perf_counter() - started) * 1000
    assert result.exit_code == 0, result
    await delete(session)
    return elapsed, session


def accelerator(pid: int) -> str:
    """What the QEMU process was started with (``kvm`` or ``tcg``), read from its command line."""
    try:
        words = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
    except OSError:
        return "unknown"
    return "kvm" if "kvm" in words else "tcg" if "tcg" in words else "unknown"


async def measure(rounds: int) -> dict[str, Any]:
    local = UnixLocalSandboxClient()
    local_ms = [(await first_command_ms(lambda: local.create(options=None), local.delete))[0] for _ in range(rounds)]

    async with ForkdSandboxClient() as client:
        accel = "unknown"

        async def create() -> SandboxSession:
            nonlocal accel
            session = await client.create(options=ForkdSandboxClientOptions())
            assert isinstance(session, ForkdSandbox)
            if accel == "unknown":
                accel = accelerator(session.vm.machine.pid)
            return session

        first, _ = await first_command_ms(create, client.delete)
        forkd_ms = [(await first_command_ms(create, client.delete))[0] for _ in range(rounds)]
        pooled_ms = []
        for _ in range(rounds):
            await asyncio.sleep(POOL_REFILL_S)  # not measured: the pool restores the next child meanwhile
            pooled_ms.append((await first_command_ms(create, client.delete))[0])

    return {
        "measure": "create() to the answer of the first exec('true'), sequential sessions, each deleted after",
        "unix_local": summary(local_ms),
        "forkd": summary(forkd_ms),
        "forkd_pool_ready": summary(pooled_ms),
        "forkd_first_session_ms": round(first, 1),
        "host": {
            "accelerator": accel,
            "cores": os.cpu_count(),
            "loadavg": os.getloadavg(),
            "python": platform.python_version(),
            "machine": platform.machine(),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="sessions per client (default 20)")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args.rounds)), indent=2))


if __name__ == "__main__":
    main()
