"""Task and sample start on a container image, through Inspect's compose sandbox and mini-swe-agent's environment.

For one image reference (``--image``, e.g. the examples'
``oci-archive:examples/frameworks/images/calc-task.tar`` or a registry's
``127.0.0.1:PORT/name:tag``) it times, with forkd's provider code as the
harnesses call it:

- Inspect, ``sandbox=("forkd", "compose.yaml")`` naming the image:
  ``task_init`` (pull, disk, boot and snapshot the first time; restore of the
  stored snapshot later), then per sample ``sample_init`` (a child from the
  pool) and its first ``exec`` (``true``), one sample at a time;
- mini-swe-agent, ``ForkdEnvironment(image=...)``: the first environment
  (opens the image's session), then each next one while another is alive (a
  fork of the warm parent), and each one's first ``execute``.

Run it twice to see both the first-use and the cached ``task_init``. Prints
one JSON object with the host's conditions.

    .venv/bin/python scripts/harness_image_start.py --image oci-archive:$PWD/examples/frameworks/images/calc-task.tar
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def summary(samples: list[float]) -> dict[str, Any]:
    ordered = sorted(samples)
    return {
        "n": len(ordered),
        "p50_ms": round(statistics.median(ordered), 1),
        "max_ms": round(ordered[-1], 1),
    }


def milliseconds(started: float) -> float:
    return (time.perf_counter() - started) * 1000


async def inspect_compose(image: str, samples: int, pause: float) -> dict[str, Any]:
    from pytest_forkd.integrations.inspect_sandbox import ForkdSandboxEnvironment

    with tempfile.TemporaryDirectory(prefix="forkd-harness-start-") as folder:
        config = str(Path(folder) / "compose.yaml")
        Path(config).write_text(f"services:\n  default:\n    image: {image}\n    network_mode: none\n    init: true\n")
        started = time.perf_counter()
        await ForkdSandboxEnvironment.task_init("start", config)
        task_init_ms = milliseconds(started)
        init, first = [], []
        try:
            for _ in range(samples):
                started = time.perf_counter()
                environments = await ForkdSandboxEnvironment.sample_init("start", config, {})
                init.append(milliseconds(started))
                environment = environments["default"]
                started = time.perf_counter()
                await environment.exec(["true"])
                first.append(milliseconds(started))
                await ForkdSandboxEnvironment.sample_cleanup("start", config, environments, False)
                await asyncio.sleep(pause)  # the sample's own work: meanwhile the pool restores the next child
        finally:
            await ForkdSandboxEnvironment.task_cleanup("start", config, True)
    return {"task_init_ms": round(task_init_ms, 1), "sample_init": summary(init), "first_exec": summary(first)}


def mini_swe_agent(image: str, environments: int, pause: float) -> dict[str, Any]:
    from pytest_forkd.integrations.mini_swe_agent import ForkdEnvironment

    quiet = logging.getLogger("forkd-harness-start")  # mini-swe-agent's own logger prints to stdout
    quiet.setLevel(logging.WARNING)
    started = time.perf_counter()
    first = ForkdEnvironment(image=image, cwd="/", logger=quiet)
    first_ms = milliseconds(started)
    created, executed, again = [], [], []
    try:
        for _ in range(environments):
            time.sleep(pause)
            started = time.perf_counter()
            env = ForkdEnvironment(image=image, cwd="/", logger=quiet)
            created.append(milliseconds(started))
            started = time.perf_counter()
            env.execute({"command": "true"})
            executed.append(milliseconds(started))
            started = time.perf_counter()
            env.execute({"command": "true"})
            again.append(milliseconds(started))
            env.cleanup()
    finally:
        first.cleanup()
    return {
        "first_environment_ms": round(first_ms, 1),
        "environment": summary(created),
        "first_execute": summary(executed),
        "second_execute": summary(again),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--image", required=True, help="the image reference (any forkd takes; bare means docker://)")
    parser.add_argument("--samples", type=int, default=8, help="samples and environments timed (default %(default)s)")
    parser.add_argument(
        "--pause", type=float, default=1.0, help="seconds of 'work' between starts (default %(default)s)"
    )
    args = parser.parse_args()
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
    report = {
        "image": args.image,
        "host": {"cpus": os.cpu_count(), "load": os.getloadavg(), "kernel": platform.release()},
        "inspect_compose": asyncio.run(inspect_compose(args.image, args.samples, args.pause)),
        "mini_swe_agent": mini_swe_agent(args.image, args.samples, args.pause),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
