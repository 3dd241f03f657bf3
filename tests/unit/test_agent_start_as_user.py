"""How the agent starts a command: as its user with no program in between, and moved into its cgroup after.

The user switch is the starting thread's own credentials at the ``vfork``
(raw system calls: the C library's would switch every thread), so these
tests check that the command is that user completely, that the thread and
every other thread are root again afterwards, and that an agent that is not
root is refused. The cgroup move is checked with a fake agent group: what a
command forked before its move is found by its session and moved after it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_pair import AgentPair
from support import wait_until_dead

from pytest_forkd.errors import AgentError
from pytest_forkd.guest.agent import cgroups as agent_cgroups
from pytest_forkd.guest.agent.cgroups import CommandCgroups, _CommandGroup
from pytest_forkd.guest.agent.users import Credentials, _AccountFile, starting_as
from pytest_forkd.guest.client import AgentClient

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root, as in the guest")
IDS = "id -u; id -g; id -G; grep CapEff /proc/self/status"


@pytest.fixture
def client() -> Iterator[AgentClient]:
    with AgentPair() as pair, AgentClient(pair.host_end) as agent_client:
        yield agent_client


@needs_root
@pytest.mark.parametrize("argv", [["sh", "-c", IDS], ["/bin/sh", "-c", IDS]], ids=["program", "shell"])
def test_a_command_runs_as_the_user_completely_and_the_agent_stays_root(client: AgentClient, argv: list[str]) -> None:
    before = (os.getresuid(), os.getresgid(), os.getgroups())

    result = client.exec(argv, user="1234:5678")
    on_terminal = client.exec(argv, user="1234:5678", pty=True)  # forked, not vforked: the child sets its terminal

    assert result.stdout.split() == ["1234", "5678", "5678", "CapEff:", "0000000000000000"], result
    assert on_terminal.stdout.split() == result.stdout.split() and on_terminal.exit_code == 0
    assert (os.getresuid(), os.getresgid(), os.getgroups()) == before
    assert client.exec(["id", "-u"]).stdout == "0\n"


@needs_root
def test_the_starting_thread_alone_is_the_user_and_is_root_again_after() -> None:
    seen: dict[str, object] = {}
    inside = threading.Event()
    release = threading.Event()

    def starter() -> None:
        with starting_as(Credentials(1234, 5678, "/")):
            seen["inside"] = (os.getresuid(), os.getresgid(), os.getgroups())
            inside.set()
            release.wait(10)
        seen["after"] = (os.getresuid(), os.getresgid())

    thread = threading.Thread(target=starter)
    thread.start()
    assert inside.wait(10)
    seen["other thread"] = (os.getresuid(), os.getresgid())
    release.set()
    thread.join(10)

    assert seen["inside"] == ((1234, 1234, 0), (5678, 5678, 0), [])
    assert seen["other thread"] == seen["after"] == ((0, 0, 0), (0, 0, 0))


@needs_root
def test_a_program_the_user_may_not_execute_or_a_folder_it_may_not_enter_is_refused_as_that_user(
    client: AgentClient, tmp_path: Path
) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    program = tmp_path / "program"
    program.write_text("#!/bin/sh\necho ran\n")
    program.chmod(0o744)  # root may run it, others may not
    tmp_path.chmod(0o755)

    denied = client.exec([str(program)], user="1234")
    assert (denied.exit_code, denied.stderr) == (126, f"forkd-exec: exec: {program}: Permission denied\n")
    assert client.exec([str(program)]).stdout == "ran\n"
    with pytest.raises(AgentError, match="Permission denied"):
        client.exec(["true"], user="1234", cwd=str(private))


def test_an_agent_that_is_not_root_is_refused_another_user(tmp_path: Path) -> None:
    code = (
        "from pytest_forkd.guest.agent.users import Credentials, starting_as\n"
        "try:\n"
        "    with starting_as(Credentials(4321, 4321, '/')):\n"
        "        print('switched')\n"
        "except PermissionError as exc:\n"
        "    print('refused:', exc)\n"
    )
    as_user = {"user": 65534, "group": 65534, "extra_groups": []} if os.geteuid() == 0 else {}
    if as_user and not all(_open_to_others(path) for path in (sys.executable, __file__)):
        pytest.skip("this Python or the checkout is not open to other users (as root's own Python under /root)")
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
        timeout=60,
        **as_user,  # type: ignore[arg-type]
    )

    assert done.stdout.startswith("refused: [Errno 1] cannot run a command as user 4321"), done.stderr


def _open_to_others(path: str) -> bool:
    """Whether any user may read ``path`` (and run it, if it is a program): every folder above it open too."""
    real = Path(os.path.realpath(path))
    folders_open = all(os.stat(folder).st_mode & 0o001 for folder in real.parents)
    return folders_open and bool(os.stat(real).st_mode & 0o004)


# -- the move into the command's cgroup -------------------------------------------------


class FakeAgentGroup:
    """The agent's cgroup.procs as a file; moving a process takes it out, as the kernel does."""

    def __init__(self, tmp_path: Path, members: list[int], *, moves: bool = True) -> None:
        self.procs = tmp_path / "agent" / "cgroup.procs"
        self.procs.parent.mkdir()
        self.moves = moves
        self.moved: list[int] = []
        self.write([os.getpid(), *members])

    def write(self, pids: list[int]) -> None:
        self.procs.write_text("".join(f"{pid}\n" for pid in pids))

    def move(self, pid: int) -> None:
        self.moved.append(pid)
        if self.moves:
            self.write([int(word) for word in self.procs.read_text().split() if int(word) != pid])


