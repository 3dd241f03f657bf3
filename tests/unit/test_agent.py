"""The guest agent, run in a thread over a socketpair and driven by the real client."""

from __future__ import annotations

import errno
import os
import re
import signal
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_pair import AgentPair
from support import wait_until_dead

from pytest_forkd.aio.cancel import RequestTicket, Withdrawn, cancel_request
from pytest_forkd.errors import AgentError, ExecTimeout
from pytest_forkd.guest import wire
from pytest_forkd.guest.client import AgentClient, GuestOSError, exec_request
from pytest_forkd.waiting import poll_until


class AgentUnderTest:
    """An agent serving one end of a socketpair; records what it logs and how it syncs the clock."""

    def __init__(self, clock_error: OSError | None = None) -> None:
        self.log: list[str] = []
        self.clock: list[float] = []
        self.seeds: list[bytes] = []
        self._clock_error = clock_error
        self._pair = AgentPair(set_clock=self._set_clock, reseed=self.seeds.append, log=self.log.append)
        self.host_end = self._pair.host_end
        self.agent = self._pair.agent

    def _set_clock(self, seconds: float) -> None:
        self.clock.append(seconds)
        if self._clock_error is not None:
            raise self._clock_error

    def stop(self) -> None:
        """Close the host end and check that the agent returns on end of input."""
        self._pair.close()
        assert not self._pair.thread.is_alive(), "the agent did not stop at end of input"


class RawChannel:
    """Speaks the wire protocol by hand, to send what the client never would."""

    def __init__(self, sock: socket.socket) -> None:
        sock.settimeout(5)
        self.sock = sock
        self._reader = wire.FrameReader(sock.recv)

    def send(self, fields: dict, payload: bytes = b"") -> None:
        self.sock.sendall(wire.encode_header(fields, len(payload)) + payload)

    def receive(self) -> wire.Frame:
        frame = self._reader.read_frame()
        assert frame is not None, "the agent closed the channel"
        return frame


@pytest.fixture
def agent() -> Iterator[AgentUnderTest]:
    under_test = AgentUnderTest()
    yield under_test
    under_test.stop()


@pytest.fixture
def client(agent: AgentUnderTest) -> Iterator[AgentClient]:
    with AgentClient(agent.host_end) as client:
        yield client


@pytest.fixture
def raw(agent: AgentUnderTest) -> RawChannel:
    return RawChannel(agent.host_end)


# -- ping and epochs -----------------------------------------------------------------


def test_ping_reports_pid_and_clocks(client: AgentClient) -> None:
    reply = client.ping()

    assert reply["pid"] == os.getpid()
    assert reply["protocol"] == wire.PROTOCOL_VERSION
    assert abs(reply["wall_time"] - time.time()) < 5
    assert 0 < reply["monotonic"] <= time.monotonic()


