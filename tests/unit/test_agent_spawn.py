"""Spawned processes without a VM: the agent over a socketpair, the client's ProcessCall, the host handle."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from agent_pair import AgentPair

from pytest_forkd.analysis.transcript import Transcript
from pytest_forkd.core.process import GuestProcess, output_bounds
from pytest_forkd.errors import (
    CommandNotFound,
    GuestProtocolError,
    InvalidArgument,
    NoSuchProcess,
    ProcessError,
    ProcessTimeout,
)
from pytest_forkd.guest import wire
from pytest_forkd.guest.agent import _LiveBuffer, _unignore_terminal_signals
from pytest_forkd.guest.client import AgentClient, spawn_request
from pytest_forkd.waiting import poll_until


class HostVM:
    """The part of a VM a GuestProcess uses, over an agent that runs on this host."""

    name = "host"
    closed = False
    max_output = 1 << 20

    def __init__(self, client: AgentClient) -> None:
        self.agent = client
        self.transcript = Transcript("host")

    def _call(self, what: str, function: Any, *args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    def spawn(self, command: Any, *, max_output: int | None = None, **options: Any) -> GuestProcess:
        max_output = self.max_output if max_output is None else max_output
        window, guest_limit = output_bounds(max_output)  # as VM.spawn splits it
        process = GuestProcess(
            self,
            command,
            pty=bool(options.get("pty")),
            max_output=max_output,  # type: ignore[arg-type]
            window=window,
        )
        process._start(spawn_request(command, max_output=guest_limit, **options))
        return process


@pytest.fixture
def channel() -> Iterator[tuple[socket.socket, socket.socket]]:
    with AgentPair() as pair:
        yield pair.host_end, pair.guest_end


@pytest.fixture
def vm(channel: tuple[socket.socket, socket.socket]) -> Iterator[HostVM]:
    with AgentClient(channel[0]) as client:
        yield HostVM(client)


def test_lines_exit_code_and_stderr(vm: HostVM) -> None:
    proc = vm.spawn("echo one; echo err >&2; echo two; exit 5")
    assert list(proc.stdout) == [b"one\n", b"two\n"]
    assert proc.stderr.read(timeout=10) == b"err\n"
    assert proc.wait(timeout=10) == 5 and proc.returncode == 5


def test_stdin_round_trip_and_close(vm: HostVM) -> None:
    proc = vm.spawn(["cat"])
    proc.write_stdin(b"abc\n")
    assert proc.stdout.readline(timeout=10) == b"abc\n"
    proc.write_stdin("tail without newline")
    proc.close_stdin()
    assert proc.stdout.readline(timeout=10) == b"tail without newline"
    assert proc.stdout.readline(timeout=10) == b""
    assert proc.wait(timeout=10) == 0
    with pytest.raises(ProcessError):
        proc.write_stdin(b"more")  # its result was taken: the agent forgot it


def test_wait_timeout_then_kill(vm: HostVM) -> None:
    proc = vm.spawn(["sleep", "100"])
    with pytest.raises(ProcessTimeout, match="still running after 0.1 s"):
        proc.wait(timeout=0.1)
    with pytest.raises(ProcessTimeout):
        proc.stdout.readline(timeout=0.05)
    proc.kill()
    assert proc.wait(timeout=10) == -signal.SIGTERM
    assert [entry["kind"] for entry in vm.transcript.entries] == ["signal"]
    with pytest.raises(InvalidArgument):
        proc.kill(0)


def test_a_missing_program_is_named(vm: HostVM) -> None:
    with pytest.raises(CommandNotFound, match="no-such-tool-42: command not found"):
        vm.spawn(["no-such-tool-42"])
    with pytest.raises(CommandNotFound, match="no-such-tool-42"):
        vm.spawn("no-such-tool-42 -x | cat")
    assert vm.spawn("cd / && echo builtins are left to the shell").stdout.read(timeout=10) != b""


def test_terminal_spawn_resize_and_exec(vm: HostVM) -> None:
    proc = vm.spawn("stty size; read x; stty size", pty=(12, 34))
    assert proc.stdout.readline(timeout=10) == b"12 34\r\n"
    proc.resize(56, 78)
    proc.write_stdin("go\n")
    assert proc.stdout.read(timeout=10).endswith(b"56 78\r\n")
    assert proc.wait(timeout=10) == 0
    result = vm.agent.exec("tty", pty=True)
    assert result.stdout.startswith("/dev/pts/") and result.exit_code == 0
    plain = vm.spawn(["true"])
    plain.wait(timeout=10)


def test_unread_output_is_bounded_and_the_middle_dropped(vm: HostVM) -> None:
    proc = vm.spawn(["yes"], max_output=64 << 10)
    window, _ = output_bounds(64 << 10)
    poll_until(lambda: proc.stdout.total >= window, timeout=10, what="the host's window to fill")
    time.sleep(0.2)  # `yes` writes on all the while: room for the host to take more than it may
    assert proc.stdout.total <= 256 << 10  # the host holds no more than its window
    assert proc.stdout.readline(timeout=10) == b"y\n"
    drained = 0
    while proc.stdout.skipped == 0 and drained < 1_000_000:  # reading on reaches the dropped middle
        proc.stdout.readline(timeout=10)
        drained += 1
    assert proc.truncated and proc.stdout.skipped > 0
    proc.kill(signal.SIGKILL)
    assert proc.wait(timeout=10) == -signal.SIGKILL
    # What the guest still held is read to its end, so its output pump ends too (teardown need not wait for it).
    proc.stdout.read(timeout=10)
    assert proc.stdout.ended


def _attach_again_and_talk_through_it(vm: HostVM, proc: GuestProcess) -> None:
    """A second handle attaches to ``proc`` (a `cat`): it gets the answers, and the first handle is told."""
    second = GuestProcess(vm, ["cat"], pty=False, max_output=1 << 20)  # type: ignore[arg-type]
    second._attach(proc.pid)
    second.write_stdin(b"to the new reader\n")
    assert second.stdout.readline(timeout=10) == b"to the new reader\n"
    with pytest.raises(ProcessError, match="another request attached"):
        proc.stdout.readline(timeout=10)
    second.close_stdin()
    assert second.wait(timeout=10) == 0


def test_attach_again_moves_the_stream_and_the_old_handle_is_told(vm: HostVM) -> None:
    proc = vm.spawn(["cat"])
    listed = vm.agent.processes()
    assert [item["pid"] for item in listed] == [proc.pid] and listed[0]["exit_code"] is None
    _attach_again_and_talk_through_it(vm, proc)
    with pytest.raises(NoSuchProcess):
        GuestProcess(vm, ["x"], pty=False, max_output=1)._attach(999999)  # type: ignore[arg-type]


def test_an_attach_sent_as_soon_as_the_pid_is_known_is_not_overtaken_by_the_spawn(
    vm: HostVM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The spawn names its process in a first frame, then attaches its request to the output.

    A host may attach another request the moment it reads that frame; the
    spawn's own attachment must be in place by then, or it lands last and
    takes the stream back from the newer request (seen under load).
    """
    from pytest_forkd.guest.agent import server

    send_frames = server.Agent._send_frames
    start_attachment = server.Agent._start_attachment
    delayed: list[int] = []
    other_attach_arrived = threading.Event()

    def late_after_the_first_pid_frame(agent: Any, frames: Any) -> None:
        first = "pid" in frames[0][0] and not delayed
        if first:  # noted before the frame goes: the host may attach before this thread runs on
            delayed.append(frames[0][0]["id"])
        send_frames(agent, frames)
        if first:  # the spawn's thread is slow to go on after naming the process
            # Until the other attach is in the agent, and a moment more: one not held back would be done.
            assert other_attach_arrived.wait(timeout=10), "the host never attached"
            time.sleep(0.1)

    def arriving(agent: Any, spawned: Any, fields: dict[str, Any]) -> None:
        if delayed and fields["id"] != delayed[0]:
            other_attach_arrived.set()
        start_attachment(agent, spawned, fields)

    monkeypatch.setattr(server.Agent, "_send_frames", late_after_the_first_pid_frame)
    monkeypatch.setattr(server.Agent, "_start_attachment", arriving)
    proc = vm.spawn(["cat"])
    _attach_again_and_talk_through_it(vm, proc)
    assert delayed  # the slow spawn really was slow


