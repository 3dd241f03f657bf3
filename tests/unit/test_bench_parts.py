"""Which measurements each ``forkd bench --parts`` set runs, on the fake engine.

The figures themselves are measured on real VMs (tests/integration/test_bench_cmd.py
runs each measurement once); which part runs which measurement, on which
VMs, and what the JSON says about it is combinatorics, checked here for every
part alone and in the mixes users run, in a fraction of a second each.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pytest_forkd.cli.bench import run
from pytest_forkd.cli.bench.common import PARTS, BenchPlan
from pytest_forkd.core.factory import VMFactory
from pytest_forkd.errors import InvalidArgument

#: The measurement each part other than ``core`` runs (a name in ``pytest_forkd.cli.bench.run``).
MEASUREMENT = {
    "uffd": "measure_uffd_pause",
    "diff": "measure_diff_series",
    "memory": "measure_memory",
    "speed": "measure_guest_speed",
    "cpu": "measure_child_cpu",
    "images": "measure_images",
    "e2b": "measure_e2b",
}
#: The parts measured on children of one root VM the run boots and freezes for them.
ON_A_BASE = {"diff", "memory", "speed", "cpu"}


class Recorded:
    """What the run measured (in order), the VMs it handed each measurement, and its factories."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.bases: list[Any] = []
        self.factories: list[VMFactory] = []
        self.run_dirs: list[Path] = []


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Recorded:
    """Every measurement replaced by a recorder returning one figure; the run's factory a fake-engine one."""
    seen = Recorded()
    for part, name in MEASUREMENT.items():
        if part not in PARTS:  # a part this checkout does not have yet
            continue

        def measure(*args: Any, _name: str = name, **kwargs: Any) -> dict[str, Any]:
            seen.calls.append(_name)
            seen.bases.extend(arg for arg in args if hasattr(arg, "fork") and hasattr(arg, "tag"))
            return {f"{_name}_figure": 1}

        monkeypatch.setattr(run, name, measure)

    def core(factory: VMFactory, plan: BenchPlan, progress: Any) -> dict[str, Any]:
        seen.calls.append("core")
        return {"cold_boot_ms": 1, "conditions": {"accel": "from the core part"}}

    def fake_factory(accel: str = "auto") -> VMFactory:
        factory = VMFactory(engine="fake")
        # The fake engine has no accelerator to choose; the run asks only to describe it (stubbed above).
        monkeypatch.setattr(factory, "accel_verdict", lambda image: "no choice on the fake engine")
        seen.factories.append(factory)
        seen.run_dirs.append(factory.run_dir.path)
        return factory

    monkeypatch.setattr(run, "_run", core)
    monkeypatch.setattr(run, "VMFactory", fake_factory)
    monkeypatch.setattr(run, "ensure_image", lambda name: name)
    monkeypatch.setattr(run, "_conditions", lambda factory, plan, verdict: {"accel": "asked for the parts"})
    return seen


def bench(*parts: str) -> dict[str, Any]:
    return run.run_bench(BenchPlan(parts=list(parts), memory_mib=[64], diff_branches=10))


@pytest.mark.parametrize("part", [part for part in PARTS if part != "core"])
def test_each_part_alone_runs_its_measurement_and_no_other(recorded: Recorded, part: str) -> None:
    result = bench(part)

    assert recorded.calls == [MEASUREMENT[part]]
    assert result[f"{MEASUREMENT[part]}_figure"] == 1
    assert "cold_boot_ms" not in result  # the core part did not run
    assert result["conditions"] == {"accel": "asked for the parts", "parts": [part]}
    assert len(recorded.bases) == (1 if part in ON_A_BASE else 0)


@pytest.mark.parametrize(
    "parts",
    [("uffd", "diff", "memory", "speed", "cpu"), ("core", "speed"), ("core",)],
)
def test_parts_on_a_base_share_one_root_and_leave_nothing(recorded: Recorded, parts: tuple[str, ...]) -> None:
    result = bench(*parts)

    wanted = [part for part in parts if part != "core"]
    assert sorted(recorded.calls) == sorted(["core"] * ("core" in parts) + [MEASUREMENT[part] for part in wanted])
    if "core" in parts:
        assert recorded.calls[0] == "core" and result["cold_boot_ms"] == 1
        assert result["conditions"] == {"accel": "from the core part", "parts": list(parts)}
    based = [part for part in wanted if part in ON_A_BASE]
    assert len(recorded.bases) == len(based)
    assert len({base.tag for base in recorded.bases}) <= 1, "every part on a base uses the same one"
    for base in recorded.bases:
        assert not base.path.exists(), "the parts' base is removed when the run ends"
    (run_dir,) = recorded.run_dirs
    assert not run_dir.exists(), "the run closes its factory, and every VM with it"


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        (["core", "warp"], "unknown bench part(s) warp"),
        ([], "unknown bench part(s) (none given)"),
    ],
)
def test_unknown_or_no_parts_are_refused_before_a_vm_starts(recorded: Recorded, parts: list[str], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message.replace("(", r"\(").replace(")", r"\)")):
        run.run_bench(BenchPlan(parts=parts))
    assert recorded.calls == [] and recorded.factories == []


def test_too_few_diff_branches_are_refused_with_the_fix(recorded: Recorded) -> None:
    with pytest.raises(InvalidArgument, match="--diff-branches 9 is too few.*at least 10"):
        run.run_bench(BenchPlan(parts=["diff"], diff_branches=9))
    assert recorded.factories == []
