"""Live guest processes against real QEMU: ``VM.spawn`` and its :class:`GuestProcess` handle."""

from __future__ import annotations

import os
import resource
import signal
import time
import urllib.request
from collections.abc import Iterator

import pytest

from pytest_forkd.core.vm import VM
from pytest_forkd.errors import CommandNotFound, ExecTimeout, ForkdError, NoSuchProcess, ProcessTimeout
from pytest_forkd.storage.snapshot import Snapshot

SERVER_PORT = 8000
# A tiny HTTP server of the guest's files that says when it listens and logs each request to stdout.
SERVER = (
    "import http.server, sys\n"
    "class H(http.server.SimpleHTTPRequestHandler):\n"
    "    def log_message(self, *a):\n"
    "        print('served', self.path, flush=True)\n"
    "server = http.server.ThreadingHTTPServer(('0.0.0.0', int(sys.argv[1])), H)\n"
    "print('listening', flush=True)\n"
    "server.serve_forever()\n"
)


@pytest.fixture
def net_vm(outbound_snapshot: Snapshot) -> Iterator[VM]:
    child = outbound_snapshot.fork(1)[0]
    yield child
    child.close()


def fetch(port: int, path: str = "/index.html") -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as response:
        return response.read().decode()


def test_output_streams_as_lines_and_wait_returns_the_exit_code(vm: VM) -> None:
    proc = vm.spawn("echo one; echo oops >&2; echo two; exit 7")
    assert proc.pid > 1
    assert list(proc.stdout) == [b"one\n", b"two\n"]
    assert list(proc.stderr) == [b"oops\n"]
    assert proc.wait(timeout=60) == 7
    assert proc.returncode == 7
    assert vm.transcript.entries[-1]["kind"] == "spawn" and vm.transcript.entries[-1]["pid"] == proc.pid


def test_stdin_round_trip_through_cat(vm: VM) -> None:
    proc = vm.spawn(["cat"])
    assert proc.returncode is None
    proc.write_stdin(b"first line\n")
    assert proc.stdout.readline(timeout=60) == b"first line\n"
    proc.write_stdin("second, as str\n")
    assert proc.stdout.readline(timeout=60) == b"second, as str\n"
    proc.close_stdin()
    assert proc.stdout.read(timeout=60) == b""
    assert proc.wait(timeout=60) == 0


def test_a_process_keeps_running_across_other_calls(vm: VM) -> None:
    proc = vm.spawn('i=0; while read line; do i=$((i+1)); echo "$i:$line"; done')
    for n in range(1, 4):
        assert vm.exec(["echo", "between"]).stdout == "between\n"
        vm.write_file("/tmp/x", str(n))
        proc.write_stdin(f"{vm.read_file('/tmp/x').decode()}\n")
        assert proc.stdout.readline(timeout=60) == f"{n}:{n}\n".encode()
    assert proc.returncode is None
    proc.close_stdin()
    assert proc.wait(timeout=60) == 0


def test_kill_sets_a_negative_returncode_and_the_vm_stays_usable(vm: VM) -> None:
    proc = vm.spawn(["sleep", "1000"])
    with pytest.raises(ProcessTimeout, match=r"still running after 0.5 s; it keeps running"):
        proc.wait(timeout=0.5)
    assert isinstance(ProcessTimeout("x"), ExecTimeout)
    assert proc.returncode is None
    proc.kill()
    assert proc.wait(timeout=60) == -signal.SIGTERM
    assert proc.returncode == -signal.SIGTERM
    proc.kill()  # already ended: nothing to do

    other = vm.spawn("trap 'echo got USR1; exit 3' USR1; echo ready; while :; do sleep 0.1; done")
    assert other.stdout.readline(timeout=60) == b"ready\n"
    other.kill(signal.SIGUSR1)
    assert other.stdout.readline(timeout=60) == b"got USR1\n"
    assert other.wait(timeout=60) == 3
    assert vm.exec("echo still usable").stdout == "still usable\n"