def test_what_a_process_answers_after_an_attach_named_it_goes_to_that_attach(
    vm: HostVM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host writes to a process as soon as an attach's first frame names it.

    The answer must stream to that attach, even when the agent's thread that
    sent the frame is slow to go on (seen under load): the switch of the
    stream happens before the frame goes, not after.
    """
    from pytest_forkd.guest.agent import server

    send_frames = server.Agent._send_frames
    named: list[int] = []

    def slow_after_naming_the_process_again(agent: Any, frames: Any) -> None:
        send_frames(agent, frames)
        if "pid" in frames[0][0]:
            named.append(frames[0][0]["id"])
            if len(named) == 2:
                time.sleep(0.5)  # the host reads the frame and writes to the process meanwhile

    monkeypatch.setattr(server.Agent, "_send_frames", slow_after_naming_the_process_again)
    proc = vm.spawn(["cat"])
    _attach_again_and_talk_through_it(vm, proc)
    assert len(named) == 2  # the attach was the slow one


def test_a_new_host_client_drops_the_old_attachment_silently(channel: tuple[socket.socket, socket.socket]) -> None:
    """A VM restored from a snapshot hears from a new client: frames for the old one's requests must stop."""
    sock = channel[0]
    sock.settimeout(10)
    reader = wire.FrameReader(sock.recv)

    def send(fields: dict, payload: bytes = b"") -> None:
        sock.sendall(wire.encode_header(fields, len(payload)) + payload)

    send({"id": 1, "op": "spawn", "argv": ["sh", "-c", "read x; echo after"], "max_output": 1000, "client": "A"})
    started = reader.read_frame()
    assert started is not None and started.fields["id"] == 1
    pid = started.fields["pid"]
    send({"id": 2, "op": "ping", "client": "B"})  # the first request of the restored VM's host
    send({"id": 3, "op": "stdin", "pid": pid, "client": "B"}, b"go\n")
    send({"id": 4, "op": "attach", "pid": pid, "client": "B"})
    frames = []
    # stdin and attach are handled in threads of their own: the reply to stdin may come after attach's last frame.
    while not any(frame.fields.get("id") == 3 for frame in frames) or not any(
        frame.fields.get("id") == 4 and not frame.fields.get("more") for frame in frames
    ):
        frame = reader.read_frame()
        assert frame is not None
        frames.append(frame)
    assert {frame.fields["id"] for frame in frames} == {2, 3, 4}  # nothing more for request 1
    attached = [frame for frame in frames if frame.fields["id"] == 4]
    assert b"".join(frame.payload for frame in attached) == b"after\n"
    assert attached[-1].fields["exit_code"] == 0


def test_live_buffer_keeps_head_and_tail_and_counts_the_gap() -> None:
    buffer = _LiveBuffer(10)
    buffer.add(b"abcdefgh")
    buffer.add(b"ijklmnop")
    assert buffer.size == 10 and buffer.dropped == 6 and buffer.total == 16
    assert buffer.take(3) == (b"abc", 0)
    assert buffer.take(10) == (b"de", 0)
    assert buffer.take(10) == (b"lmnop", 6)
    assert buffer.take(10) == (b"", 0)
    buffer.add(b"qr")
    assert buffer.take(10) == (b"qr", 0)


def test_a_guest_that_ignores_credit_is_cut_off() -> None:
    host_end, guest_end = socket.socketpair()
    reader = wire.FrameReader(guest_end.recv)
    with AgentClient(host_end) as client:
        vm = HostVM(client)
        process = GuestProcess(vm, ["x"], pty=False, max_output=1 << 20)  # type: ignore[arg-type]
        starting = threading.Thread(target=process._start, args=(spawn_request(["x"]),))
        starting.start()
        request = reader.read_frame()
        assert request is not None and request.fields["op"] == "spawn"
        window = request.fields["window"]
        send = lambda fields, payload=b"": guest_end.sendall(wire.encode_header(fields, len(payload)) + payload)  # noqa: E731
        send({"id": request.fields["id"], "more": True, "pid": 77})
        starting.join(timeout=10)
        assert process.pid == 77
        for _ in range(window // (64 << 10) + 2):
            send({"id": request.fields["id"], "more": True, "fd": 1}, b"x" * (64 << 10))
        assert process._call is not None and process._call.done.wait(10)  # nobody read: the excess ends it
        assert len(process.stdout.read(timeout=10)) <= window  # what it was allowed, then the stream ends
        with pytest.raises(GuestProtocolError, match="more output of 'spawn' than"):
            process.wait(timeout=10)
    guest_end.close()


@pytest.fixture
def terminal_signals() -> Iterator[None]:
    """Ctrl-C and Ctrl-\\ not ignored by this process, as the agent's ``main`` makes sure in a guest.

    This agent runs in a thread of the test process, so its commands inherit the
    test run's signals: a run started in the background of a script ignores SIGINT.
    """
    saved = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGQUIT)
    _unignore_terminal_signals()
    yield
    signal.signal(signal.SIGINT, saved[0])
    signal.signal(signal.SIGQUIT, saved[1])


def _ignored_signals_of_a_command(unignore: bool) -> int:
    """SigIgn of a command run by a process started with SIGINT and SIGQUIT ignored."""
    script = (
        "import subprocess\n"
        "from pytest_forkd.guest.agent import _unignore_terminal_signals\n"
        f"if {unignore}: _unignore_terminal_signals()\n"
        "print(subprocess.run(['grep', 'SigIgn', '/proc/self/status'], capture_output=True, text=True).stdout)\n"
    )

    def ignore_terminal_signals() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGQUIT, signal.SIG_IGN)

    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, preexec_fn=ignore_terminal_signals
    ).stdout
    return int(out.split()[1], 16)