def _session_with_children() -> tuple[subprocess.Popen[bytes], list[int]]:
    """A session leader whose two children are already running, and their pids."""
    leader = subprocess.Popen(
        ["sh", "-c", "sleep 60 & sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, start_new_session=True
    )
    assert leader.stdout is not None
    last = int(leader.stdout.readline())
    children = [int(pid) for pid in Path(f"/proc/{leader.pid}/task/{leader.pid}/children").read_text().split()]
    assert last in children and len(children) == 2
    return leader, children


def _adopt(tmp_path: Path, fake: FakeAgentGroup, pid: int, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    monkeypatch.setattr(_CommandGroup, "move", lambda group, pid: fake.move(pid))
    monkeypatch.setattr(agent_cgroups, "set_oom_score", lambda pid, score: None)
    logged: list[str] = []
    command_groups = CommandCgroups(str(tmp_path / "forkd"), logged.append, str(fake.procs.parent))
    command_groups.adopt(_CommandGroup(str(tmp_path / "forkd" / "cmd-1")), pid, 500)
    return logged


def test_what_a_command_forked_before_its_move_follows_it_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    leader, children = _session_with_children()
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        fake = FakeAgentGroup(tmp_path, [*children, stranger.pid])

        logged = _adopt(tmp_path, fake, leader.pid, monkeypatch)

        assert fake.moved[0] == leader.pid and sorted(fake.moved[1:]) == sorted(children)
        assert fake.procs.read_text().split() == [str(os.getpid()), str(stranger.pid)]
        assert logged == []
    finally:
        for process in (leader, stranger):
            with process:  # reaped, and its pipe closed
                os.killpg(process.pid, signal.SIGKILL)


def test_processes_that_stay_out_of_the_group_are_killed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    leader, children = _session_with_children()
    try:
        fake = FakeAgentGroup(tmp_path, children, moves=False)  # as if they forked faster than moved

        logged = _adopt(tmp_path, fake, leader.pid, monkeypatch)

        assert len(fake.moved) == 1 + agent_cgroups.ADOPT_ROUNDS * len(children)
        assert all(wait_until_dead(child) for child in children)
        assert logged and "killed processes of command" in logged[0]
    finally:
        with leader:  # reaped, and its pipe closed
            os.killpg(leader.pid, signal.SIGKILL)


# -- the account files -----------------------------------------------------------------------------------


def test_account_files_are_read_again_only_when_they_change(tmp_path: Path) -> None:
    path = tmp_path / "passwd"
    path.write_text("root:x:0:0::/root:/bin/sh\n")
    accounts = _AccountFile(str(path))

    first = accounts.entries()
    assert first == [["root", "x", "0", "0", "", "/root", "/bin/sh"]]
    assert accounts.entries() is first  # unchanged: not read again

    with path.open("a") as appending:  # edited in place
        appending.write("user:x:1000:1000::/home/user:/bin/bash\n")
    assert [entry[0] for entry in accounts.entries()] == ["root", "user"]

    replacement = tmp_path / "passwd.new"  # a new file renamed over it, as useradd does
    replacement.write_text("user:x:1001:1001::/home/user:/bin/bash\n")
    os.replace(replacement, path)
    assert accounts.entries() == [["user", "x", "1001", "1001", "", "/home/user", "/bin/bash"]]

    path.unlink()
    assert accounts.entries() == []
