"""What a command may do to its guest: print without end, fork without end, eat all memory.

The agent outlives each of them and the VM keeps working.
"""

from __future__ import annotations

import ast
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pytest_forkd.core.vm import VM
from pytest_forkd.errors import ExecTimeout, GuestCrashed
from pytest_forkd.guest.client import DEFAULT_MAX_OUTPUT


def test_100_mb_of_output_from_a_256_mib_guest_comes_back_truncated_and_flagged(vm: VM) -> None:
    assert vm.memory_mib == 256
    script = "i=0; while [ $i -lt 100 ]; do echo start-$i; head -c 1000000 /dev/zero; i=$((i+1)); done; echo the-end"

    result = vm.exec(script, timeout=110)

    assert result.ok and result.truncated
    assert len(result.stdout_bytes) == DEFAULT_MAX_OUTPUT
    assert result.stdout_bytes.startswith(b"start-0\n\x00")
    assert result.stdout_bytes.endswith(b"\x00the-end\n")
    assert vm.exec("echo still here").stdout == "still here\n"


def test_output_up_to_max_output_per_call_comes_back_whole(vm: VM) -> None:
    size = 6 << 20

    result = vm.exec(["head", "-c", str(size), "/dev/urandom"], max_output=size)
    digest = vm.exec(f"head -c {size} /dev/urandom > /tmp/r; md5sum < /tmp/r").ok

    assert len(result.stdout_bytes) == size and not result.truncated and digest


def test_the_vm_default_max_output_applies_unless_a_call_says_otherwise(vm: VM) -> None:
    vm.max_output = 1000

    short = vm.exec("head -c 5000 /dev/zero")
    whole = vm.exec("head -c 5000 /dev/zero", max_output=5000)

    assert (len(short.stdout_bytes), short.truncated) == (1000, True)
    assert (len(whole.stdout_bytes), whole.truncated) == (5000, False)


def test_a_fork_bomb_is_killed_at_its_timeout_and_the_vm_keeps_working(vm: VM) -> None:
    try:
        result = vm.exec("bomb() { bomb | bomb & }; bomb; sleep 1000", timeout=10)
    except ExecTimeout as timed_out:
        result = timed_out.result

    # Stopped at its process limit, the bomb dies at the timeout; its processes may
    # also fill the commands' memory first, and then the OOM killer takes all of it.
    assert (result.timed_out, result.exit_status) == (True, 124) or (result.oom_killed, result.exit_status) == (
        True,
        137,
    ), result
    assert vm.exec("echo alive").stdout == "alive\n"
    # The whole cgroup went: no process of the bomb is left.
    assert vm.exec("ps | grep -c '[b]omb' || true").stdout.strip() == "0"


def test_a_command_that_eats_all_memory_is_oom_killed_not_the_agent(vm: VM) -> None:
    pid_before = vm.ping()["pid"]
    hog = "chunks = []\nwhile True:\n    chunks.append(b'x' * (1 << 20))"

    result = vm.exec(["python3", "-c", hog], timeout=100)

    assert result.oom_killed and result.signal == 9 and result.exit_status == 137
    assert not result.ok
    assert vm.ping()["pid"] == pid_before  # the same agent answers
    assert vm.exec("echo fine").stdout == "fine\n"


def test_commands_run_in_their_own_cgroup_as_preferred_oom_victims(vm: VM) -> None:
    result = vm.exec(
        "cat /proc/self/cgroup /proc/self/oom_score_adj /sys/fs/cgroup/forkd/memory.max; cat /proc/$PPID/oom_score_adj"
    )
    agent = vm.exec(f"cat /proc/{vm.ping()['pid']}/oom_score_adj")

    cgroup, score, memory_max, _parent = result.stdout.split()
    assert cgroup.startswith("0::/forkd/cmd-")
    assert int(score) > 0
    assert 0 < int(memory_max) < 256 << 20
    assert agent.stdout.strip() == "-1000"


@pytest.mark.parametrize("user", [None, "65534:65534"])
def test_a_program_started_without_a_shell_runs_as_its_user_in_its_cgroup(vm: VM, user: str | None) -> None:
    # The agent starts it itself (no shell or user switch in front) and moves it into its cgroup.
    script = (
        "import subprocess\n"
        "status = dict(line.split(':', 1) for line in open('/proc/self/status').read().splitlines())\n"
        "print(*[status[name].split() for name in ('Uid', 'Gid', 'Groups', 'CapEff')], sep='|', flush=True)\n"
        "print(open('/proc/self/cgroup').read().strip(), open('/proc/self/oom_score_adj').read().strip(), flush=True)\n"
        "subprocess.run(['cat', '/proc/self/cgroup', '/proc/self/oom_score_adj'])\n"
    )
    result = vm.exec(["python3", "-c", script], user=user, check=True)

    ids, own, child_cgroup, child_score = result.stdout.splitlines()
    uids, gids, groups, capabilities = (ast.literal_eval(field) for field in ids.split("|"))
    own_cgroup, own_score = own.split()
    assert own_cgroup.startswith("0::/forkd/cmd-") and child_cgroup == own_cgroup
    assert own_score == child_score == "500"
    if user is None:
        assert uids == gids == ["0"] * 4
    else:
        # The user, completely: no supplementary groups and no capability left.
        assert uids == gids == ["65534"] * 4 and groups == [] and int(capabilities[0], 16) == 0


def test_an_exec_without_timeout_ends_when_the_vm_dies(vm: VM) -> None:
    with ThreadPoolExecutor(max_workers=1) as pool:
        waiting = pool.submit(vm.exec, "sleep 100000")  # no timeout
        time.sleep(1)
        os.kill(vm.machine.pid, signal.SIGKILL)
        with pytest.raises(GuestCrashed):
            waiting.result(timeout=60)  # bounded: a call that outlived its VM would raise TimeoutError

    assert vm.closed