def test_commands_of_an_agent_started_with_ctrl_c_ignored_get_the_default_reaction() -> None:
    sigint_and_sigquit = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGQUIT - 1))
    assert _ignored_signals_of_a_command(unignore=False) & sigint_and_sigquit == sigint_and_sigquit
    assert _ignored_signals_of_a_command(unignore=True) & sigint_and_sigquit == 0


@pytest.mark.usefixtures("terminal_signals")
def test_terminal_session_relays_keys_ctrl_c_and_the_exit_status(vm: HostVM) -> None:
    """`forkd shell`'s relay, over a host agent: our side is a pseudo-terminal, as a user's would be."""
    import os
    import re

    from pytest_forkd.cli.shell_cmd import TerminalSession

    master, slave = os.openpty()
    session = TerminalSession(vm, cwd="/", command="PS1='$ ' exec sh -i")  # type: ignore[arg-type]
    status: list[int] = []
    relay = threading.Thread(target=lambda: status.append(session.run(slave, slave)), daemon=True)
    relay.start()
    seen = b""

    def expect(pattern: bytes) -> None:
        nonlocal seen
        deadline = time.monotonic() + 20
        while not re.search(pattern, seen):
            assert time.monotonic() < deadline, seen
            seen += os.read(master, 4096)

    try:
        expect(rb"\$ ")
        # The job says when it runs (the echo of the typed line shows sl""eeping, not sleeping):
        # a Ctrl-C that came before it would interrupt the shell's prompt instead.
        os.write(master, b"stty size; sh -c 'echo sl\"\"eeping; exec sleep 50'\n")
        expect(rb"24 80")
        expect(rb"\nsleeping")
        os.write(master, b"\x03")  # Ctrl-C interrupts the sleep, not the relay
        os.write(master, b"echo status $?\n")
        expect(rb"status 130")
        os.write(master, b"exit 3\n")
        relay.join(timeout=20)
        assert status == [3]
    finally:
        os.close(master)
        os.close(slave)


