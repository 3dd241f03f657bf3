"""Sample start latency of Inspect's ``forkd`` sandbox against Inspect's ``local`` sandbox, measured through Inspect.

Runs real Inspect evals (``inspect_ai.eval``, ``mockllm/model``, offline)
whose samples each run one command in their sandbox, and times, per sample:

- ``sample_init_ms``: the provider's ``sample_init`` (forkd: a copy-on-write
  child of the snapshot, from the pool; local: a temporary directory);
- ``first_exec_ms``: the sandbox's first command, which Inspect runs itself
  during the sample's init (its root-access probe): for forkd the new
  child's first answer, which TCG pays extra for;
- ``ready_ms``: the two together, what a sample waits before its solver runs
  (Inspect's own scheduling around them is left out: it adds a random pause
  of up to 1 s before ``sample_init`` for every provider that has a
  concurrency limit, which ``forkd`` has and ``local`` has not).

Each provider runs the same evals: ``--samples`` samples one at a time
(``max_samples=1``), then four at a time. The first forkd eval also opens the
session (restores ``base``, starts the pool): that is ``task_init``, reported
apart. Prints one JSON object with the host's conditions.

    .venv/bin/python scripts/inspect_sample_start.py [--samples 16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from inspect_ai import Task
from inspect_ai import eval as inspect_eval
from inspect_ai.dataset import Sample
from inspect_ai.solver import Generate, Solver, TaskState, solver
from inspect_ai.util import SandboxEnvironment, sandbox
from inspect_ai.util._sandbox.local import LocalSandboxEnvironment

from pytest_forkd.integrations.inspect_sandbox import ForkdSandboxEnvironment


def summary(samples: list[float]) -> dict[str, Any]:
    ordered = sorted(samples)
    return {
        "n": len(ordered),
        "p50_ms": round(statistics.median(ordered), 1),
        "p95_ms": round(ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))], 1),
        "max_ms": round(ordered[-1], 1),
    }


def accelerator(pid: int) -> str:
    """What the QEMU process was started with (``kvm`` or ``tcg``), read from its command line."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            words = cmdline.read().decode(errors="replace")
    except OSError:
        return "unknown"
    return "kvm" if "kvm" in words else "tcg" if "tcg" in words else "unknown"


class Timings:
    """Per-sample times recorded by the wrapped provider methods."""

    def __init__(self) -> None:
        self.sample_init: list[float] = []
        self.first_exec: list[float] = []
        self.task_init: list[float] = []
        self.accelerator = "n/a"

    def report(self) -> dict[str, Any]:
        ready = [init + first for init, first in zip(self.sample_init, self.first_exec)]
        return {
            "sample_init": summary(self.sample_init),
            "first_exec": summary(self.first_exec),
            "ready": summary(ready),
        }


def instrument(cls: type[SandboxEnvironment], timings: Timings) -> Callable[[], None]:
    """Time ``cls``'s task_init and sample_init and each sample's first exec; returns the undo."""
    original_sample_init = cls.__dict__["sample_init"]
    original_task_init = cls.__dict__.get("task_init")

    async def sample_init(klass: Any, task_name: str, config: Any, metadata: dict[str, str]) -> Any:
        started = time.perf_counter()
        environments = await original_sample_init.__func__(klass, task_name, config, metadata)
        timings.sample_init.append((time.perf_counter() - started) * 1000)
        environment = environments["default"]
        if isinstance(environment, ForkdSandboxEnvironment):
            timings.accelerator = accelerator(environment.vm.sync.machine.pid)
        exec_method = environment.exec
        first = [True]

        async def exec_timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return await exec_method(*args, **kwargs)
            finally:
                if first[0]:
                    first[0] = False
                    timings.first_exec.append((time.perf_counter() - started) * 1000)

        environment.exec = exec_timed
        return environments

    async def task_init(klass: Any, task_name: str, config: Any) -> None:
        started = time.perf_counter()
        if original_task_init is not None:
            await original_task_init.__func__(klass, task_name, config)
        timings.task_init.append((time.perf_counter() - started) * 1000)

    cls.sample_init = classmethod(sample_init)  # type: ignore[method-assign, assignment]
    cls.task_init = classmethod(task_init)  # type: ignore[method-assign, assignment]

    def undo() -> None:
        cls.sample_init = original_sample_init  # type: ignore[method-assign]
        if original_task_init is not None:
            cls.task_init = original_task_init  # type: ignore[method-assign]
        else:
            del cls.task_init

    return undo


@solver
def run_true() -> Solver:
    """Run one command in the sample's sandbox, as an agent's first tool call would."""

    async def solve(state: TaskState, generate: Generate) -> TaskState:
        result = await sandbox().exec(["true"])
        assert result.success, result.stderr
        return state

    return solve


def run(provider: str, samples: int, max_samples: int, log_dir: str) -> None:
    dataset = [Sample(input="start", id=f"s{i}") for i in range(samples)]
    task = Task(dataset=dataset, solver=run_true(), sandbox=provider)
    [log] = inspect_eval(task, model="mockllm/model", max_samples=max_samples, log_dir=log_dir, display="none")
    if log.status != "success":
        raise SystemExit(f"{provider} eval {log.status}: {log.error}")


def measure(samples: int) -> dict[str, Any]:
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as log_dir:
        for provider, cls in (("local", LocalSandboxEnvironment), ("forkd", ForkdSandboxEnvironment)):
            for max_samples in (1, 4):
                timings = Timings()
                undo = instrument(cls, timings)
                try:
                    started = time.perf_counter()
                    run(provider, samples, max_samples, log_dir)
                    wall = (time.perf_counter() - started) * 1000
                finally:
                    undo()
                entry = timings.report()
                entry["task_init_ms"] = round(sum(timings.task_init), 1)
                entry["eval_wall_ms"] = round(wall, 1)
                if provider == "forkd":
                    report["accelerator"] = timings.accelerator
                report[f"{provider}_max_samples_{max_samples}"] = entry
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--samples", type=int, default=16, help="samples per eval (default %(default)s)")
    args = parser.parse_args()
    results = measure(args.samples)
    results["measure"] = (
        "per sample: the provider's sample_init, the sandbox's first exec (Inspect's root probe), and their sum; "
        "an eval of N samples one at a time, then four at a time"
    )
    results["host"] = {
        "accelerator": results.pop("accelerator", "unknown"),
        "cores": len(os.sched_getaffinity(0)),
        "loadavg": os.getloadavg(),
        "python": platform.python_version(),
        "inspect_ai": __import__("inspect_ai").__version__,
    }
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
