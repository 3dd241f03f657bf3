"""A guest whose agent was replaced by something hostile: the host stays bounded, says why, recovers.

A command run in the guest kills the real agent and takes over its virtio
port, then speaks (or abuses) the protocol itself: garbage, endless
continuation frames, deep and huge JSON, replies with wrong ids. When it
exits, the guest's init starts the real agent again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from support import wait_for_agent

from pytest_forkd.core.vm import VM
from pytest_forkd.errors import ForkdError, GuestCrashed, GuestProtocolError

HOSTILE_AGENT = r"""
import json, os, signal, sys, time
sys.path.insert(0, "/opt/forkd")
import wire

mode, agent_pid, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
port = None
for name in os.listdir("/sys/class/virtio-ports"):
    with open(f"/sys/class/virtio-ports/{name}/name") as names:
        if names.read().strip() == "agent":
            port = f"/dev/{name}"
time.sleep(0.5)  # let the exec that started us send its reply
os.kill(agent_pid, signal.SIGKILL)
deadline = time.monotonic() + 20
while True:  # init restarts the real agent after 0.1 s: be there first
    try:
        fd = os.open(port, os.O_RDWR)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.001)
until = time.monotonic() + seconds
reader = wire.FrameReader(lambda n: os.read(fd, n))

def write(data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]

def frame(fields, payload=b""):
    write(wire.encode_header(fields, len(payload)) + payload)

def raw_json(body):
    write(wire.HEADER.pack(wire.MAGIC, len(body), 0) + body)

def next_request():
    while True:
        try:
            got = reader.read_frame()
        except wire.MalformedFrame:
            continue
        if got is not None and got.fields.get("op") not in (None, "credit"):
            return got.fields

def pong(request, **extra):
    frame({"id": request["id"], "pid": os.getpid(), "monotonic": time.monotonic(),
           "wall_time": time.time(), "protocol": wire.PROTOCOL_VERSION, **extra})

pong(next_request(), hostile=True)  # tell the host we are in place

if mode == "garbage":
    junk = b"this is not a frame " * 50000
    while time.monotonic() < until:
        write(junk)
elif mode == "continuation":
    request = next_request()
    chunk = b"\xee" * wire.MAX_PAYLOAD_SIZE
    frame({"id": request["id"], "more": True}, chunk)
    while time.monotonic() < until:
        frame({"id": request["id"], "more": True}, chunk)
elif mode == "wrong_ids":
    request = next_request()
    n = 1
    while time.monotonic() < until:
        frame({"id": request["id"] + n, "pid": 1})
        n += 1
elif mode == "mixed_then_behave":
    while time.monotonic() < until:
        request = next_request()
        raw_json(b"[" * 200000 + b"]" * 200000)                  # deep JSON
        raw_json(b'{"id": 1, "text": "\xff\xfe"}')                # not UTF-8
        frame({"id": request["id"] + 77, "junk": "y" * 900000})   # huge JSON, wrong id
        write(b"\x00garbage\x00" * 1000)                          # line noise
        pong(request)
os.close(fd)
"""


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@contextmanager
def peak_rss() -> Iterator[dict[str, int]]:
    """Sample this process's RSS while the block runs; yields {'before', 'peak'}."""
    figures = {"before": rss_bytes(), "peak": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            figures["peak"] = max(figures["peak"], rss_bytes())
            stop.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield figures
    finally:
        stop.set()
        sampler.join()


def take_over(vm: VM, mode: str, seconds: float) -> None:
    """Replace the VM's agent with the hostile one, running ``mode`` for ``seconds``."""
    vm.write_file("/tmp/hostile.py", HOSTILE_AGENT)
    agent_pid = vm.ping()["pid"]
    vm.exec(f"setsid python3 /tmp/hostile.py {mode} {agent_pid} {seconds} >/tmp/hostile.log 2>&1 &")
    wait_for_agent(
        vm, lambda reply: bool(reply.get("hostile")), "the hostile agent to take over", timeout=60, interval=0.01
    )


def test_a_guest_flooding_garbage_is_cut_off_and_its_vm_marked_broken(vm: VM) -> None:
    take_over(vm, "garbage", 120)
    # Cut off, not timed out: the exec's own timeout would raise ExecTimeout instead.
    with peak_rss() as rss, pytest.raises(GuestProtocolError, match="cut off") as caught:
        vm.exec("echo never answered", timeout=60)

    assert "garbage" in str(caught.value)
    assert rss["peak"] - rss["before"] < 256 << 20
    assert vm.broken is not None
    with pytest.raises(GuestProtocolError, match="cut off"):
        vm.ping()


def test_endless_continuation_frames_cost_bounded_memory_and_the_next_call_fails_in_time(vm: VM) -> None:
    take_over(vm, "continuation", 40)
    with peak_rss() as rss:
        with pytest.raises(GuestProtocolError, match="grew past"):
            vm.ping(timeout=30)
        time.sleep(10)  # the flood goes on
        with pytest.raises(ForkdError) as caught:
            vm.ping(timeout=5)

    # In time: a ping waiting past its timeout would raise AgentTimeout, not these.
    assert isinstance(caught.value, (GuestCrashed, GuestProtocolError))
    assert rss["peak"] - rss["before"] < 256 << 20


def test_replies_with_wrong_ids_cut_the_guest_off(vm: VM) -> None:
    take_over(vm, "wrong_ids", 120)

    with pytest.raises(GuestProtocolError, match="unknown_id"):
        vm.ping(timeout=60)
    assert vm.broken is not None


def test_a_guest_that_sends_hostile_frames_and_then_behaves_is_served_again(vm: VM) -> None:
    take_over(vm, "mixed_then_behave", 8)
    hostile_pid = None
    for _ in range(3):
        hostile_pid = vm.ping(timeout=30)["pid"]  # answered, between deep, huge and broken frames
    counted = vm.protocol_errors
    assert counted.get("json", 0) >= 3 and counted.get("unknown_id", 0) >= 3

    # The hostile agent leaves; init starts the real one, which serves the same channel. One ping a
    # second: each one the hostile agent answers comes with bad frames, which count towards the cut-off.
    wait_for_agent(vm, lambda reply: reply["pid"] != hostile_pid, "the real agent to come back", interval=1)
    assert vm.exec("echo served again").stdout == "served again\n"
    assert vm.broken is None