def test_async_handle_reads_lines_and_a_cancelled_read_loses_nothing(vm: HostVM) -> None:
    import asyncio

    from pytest_forkd.aio import AsyncGuestProcess, AsyncVM

    async def main() -> None:
        avm = AsyncVM(vm)  # type: ignore[arg-type]
        proc = await avm.spawn(["cat"])
        assert isinstance(proc, AsyncGuestProcess) and proc.returncode is None
        reading = asyncio.create_task(proc.stdout.readline())
        await asyncio.sleep(0.1)
        reading.cancel()
        await proc.write_stdin(b"one\ntwo\n")
        await proc.close_stdin()
        assert [line async for line in proc.stdout] == [b"one\n", b"two\n"]
        assert await proc.wait(timeout=10) == 0
        sleeper = await avm.spawn(["sleep", "100"])
        with pytest.raises(ProcessTimeout, match="within 0.1 s"):
            await sleeper.wait(timeout=0.1)
        await sleeper.kill(signal.SIGKILL)
        assert await sleeper.wait(timeout=10) == -signal.SIGKILL

    asyncio.run(main())


def test_output_read_after_the_end_is_bounded_by_max_output_like_exec(vm: HostVM) -> None:
    limit = 100_000
    process = vm.spawn(["head", "-c", "3000000", "/dev/zero"], max_output=limit)
    assert process.wait(timeout=30) == 0
    time.sleep(0.2)  # let the guest side take in all of it (the pipe holds what is left: 64 KiB at most)
    data = process.stdout.read(timeout=30)
    assert len(data) <= limit and process.truncated
    assert len(data) + process.stdout.skipped == 3_000_000


