"""The agent as the guest runs it: a package beside wire.py, in its own process."""

from __future__ import annotations

import errno
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_forkd.guest import install_agent, wire
from pytest_forkd.guest.client import AgentClient


@pytest.fixture
def installed_agent(tmp_path: Path) -> Path:
    """The agent package, wire.py and tarstream.py copied alone into a directory, as in /opt/forkd."""
    return install_agent(tmp_path)


@pytest.fixture
def stdio_agent(installed_agent: Path) -> Iterator[tuple[subprocess.Popen, socket.socket]]:
    host_end, guest_end = socket.socketpair()
    # -S: no site-packages, so only the standard library and the script's directory are importable.
    process = subprocess.Popen(
        [sys.executable, "-S", str(installed_agent), "--stdio"],
        stdin=guest_end,
        stdout=guest_end,
        stderr=subprocess.PIPE,
    )
    guest_end.close()
    yield process, host_end
    if process.poll() is None:
        process.kill()
    process.wait(timeout=5)
    process.stderr.close()


def test_script_serves_over_stdio_and_exits_at_end_of_input(stdio_agent) -> None:
    process, host_end = stdio_agent
    with AgentClient(host_end) as client:
        assert client.ping()["pid"] == process.pid
        assert client.exec(["sh", "-c", "echo $0"]).stdout == "sh\n"

    assert process.wait(timeout=5) == 0
    assert b"serving on --stdio" in process.stderr.read()


def test_script_without_arguments_prints_usage(installed_agent: Path) -> None:
    result = subprocess.run([sys.executable, "-S", str(installed_agent)], capture_output=True, timeout=10)

    assert result.returncode == 2
    assert b"usage: agent PORT_DEVICE | --stdio" in result.stderr


def test_script_reports_a_port_it_cannot_open(installed_agent: Path, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-S", str(installed_agent), str(tmp_path / "no-such-port")], capture_output=True, timeout=10
    )

    assert result.returncode == 1
    assert b"cannot open the agent port" in result.stderr
    assert b"no-such-port" in result.stderr


def read_within(fd: int, size: int, timeout: float = 5.0) -> bytes:
    """os.read that fails the test instead of hanging when the agent stays silent."""
    readable, _, _ = select.select([fd], [], [], timeout)
    if not readable:
        raise TimeoutError(f"nothing to read within {timeout} s")
    return os.read(fd, size)


def connect(fifo: Path, within: float = 5.0) -> int:
    """Open the FIFO for writing once the agent has it open, failing instead of blocking forever."""
    deadline = time.monotonic() + within
    while True:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ENXIO or time.monotonic() > deadline:
                raise
            time.sleep(0.01)  # no reader yet
            continue
        os.set_blocking(fd, True)
        return fd


def test_agent_waiting_on_end_of_input_serves_the_next_connection(tmp_path: Path) -> None:
    """A virtio port reads as end of input while the host end is disconnected; the agent must outlast it."""
    fifo = tmp_path / "port"
    os.mkfifo(fifo)
    serve = (
        "import os, sys\n"
        "from pytest_forkd.guest.agent import Agent\n"
        "port = os.open(sys.argv[1], os.O_RDONLY)\n"
        "Agent(port, 1, wait_on_eof=True, set_clock=lambda s: None, reseed=lambda s: None).serve_forever()\n"
    )
    process = subprocess.Popen([sys.executable, "-c", serve, str(fifo)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        replies = wire.FrameReader(lambda size: read_within(process.stdout.fileno(), size))
        first_connection = connect(fifo)
        os.write(first_connection, wire.encode_header({"id": 1, "op": "ping"}))
        reply = replies.read_frame()
        assert reply is not None and reply.fields["id"] == 1, "the agent stopped serving"
        os.write(first_connection, wire.encode_header({"id": 2, "op": "ping"})[:-4])  # cut by the disconnect
        os.close(first_connection)
        # Reconnect only once the agent has seen the disconnect; before that, the
        # next request would be read as the rest of the cut one and dropped.
        assert b"ended inside a frame" in read_within(process.stderr.fileno(), 4096)

        second_connection = connect(fifo, within=0.5)
        os.write(second_connection, wire.encode_header({"id": 3, "op": "ping"}))
        reply = replies.read_frame()
        assert reply is not None and reply.fields["id"] == 3, "the agent stopped serving"
        os.close(second_connection)

        assert process.poll() is None
    finally:
        process.kill()
        process.wait(timeout=5)
        process.stdout.close()
        process.stderr.close()