def test_a_killed_process_takes_what_it_started_with_it(vm: VM) -> None:
    proc = vm.spawn("sleep 1001 & sleep 1002 & echo started; wait")
    assert proc.stdout.readline(timeout=60) == b"started\n"
    proc.kill(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while "sleep 100" in vm.exec("ps -o args").stdout and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "sleep 100" not in vm.exec("ps -o args").stdout


def test_the_process_runs_in_a_command_cgroup(vm: VM) -> None:
    proc = vm.spawn(["sleep", "1000"])
    with proc:
        cgroup = vm.exec(["cat", f"/proc/{proc.pid}/cgroup"]).stdout
        assert "/forkd/cmd-" in cgroup
    assert proc.returncode == -signal.SIGKILL  # the context manager killed it


def test_spawning_a_missing_command_names_it_and_the_vm_stays_usable(vm: VM) -> None:
    with pytest.raises(CommandNotFound, match=r"no-such-program-xyz: command not found"):
        vm.spawn(["no-such-program-xyz", "--flag"])
    with pytest.raises(CommandNotFound, match=r"no-such-program-xyz"):
        vm.spawn("no-such-program-xyz --flag")
    with pytest.raises(ForkdError, match=r"/opt/nothing/here"):
        vm.spawn(["/opt/nothing/here"])
    with pytest.raises(ForkdError, match=r"/no/such/dir"):
        vm.spawn(["true"], cwd="/no/such/dir")
    assert vm.spawn(["echo", "fine"]).stdout.read(timeout=60) == b"fine\n"
    assert vm.exec("echo usable").stdout == "usable\n"
    with pytest.raises(NoSuchProcess, match="no spawned process 999999"):
        vm.process(999999)


def test_per_vm_env_and_cwd_reach_spawn_and_forks_inherit_them(vm: VM) -> None:
    vm.exec(["mkdir", "-p", "/srv/app"], check=True)
    vm.env = {"APP_MODE": "spawned", "EXTRA": "vm"}
    vm.cwd = "/srv/app"
    show = 'printf "%s|%s|%s\\n" "$APP_MODE" "$EXTRA" "$(pwd)"'
    assert vm.spawn(show).stdout.read(timeout=60) == b"spawned|vm|/srv/app\n"
    assert vm.spawn(show, env={"EXTRA": "call"}, cwd="/tmp").stdout.read(timeout=60) == b"spawned|call|/tmp\n"
    child = vm.fork(1)[0]
    try:
        assert child.spawn(show).stdout.read(timeout=60) == b"spawned|vm|/srv/app\n"
    finally:
        child.close()


def test_a_process_keeps_running_in_every_forked_child(vm: VM) -> None:
    counter = vm.spawn('n=0; while read line; do n=$((n+1)); echo "$n $line"; done')
    counter.write_stdin("parent\n")
    assert counter.stdout.readline(timeout=60) == b"1 parent\n"
    children = vm.fork(2)
    try:
        for index, child in enumerate(children):
            assert [p.pid for p in child.processes()] == [counter.pid]
            follower = child.process(counter.pid)
            assert follower is child.process(counter.pid)  # one handle per VM
            assert follower.returncode is None
            follower.write_stdin(f"child{index}\n")
            assert follower.stdout.readline(timeout=60) == f"2 child{index}\n".encode()  # the state went along
        counter.write_stdin("parent again\n")
        assert counter.stdout.readline(timeout=60) == b"2 parent again\n"  # the parent's own copy
        children[0].process(counter.pid).kill(signal.SIGKILL)
        assert children[0].process(counter.pid).wait(timeout=60) == -signal.SIGKILL
        assert children[1].process(counter.pid).returncode is None  # siblings are independent
        assert counter.returncode is None
        survivor = children[1].process(counter.pid)
    finally:
        for child in children:
            child.close()
    with pytest.raises(ForkdError, match="closed"):
        survivor.wait(timeout=30)  # its VM is gone: said so, not a hang
    counter.close_stdin()
    assert counter.wait(timeout=60) == 0


def test_a_server_started_with_spawn_answers_through_forward_and_in_a_forked_child(net_vm: VM) -> None:
    net_vm.exec("mkdir -p /srv/www && echo served-by-guest > /srv/www/index.html", check=True)
    net_vm.write_file("/srv/server.py", SERVER)
    server = net_vm.spawn(["python3", "/srv/server.py", str(SERVER_PORT)], cwd="/srv/www")
    assert server.stdout.readline(timeout=300) == b"listening\n"  # Python starts slowly under emulation
    host_port = net_vm.forward(SERVER_PORT, timeout=120)
    assert fetch(host_port) == "served-by-guest\n"
    assert server.stdout.readline(timeout=60) == b"served /index.html\n"

    child = net_vm.fork(1)[0]
    try:
        child_port = child.forwards[SERVER_PORT]
        assert child_port != host_port
        child.exec("echo changed-in-child > /srv/www/index.html", check=True)
        assert fetch(child_port) == "changed-in-child\n"
        child_server = child.process(server.pid)
        assert child_server.stdout.readline(timeout=60) == b"served /index.html\n"
        assert fetch(host_port) == "served-by-guest\n"  # the parent's server keeps serving its own files
        assert server.stdout.readline(timeout=60) == b"served /index.html\n"
        child_server.kill()
        assert child_server.wait(timeout=60) == -signal.SIGTERM
        assert fetch(host_port) == "served-by-guest\n"
    finally:
        child.close()
    server.kill()
    assert server.wait(timeout=60) == -signal.SIGTERM


def _rss_kib() -> int:
    with open(f"/proc/{os.getpid()}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def test_unread_output_stays_bounded_on_host_and_guest(vm: VM) -> None:
    limit = 1 << 20
    proc = vm.spawn(["yes", "a fairly long line of output that nobody reads for a while"], max_output=limit)
    before = _rss_kib()
    time.sleep(3)  # `yes` writes tens of MiB meanwhile; nobody reads
    vm.exec("true")
    grown_kib = _rss_kib() - before
    assert grown_kib < 16 * 1024, f"host RSS grew by {grown_kib} KiB while nobody read"
    agent_pid = vm.ping()["pid"]
    agent_rss = int(vm.exec(f"grep VmRSS /proc/{agent_pid}/status").stdout.split()[1])
    assert 0 < agent_rss < 64 * 1024, f"the guest agent holds {agent_rss} KiB"
    assert proc.stdout.readline(timeout=60).startswith(b"a fairly long line")
    for _ in range(20000):  # read past what was kept: the middle was dropped and counted
        proc.stdout.readline(timeout=60)
        if proc.stdout.skipped > 0:  # the agent may flag truncation before the reader reaches the gap
            break
    assert proc.truncated and proc.stdout.skipped > 0
    proc.kill(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert vm.exec("echo usable").stdout == "usable\n"


def test_the_process_handle_of_a_restored_vm_says_so(vm: VM) -> None:
    with vm.checkpoint() as checkpoint:
        proc = vm.spawn(["sleep", "1000"])
        pid = proc.pid
    del checkpoint
    with pytest.raises(ForkdError, match="was restored to snapshot"):
        proc.wait(timeout=30)
    with pytest.raises(NoSuchProcess):
        vm.process(pid)  # the checkpoint was taken before the process existed