# -- the end of a process: the final frame ------------------------------------------------------------


class _Recorder:
    """A process listener that notes what it is told, in order."""

    def __init__(self) -> None:
        self.told: list[tuple[str, Any]] = []

    def on_output(self, fd: int, data: bytes, skipped: int) -> None:
        self.told.append(("output", (fd, data)))

    def on_eof(self, fd: int) -> None:
        self.told.append(("eof", fd))

    def on_exit(self, exit_code: int) -> None:
        self.told.append(("exit", exit_code))

    def on_end(self, call: object) -> None:
        self.told.append(("end", None))


class _Channel:
    def _forget(self, call: object) -> None:
        pass


def test_a_final_frame_alone_tells_the_exit_once() -> None:
    from pytest_forkd.guest.calls import ProcessCall

    told_alone, told_both = _Recorder(), _Recorder()
    alone = ProcessCall(_Channel(), "spawn", told_alone, window=1024)  # type: ignore[arg-type]
    alone.feed(wire.Frame({"id": 1, "more": True, "pid": 42}))
    alone.feed(wire.Frame({"id": 1, "exited": True, "exit_code": 3, "signal": None, "truncated": False}))
    assert told_alone.told == [("exit", 3), ("end", None)]

    both = ProcessCall(_Channel(), "spawn", told_both, window=1024)  # type: ignore[arg-type]
    both.feed(wire.Frame({"id": 2, "more": True, "pid": 43}))
    both.feed(wire.Frame({"id": 2, "more": True, "exited": True, "exit_code": 4, "signal": None}))
    both.feed(wire.Frame({"id": 2, "exited": True, "exit_code": 4, "signal": None, "truncated": False}))
    assert told_both.told == [("exit", 4), ("end", None)]


def test_the_agent_leaves_out_the_end_frames_its_final_frame_stands_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """In one write, the final frame says that both streams ended and the process exited: nothing before it does."""
    with AgentPair() as pair:
        batches: list[list[dict[str, Any]]] = []
        send = pair.agent._send_frames

        def recording(frames: Any) -> None:
            batches.append([dict(fields) for fields, _payload in frames])
            send(frames)

        monkeypatch.setattr(pair.agent, "_send_frames", recording)
        with AgentClient(pair.host_end) as client:
            vm = HostVM(client)
            quick = vm.spawn(["sh", "-c", "echo out; exit 7"])
            assert quick.wait(timeout=10) == 7
            assert quick.stdout.read(timeout=10) == b"out\n"
            # Its outputs end first; the exit comes in a later write, with the final frame.
            closing = vm.spawn(["sh", "-c", "exec >&- 2>&-; sleep 0.3; exit 5"])
            assert closing.wait(timeout=10) == 5
    for batch in batches:
        finals = [fields for fields in batch if "more" not in fields and "exit_code" in fields]
        if finals:
            request = finals[0]["id"]
            ends = [f for f in batch if f["id"] == request and f.get("more") and (f.get("eof") or f.get("exited"))]
            assert not ends, batch
    finals = [fields for batch in batches for fields in batch if "more" not in fields and "exit_code" in fields]
    assert [fields["exit_code"] for fields in finals] == [7, 5]