def test_a_ping_is_answered_by_the_reader_without_a_thread_of_its_own(
    raw: RawChannel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread per ping (its stack, its first pages) cost more than the ping, most of all in a restore's first one."""
    started: list[str] = []
    real_start = threading.Thread.start

    def record(thread: threading.Thread) -> None:
        started.append(thread.name)
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", record)
    for request_id in (1, 2, 3):
        raw.send({"id": request_id, "op": "ping"})
        assert raw.receive().fields["id"] == request_id
    raw.send({"id": 4, "op": "read_file", "path": "/nonexistent/forkd"})  # any other request gets a thread
    assert raw.receive().fields["error"]["type"] == "FileNotFoundError"
    assert started == ["request-4"]


def test_new_epoch_sets_clock_and_reseeds_once_per_epoch(agent: AgentUnderTest, client: AgentClient) -> None:
    client.ping()
    client.ping()
    assert len(agent.clock) == 1 and len(agent.seeds) == 1
    assert abs(agent.clock[0] - time.time()) < 5
    assert len(agent.seeds[0]) == 32

    client.new_epoch()
    client.ping()

    assert len(agent.clock) == 2
    assert len(agent.seeds) == 2 and agent.seeds[1] != agent.seeds[0]


def test_failure_to_set_the_clock_does_not_fail_the_request() -> None:
    agent = AgentUnderTest(clock_error=PermissionError(errno.EPERM, "Operation not permitted"))
    try:
        with AgentClient(agent.host_end) as client:
            assert client.exec("echo still here").stdout == "still here\n"
            assert any("cannot set the wall clock" in line for line in agent.log)
            assert len(agent.seeds) == 1
    finally:
        agent.stop()


# -- exec -----------------------------------------------------------------------------


def test_exec_argv(client: AgentClient) -> None:
    result = client.exec(["printf", "%s|", "a b", "c"])

    assert result.ok
    assert result.stdout == "a b|c|"
    assert result.command == ("printf", "%s|", "a b", "c")
    assert result.duration_ms > 0


def test_exec_shell_keeps_streams_apart_and_reports_exit_code(client: AgentClient) -> None:
    result = client.exec("echo out; echo err >&2; exit 3")

    assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")
    assert not result.ok


def test_exec_env_cwd_and_stdin(client: AgentClient, tmp_path: Path) -> None:
    result = client.exec(
        'printf "%s;" "$FORKD_TEST" "$PATH" "$(pwd)"; cat',
        env={"FORKD_TEST": "value"},
        cwd=str(tmp_path),
        stdin="from stdin",
    )

    assert result.stdout == f"value;{os.environ['PATH']};{tmp_path};from stdin"


def test_exec_stdin_larger_than_a_frame_and_a_pipe(client: AgentClient) -> None:
    data = os.urandom(wire.CHUNK_SIZE * 3 + 12345)

    result = client.exec(["cat"], stdin=data)

    assert result.stdout_bytes == data


def test_exec_without_stdin_reads_end_of_file(client: AgentClient) -> None:
    assert client.exec(["cat"], timeout=5).stdout_bytes == b""


def test_exec_reports_death_by_signal_as_negative_code(client: AgentClient) -> None:
    assert client.exec("kill -TERM $$").exit_code == -signal.SIGTERM


def test_missing_program_exits_127_like_a_shell(client: AgentClient) -> None:
    result = client.exec(["forkd-no-such-program", "arg"])

    assert result.exit_code == 127
    assert "forkd-no-such-program" in result.stderr
    assert result.stderr == "forkd-exec: exec: forkd-no-such-program: not found\n"


def test_program_that_cannot_run_exits_126(client: AgentClient, tmp_path: Path) -> None:
    script = tmp_path / "not-executable"
    script.write_text("#!/bin/sh\necho hi\n")

    result = client.exec([str(script)])

    assert result.exit_code == 126
    assert "Permission denied" in result.stderr


def test_exec_in_missing_directory_is_an_error_with_errno(client: AgentClient, tmp_path: Path) -> None:
    missing = str(tmp_path / "missing")

    with pytest.raises(GuestOSError) as caught:
        client.exec(["true"], cwd=missing)

    assert caught.value.errno == errno.ENOENT
    assert caught.value.path == missing


def test_timeout_kills_the_whole_process_group_and_keeps_partial_output(client: AgentClient) -> None:
    with pytest.raises(ExecTimeout) as caught:
        client.exec("sleep 30 & echo $!; echo partial; sleep 30", timeout=0.3)

    result = caught.value.result
    background_pid = int(result.stdout.splitlines()[0])
    assert result.timed_out and not result.ok
    assert result.exit_code == -signal.SIGKILL
    assert result.stdout.splitlines()[1] == "partial"
    assert wait_until_dead(background_pid), "the background grandchild survived the timeout"
    assert "within 0.3 s" in str(caught.value)


def test_huge_output_on_both_streams_does_not_deadlock(client: AgentClient) -> None:
    size = 4_000_000  # far past every buffer on the way (pipes, socket, the credit window)
    # stderr first: an agent reading only stdout would block the command forever.
    both_streams = f"head -c {size} /dev/zero | tr '\\0' e >&2; head -c {size} /dev/zero | tr '\\0' o"
    result = client.exec(both_streams, timeout=30, max_output=size)

    assert result.ok
    assert len(result.stdout_bytes) == size and len(result.stderr_bytes) == size
    assert set(result.stdout_bytes) == {ord("o")} and set(result.stderr_bytes) == {ord("e")}


def test_background_process_does_not_hold_the_exec(client: AgentClient) -> None:
    # Had the exec waited for the background sleep, it would have timed out (ExecTimeout) instead.
    result = client.exec("sleep 30 & echo $!; echo done", timeout=10)
    background_pid = int(result.stdout.splitlines()[0])
    try:
        assert result.ok and not result.timed_out and result.stdout.splitlines()[1] == "done"
        assert not wait_until_dead(background_pid, seconds=0.2), "background processes must keep running"
    finally:
        os.kill(background_pid, signal.SIGKILL)


def test_concurrent_execs_from_several_threads(client: AgentClient, tmp_path: Path) -> None:
    """Each command waits until all eight have started: run one after the other, none would finish."""
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def run(number: int) -> None:
        barrier = (
            f"touch {tmp_path}/started-{number}; until [ $(ls {tmp_path} | wc -l) -ge 8 ]; do sleep 0.01; "
            f"done; echo {number}"
        )
        try:
            results[number] = client.exec(barrier, timeout=30).stdout
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert errors == [], "execs ran one after the other"
    assert results == {n: f"{n}\n" for n in range(8)}


def test_ping_is_answered_while_a_command_runs(client: AgentClient, tmp_path: Path) -> None:
    """The command runs until the ping has been answered: a ping queued behind it would time out."""
    started, answered = tmp_path / "started", tmp_path / "answered"
    outcome: list[object] = []
    long_command = threading.Thread(
        target=lambda: outcome.append(
            client.exec(f"touch {started}; until [ -e {answered} ]; do sleep 0.01; done; echo over", timeout=30)
        )
    )
    long_command.start()
    poll_until(started.exists, timeout=30, what="the command to start")

    reply = client.ping(timeout=10)
    answered.touch()
    long_command.join()

    assert reply["pid"] > 0
    assert [result.stdout for result in outcome] == ["over\n"]  # type: ignore[attr-defined]


# -- files --------------------------------------------------------------------------


def test_file_round_trip_is_binary_safe_across_chunks(client: AgentClient, tmp_path: Path) -> None:
    data = bytes(range(256)) * (2 * wire.CHUNK_SIZE // 256) + b"\x00\xff tail"
    path = tmp_path / "blob"

    client.write_file(str(path), data)

    assert path.read_bytes() == data
    assert client.read_file(str(path)) == data


def test_empty_file_round_trip(client: AgentClient, tmp_path: Path) -> None:
    path = str(tmp_path / "empty")

    client.write_file(path, b"")

    assert client.read_file(path) == b""


def test_write_file_applies_mode_and_keeps_an_existing_mode(client: AgentClient, tmp_path: Path) -> None:
    path = tmp_path / "script"
    client.write_file(str(path), "#!/bin/sh\n", mode=0o750)
    assert stat.S_IMODE(path.stat().st_mode) == 0o750

    client.write_file(str(path), "#!/bin/sh\necho replaced\n")

    assert stat.S_IMODE(path.stat().st_mode) == 0o750
    assert client.exec([str(path)]).stdout == "replaced\n"


def test_write_into_missing_directory_is_enoent(client: AgentClient, tmp_path: Path) -> None:
    with pytest.raises(GuestOSError) as caught:
        client.write_file(str(tmp_path / "missing" / "file"), b"data")

    assert caught.value.errno == errno.ENOENT


def test_write_over_a_directory_fails_and_leaves_no_temporary_file(client: AgentClient, tmp_path: Path) -> None:
    target = tmp_path / "directory"
    target.mkdir()

    with pytest.raises(GuestOSError) as caught:
        client.write_file(str(target), b"x" * (wire.CHUNK_SIZE + 1))

    assert caught.value.errno == errno.EISDIR
    assert caught.value.path == str(target)
    assert [p.name for p in tmp_path.iterdir()] == ["directory"]


def test_read_missing_file_carries_enoent(client: AgentClient, tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")

    with pytest.raises(GuestOSError) as caught:
        client.read_file(missing)

    assert caught.value.errno == errno.ENOENT
    assert caught.value.path == missing
    assert missing in str(caught.value)
    assert isinstance(caught.value, AgentError)


def test_read_directory_is_eisdir(client: AgentClient, tmp_path: Path) -> None:
    with pytest.raises(GuestOSError) as caught:
        client.read_file(str(tmp_path))

    assert caught.value.errno == errno.EISDIR


# -- bad input ----------------------------------------------------------------------


def test_unknown_operation_is_an_error_and_the_agent_keeps_serving(raw: RawChannel) -> None:
    raw.send({"id": 1, "op": "frobnicate"})

    error = raw.receive().fields
    assert error["id"] == 1
    assert error["error"]["type"] == "UnknownOperation"
    assert "frobnicate" in error["error"]["message"]

    raw.send({"id": 2, "op": "ping"})
    assert raw.receive().fields["id"] == 2


@pytest.mark.parametrize(
    "request_fields",
    [
        {"op": "exec"},
        {"op": "exec", "argv": "ls"},
        {"op": "exec", "argv": ["ls"], "shell": "ls"},
        {"op": "exec", "shell": "true", "timeout": -1},
        {"op": "exec", "shell": "true", "env": {"A": 1}},
        {"op": "read_file"},
        {"op": "write_file", "path": 5},
        {"op": "write_file", "path": "/tmp/x", "mode": 99999},
    ],
)
def test_bad_requests_get_bad_request_errors(raw: RawChannel, request_fields: dict) -> None:
    raw.send({"id": 3, **request_fields})

    reply = raw.receive().fields

    assert reply["id"] == 3
    assert reply["error"]["type"] == "BadRequest"


def test_malformed_frames_are_logged_and_skipped(agent: AgentUnderTest, raw: RawChannel) -> None:
    body = b"{broken"
    raw.sock.sendall(b"line noise" + wire.HEADER.pack(wire.MAGIC, len(body), 0) + body)
    raw.send({"id": 4, "op": "ping"})

    assert raw.receive().fields["id"] == 4
    assert any("skipped 10 bytes" in line for line in agent.log)
    assert any("unreadable" in line for line in agent.log)


def test_continuation_for_unknown_request_is_dropped(agent: AgentUnderTest, raw: RawChannel) -> None:
    raw.send({"id": 77, "more": False}, b"orphan chunk")
    raw.send({"id": 5, "op": "ping"})

    assert raw.receive().fields["id"] == 5
    assert any("77" in line and "not in progress" in line for line in agent.log)


def test_request_cut_short_by_end_of_input_leaves_no_upload_behind(agent: AgentUnderTest, tmp_path: Path) -> None:
    raw = RawChannel(agent.host_end)
    raw.send({"id": 6, "op": "write_file", "path": str(tmp_path / "upload"), "more": True}, b"first chunk")
    raw.send({"id": 7, "op": "ping"})
    assert raw.receive().fields["id"] == 7
    assert len(list(tmp_path.iterdir())) == 1  # the temporary file of the upload in progress

    agent.stop()

    assert list(tmp_path.iterdir()) == []
    assert any("dropped the partial request 6" in line for line in agent.log)


# -- streaming output and flow control ------------------------------------------------


def test_output_streams_no_further_than_the_credit_window(client: AgentClient) -> None:
    received = {wire.STDOUT: 0, wire.STDERR: 0}
    arrived = threading.Event()

    def on_output(fd: int, data: bytes, skipped: int) -> None:
        received[fd] += len(data)
        arrived.set()

    window = wire.OUTPUT_CHUNK_SIZE
    request = exec_request("head -c 5000000 /dev/zero; echo done >&2", max_output=None)
    call = client.start_stream(request, on_output, window=window, auto_credit=False)
    assert arrived.wait(10)
    time.sleep(0.2)  # the command could print megabytes meanwhile

    assert received[wire.STDOUT] == window  # the agent stopped at the window
    assert client.ping()["protocol"] == wire.PROTOCOL_VERSION  # and the channel stays free

    while not call.done.is_set():
        call.credit(window)  # now consume as fast as it comes
        time.sleep(0.001)
    reply = call.wait(10)
    assert reply["exit_code"] == 0 and not reply["truncated"]
    assert received == {wire.STDOUT: 5_000_000, wire.STDERR: 5}


def test_output_past_max_output_keeps_head_and_tail(client: AgentClient) -> None:
    script = "import sys; sys.stdout.write(''.join(f'{n:07d}\\n' for n in range(200000)))"

    result = client.exec(["python3", "-c", script], max_output=64)

    lines = result.stdout.split("\n")
    assert result.truncated and len(result.stdout_bytes) == 64
    assert lines[:4] == ["0000000", "0000001", "0000002", "0000003"]
    assert lines[-5:] == ["0199996", "0199997", "0199998", "0199999", ""]


def test_output_within_max_output_is_whole_and_not_flagged(client: AgentClient) -> None:
    result = client.exec("head -c 100000 /dev/zero", max_output=100_000)

    assert len(result.stdout_bytes) == 100_000 and not result.truncated


def test_max_output_zero_keeps_nothing_but_says_so(client: AgentClient) -> None:
    result = client.exec("echo hello; echo oops >&2", max_output=0)

    assert (result.stdout_bytes, result.stderr_bytes, result.truncated) == (b"", b"", True)


def test_signal_and_exit_status_follow_one_convention(client: AgentClient) -> None:
    killed = client.exec("kill -SEGV $$")
    normal = client.exec("exit 3")

    assert (killed.exit_code, killed.signal, killed.exit_status) == (-signal.SIGSEGV, signal.SIGSEGV, 139)
    assert (normal.exit_code, normal.signal, normal.exit_status) == (3, None, 3)
    assert not killed.oom_killed


def test_bad_max_output_is_refused_before_sending(client: AgentClient) -> None:
    with pytest.raises(ValueError, match="max_output"):
        client.exec("true", max_output=-1)


def test_the_agent_kills_a_running_command_by_request_id(agent: AgentUnderTest, client: AgentClient) -> None:
    call = client.start_stream(exec_request("sleep 60"), lambda *args: None)
    poll_until(lambda: agent.agent.kill_command(call.request_id), timeout=10, what="the command to start")

    assert call.wait(10)["exit_code"] == -signal.SIGKILL


def test_commands_of_a_guest_agent_are_preferred_oom_victims_and_still_report_127() -> None:
    with AgentPair(oom_target=True) as pair, AgentClient(pair.host_end) as client:
        score = client.exec("cat /proc/self/oom_score_adj")
        missing = client.exec(["no-such-program-anywhere"])

    assert score.stdout.strip() == "500"
    assert missing.exit_code == 127 and "no-such-program-anywhere" in missing.stderr


def test_shell_commands_of_a_guest_agent_keep_their_shell_semantics() -> None:
    with AgentPair(oom_target=True) as pair, AgentClient(pair.host_end) as client:
        shell = client.exec('echo "$0 $# [$*]"; cat /proc/self/oom_score_adj; kill -TERM $$; echo never')
        broken = client.exec("echo ok\nif then")

    assert shell.stdout == "/bin/sh 0 []\n500\n" and shell.signal == signal.SIGTERM
    assert broken.exit_code == 2 and re.search(r"(line |: )2\b", broken.stderr)  # its own line numbers


# -- cancel -------------------------------------------------------------------------


def _exec_in_thread(client: AgentClient, ticket: RequestTicket, command: str) -> tuple[threading.Thread, list]:
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(ticket.run(client, lambda: client.exec(command)))
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_cancel_kills_the_running_command_with_its_process_group(client: AgentClient, tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    ticket = RequestTicket()
    thread, outcome = _exec_in_thread(client, ticket, f"sleep 30 & echo $! > {pids}; echo $$ >> {pids}; sleep 30")
    for _ in range(500):
        if pids.exists() and len(pids.read_text().split()) == 2:
            break
        time.sleep(0.01)
    background, shell = map(int, pids.read_text().split())
    target = ticket.withdraw()
    assert target is not None and target[0] is client

    reply = cancel_request(client, target[1], timeout=10)

    assert reply["found"] and reply["finished"]
    thread.join(timeout=5)
    assert outcome[0].exit_code == -signal.SIGKILL
    assert wait_until_dead(shell) and wait_until_dead(background), "the command's process group survived"
    assert client.exec("echo next").stdout == "next\n"


def test_a_call_withdrawn_before_sending_never_reaches_the_agent(client: AgentClient, tmp_path: Path) -> None:
    ticket = RequestTicket()
    assert ticket.withdraw() is None

    with pytest.raises(Withdrawn):
        ticket.run(client, lambda: client.exec(f"touch {tmp_path / 'ran'}"))

    assert not (tmp_path / "ran").exists()


def test_cancel_of_a_request_not_in_progress_is_not_found(raw: RawChannel) -> None:
    raw.send({"id": 13, "op": "ping"})
    assert raw.receive().fields["id"] == 13

    raw.send({"id": 14, "op": "cancel", "target": 999})

    assert raw.receive().fields == {"id": 14, "found": False, "finished": True}


def test_cancel_drops_an_upload_still_arriving(agent: AgentUnderTest, raw: RawChannel, tmp_path: Path) -> None:
    destination = tmp_path / "upload"
    destination.write_bytes(b"old contents")
    raw.send({"id": 10, "op": "write_file", "path": str(destination), "more": True}, b"first chunk")
    raw.send({"id": 11, "op": "cancel", "target": 10})
    cancel_reply = raw.receive().fields
    raw.send({"id": 10, "more": True}, b"second chunk")
    raw.send({"id": 10, "more": False}, b"last chunk")
    upload_reply = raw.receive().fields

    assert cancel_reply == {"id": 11, "found": True, "finished": True}
    assert upload_reply["id"] == 10 and upload_reply["error"]["type"] == "Cancelled"
    assert destination.read_bytes() == b"old contents"
    assert list(tmp_path.iterdir()) == [destination], "the upload's temporary file was left behind"


def test_cancel_without_a_target_is_a_bad_request(raw: RawChannel) -> None:
    raw.send({"id": 12, "op": "cancel", "target": "12"})

    assert raw.receive().fields["error"]["type"] == "BadRequest"
