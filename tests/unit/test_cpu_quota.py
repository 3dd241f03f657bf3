"""CPU quotas of the cgroup forkd runs in: the cores a run counts on, and what forkd doctor says of them.

Most tests build the cgroup filesystems under tmp_path (a fake /proc pointing
at fake v1 and v2 hierarchies); one puts a real process into a real cgroup
with a quota where this host lets it (root, a cgroup v1 cpu controller).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cgroupfs import fake_proc

from pytest_forkd.core.cores import usable_cores
from pytest_forkd.engine import cgroup


def write(directory: Path, files: dict[str, str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text)


def test_v2_cpu_max_of_the_tightest_ancestor_and_its_usage(tmp_path: Path) -> None:
    root = tmp_path / "unified"
    write(root / "ci", {"cpu.max": "150000 100000\n", "cpu.stat": "usage_usec 2500000\nuser_usec 1\n"})
    write(root / "ci/job", {"cpu.max": "max 100000\n", "cpu.stat": "usage_usec 7\n"})
    quota = cgroup.cpu_quota(fake_proc(tmp_path, ["0::/ci/job"], [f"cgroup2 {root} cgroup2 rw 0 0"]))
    assert quota is not None and quota.version == 2 and quota.cgroup == root / "ci"
    assert quota.cores == pytest.approx(1.5)
    assert quota.usage_s() == pytest.approx(2.5)
    assert usable_cores(quota) == min(2, len(os.sched_getaffinity(0)))  # 1.5 cores' worth of time: 2 at once


def test_v1_cfs_quota_with_cpuacct_mounted_apart(tmp_path: Path) -> None:
    cpu, cpuacct = tmp_path / "cpu", tmp_path / "cpuacct"
    write(cpu, {"cpu.cfs_quota_us": "-1\n", "cpu.cfs_period_us": "100000\n"})
    write(cpu / "job", {"cpu.cfs_quota_us": "50000\n", "cpu.cfs_period_us": "100000\n"})
    write(cpuacct / "job", {"cpuacct.usage": "3000000000\n"})
    proc = fake_proc(
        tmp_path,
        ["3:cpuacct:/job", "2:cpu:/job", "1:memory:/", "0::/"],
        [f"cgroup {cpu} cgroup rw,relatime,cpu 0 0", f"cgroup {cpuacct} cgroup rw,relatime,cpuacct 0 0"],
    )
    quota = cgroup.cpu_quota(proc)
    assert quota is not None and quota.version == 1 and quota.cgroup == cpu / "job"
    assert quota.cores == pytest.approx(0.5) and quota.usage_s() == pytest.approx(3.0)
    assert usable_cores(quota) == 1


def test_v1_cpu_and_cpuacct_mounted_together(tmp_path: Path) -> None:
    both = tmp_path / "cpu,cpuacct"
    write(both / "job", {"cpu.cfs_quota_us": "200000\n", "cpu.cfs_period_us": "100000\n", "cpuacct.usage": "5\n"})
    proc = fake_proc(tmp_path, ["2:cpu,cpuacct:/job", "0::/"], [f"cgroup {both} cgroup rw,cpu,cpuacct 0 0"])
    quota = cgroup.cpu_quota(proc)
    assert quota is not None and quota.cores == pytest.approx(2.0) and quota.usage == both / "job/cpuacct.usage"


def test_no_quota_anywhere_is_none(tmp_path: Path) -> None:
    root = tmp_path / "unified"
    write(root, {"cpu.max": "max 100000\n"})
    assert cgroup.cpu_quota(fake_proc(tmp_path, ["0::/"], [f"cgroup2 {root} cgroup2 rw 0 0"])) is None
    assert cgroup.cpu_quota(tmp_path / "no-proc") is None


def test_a_real_cgroup_quota_is_seen_by_a_process_inside_it() -> None:
    controller = Path("/sys/fs/cgroup/cpu")
    if os.geteuid() != 0 or not (controller / "cpu.cfs_quota_us").exists():
        pytest.skip("needs root and a cgroup v1 cpu controller at /sys/fs/cgroup/cpu")
    group = controller / f"forkd-quota-test-{os.getpid()}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("50000")
        code = (
            "import os, sys\n"
            f"open({str(group / 'tasks')!r}, 'w').write(str(os.getpid()))\n"
            "from pytest_forkd.core.cores import usable_cores\n"
            "from pytest_forkd.engine.cgroup import cpu_quota\n"
            "from pytest_forkd.cli.doctor_cmd import _check_cores\n"
            "quota = cpu_quota()\n"
            "print(usable_cores(), quota.cores, quota.cgroup)\n"
            "print(_check_cores().detail)\n"
        )
        output = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
        figures, doctor = output.splitlines()
        cores, quota_cores, directory = figures.split()
        assert (int(cores), float(quota_cores), directory) == (1, 0.5, str(group))
        assert doctor.startswith("1 usable (") and f"cgroup v1 {group}: CPU quota 0.5 cores" in doctor
    finally:
        group.rmdir()