# -- relaying the output to a sink (a server on an event loop) -----------------------------------------


class _Sink:
    """A ProcessSink that keeps what it gets and, unless told not to, passes the credit back at once."""

    def __init__(self, *, consume: bool = True) -> None:
        self.consume = consume
        self.chunks: list[tuple[str, bytes]] = []
        self.finished_with: list[int | None] = []
        self.done = threading.Event()

    def output(self, stream: Any, data: bytes) -> None:
        assert not self.done.is_set(), "output after the end"
        self.chunks.append((stream.name, data))
        if self.consume:
            threading.Thread(target=stream.consumed, args=(len(data),)).start()  # never from the reader thread

    def finished(self, process: GuestProcess) -> None:
        self.finished_with.append(process.returncode)
        self.done.set()

    def received(self, name: str) -> bytes:
        return b"".join(data for stream, data in self.chunks if stream == name)


def test_a_relay_gets_the_output_in_order_then_the_end(vm: HostVM) -> None:
    proc = vm.spawn(["sh", "-c", "printf abc; sleep 0.2; printf err >&2; sleep 0.2; printf def; exit 3"])
    sink = _Sink()
    proc.relay(sink)
    assert sink.done.wait(10)
    assert sink.received("stdout") == b"abcdef" and sink.received("stderr") == b"err"
    assert sink.finished_with == [3] and proc.wait(timeout=1) == 3
    assert proc.stdout.total == 6 and proc.stderr.total == 3
    with pytest.raises(ProcessError, match="relayed already"):
        proc.relay(_Sink())


def test_a_relay_started_late_gets_what_arrived_before_and_the_end_at_once(vm: HostVM) -> None:
    proc = vm.spawn(["sh", "-c", "echo one; echo two >&2"])
    assert proc.wait(timeout=10) == 0
    poll_until(lambda: proc._finished, timeout=10, what="the final frame")
    assert proc.stdout.readline(timeout=5) == b"one\n"  # read (and credited) before the relay: not handed again
    sink = _Sink()
    proc.relay(sink)
    assert sink.done.is_set() and sink.finished_with == [0]
    assert sink.received("stdout") == b"" and sink.received("stderr") == b"two\n"


def test_a_relay_that_does_not_pass_the_credit_back_gets_no_more_than_the_window(vm: HostVM) -> None:
    size = 1 << 20
    window, _guest = output_bounds(256 * 1024)
    stalled = vm.spawn(["sh", "-c", f"head -c {size} /dev/zero"], max_output=256 * 1024)
    sink = _Sink(consume=False)
    stalled.relay(sink)
    time.sleep(0.5)
    held = len(sink.received("stdout"))
    assert 0 < held <= window and not sink.done.is_set()
    assert stalled.wait(timeout=10) == 0  # the guest took its output in (bounded): it ended
    assert not sink.done.wait(0.3)  # the end comes after the output the guest still keeps
    sink.consume = True
    stalled.stdout.consumed(held)
    assert sink.done.wait(10) and sink.finished_with == [0]
    assert stalled.truncated and len(sink.received("stdout")) < size  # the middle nobody took in time

    flowing = vm.spawn(["sh", "-c", f"head -c {size} /dev/zero"], max_output=4 * size)  # room for all of it
    sink = _Sink()
    flowing.relay(sink)
    assert sink.done.wait(30) and sink.finished_with == [0]
    assert sink.received("stdout") == bytes(size) and not flowing.truncated
