"""``write_file`` as a user other than root: in place, with that user's permissions, streamed straight to the file.

The agent opens the destination under the user's filesystem identity (its
reader thread's fsuid and fsgid, no supplementary groups) and writes every
chunk into it as it arrives, so the guest holds one copy of the file and the
agent one chunk. The tests that switch identity need root, as the guest's
agent has; as a normal user the agent may still write as itself, and is
refused any other user.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_pair import AgentPair

from pytest_forkd.errors import AgentError
from pytest_forkd.guest import wire
from pytest_forkd.guest.client import AgentClient, GuestOSError

USER = 1234
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root, as in the guest")


class Raw:
    """The wire protocol by hand, to send a payload in chunks and look at the file between them."""

    def __init__(self, pair: AgentPair) -> None:
        pair.host_end.settimeout(10)
        self.sock = pair.host_end
        self.reader = wire.FrameReader(pair.host_end.recv)

    def send(self, fields: dict[str, object], payload: bytes = b"") -> None:
        self.sock.sendall(wire.encode_header(fields, len(payload)) + payload)

    def receive(self) -> dict[str, object]:
        frame = self.reader.read_frame()
        assert frame is not None
        return frame.fields


@pytest.fixture
def pair() -> Iterator[AgentPair]:
    with AgentPair() as agent_pair:
        yield agent_pair


@pytest.fixture
def client(pair: AgentPair) -> Iterator[AgentClient]:
    with AgentClient(pair.host_end) as agent_client:
        yield agent_client


@pytest.fixture
def world() -> Iterator[Path]:
    """A folder every user can reach (pytest's tmp_path sits under a folder of root's only)."""
    folder = Path(tempfile.mkdtemp(prefix="forkd-write-as-user-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def owned_folder(parent: Path, name: str, uid: int, mode: int = 0o755) -> Path:
    folder = parent / name
    folder.mkdir()
    os.chown(folder, uid, uid)
    folder.chmod(mode)
    return folder


@needs_root
def test_a_new_file_is_the_users_and_holds_every_chunk(client: AgentClient, world: Path) -> None:
    home = owned_folder(world, "home", USER)
    data = os.urandom(3 * wire.CHUNK_SIZE + 17)

    client.write_file(str(home / "out.bin"), data, user=f"{USER}:{USER}")

    written = home / "out.bin"
    info = written.stat()
    assert written.read_bytes() == data
    assert (info.st_uid, info.st_gid) == (USER, USER)
    assert stat.S_IMODE(info.st_mode) == 0o666 & ~_umask()


@needs_root
def test_the_users_permissions_apply_not_roots(client: AgentClient, world: Path) -> None:
    roots = world / "roots"
    roots.mkdir(mode=0o755)
    (roots / "config").write_text("root's\n")
    (roots / "config").chmod(0o644)

    with pytest.raises(GuestOSError) as new_file:
        client.write_file(str(roots / "new"), b"x", user=str(USER))
    with pytest.raises(GuestOSError) as existing:
        client.write_file(str(roots / "config"), b"overwritten", user=str(USER))

    assert new_file.value.errno == errno.EACCES and new_file.value.path == str(roots / "new")
    assert existing.value.errno == errno.EACCES
    assert not (roots / "new").exists() and (roots / "config").read_text() == "root's\n"
    # The agent's own identity is back: root still writes there (atomically, as before).
    client.write_file(str(roots / "config"), b"root again\n")
    assert (roots / "config").read_bytes() == b"root again\n"


@needs_root
def test_a_file_of_the_user_in_a_folder_of_roots_is_written_in_place(client: AgentClient, world: Path) -> None:
    roots = world / "roots"
    roots.mkdir(mode=0o755)
    target = roots / "notes"
    target.write_bytes(b"a longer old content that must not survive")
    os.chown(target, USER, USER)
    inode = target.stat().st_ino

    client.write_file(str(target), b"new", user=str(USER), mode=0o600)

    assert target.read_bytes() == b"new"  # truncated first, as `cat > notes` does
    assert target.stat().st_ino == inode  # the same file: no rename, which the folder would not allow
    assert stat.S_IMODE(target.stat().st_mode) == 0o600


@needs_root
def test_only_the_owner_may_change_the_mode(client: AgentClient, world: Path) -> None:
    shared = world / "shared"
    shared.write_bytes(b"")
    shared.chmod(0o666)  # anyone may write it, only root may chmod it

    with pytest.raises(GuestOSError) as refused:
        client.write_file(str(shared), b"data", user=str(USER), mode=0o777)

    assert refused.value.errno == errno.EPERM
    assert stat.S_IMODE(shared.stat().st_mode) == 0o666


@needs_root
def test_chunks_reach_the_file_as_they_arrive(pair: AgentPair, world: Path) -> None:
    home = owned_folder(world, "home", USER)
    target = home / "streamed"
    raw = Raw(pair)
    chunk = b"a" * wire.CHUNK_SIZE

    raw.send({"id": 1, "op": "write_file", "path": str(target), "user": str(USER), "more": True}, chunk)
    raw.send({"id": 1, "more": True}, chunk)
    raw.send({"id": 2, "op": "ping"})
    assert raw.receive()["id"] == 2  # the agent read both chunks: they are in the file, not in memory
    assert target.stat().st_size == 2 * len(chunk)
    raw.send({"id": 1, "more": False}, b"end")

    assert raw.receive() == {"id": 1, "size": 2 * len(chunk) + 3}
    assert target.stat().st_size == 2 * len(chunk) + 3
    assert not [path for path in home.iterdir() if path != target], "no upload file beside it"


@needs_root
def test_a_fifo_is_refused_at_once_and_the_agent_keeps_serving(client: AgentClient, world: Path) -> None:
    home = owned_folder(world, "home", USER)
    fifo = home / "pipe"
    os.mkfifo(fifo)
    os.chown(fifo, USER, USER)
    done = threading.Event()

    def write() -> None:
        with pytest.raises(GuestOSError) as refused:
            client.write_file(str(fifo), b"never read", user=str(USER), timeout=20)
        assert refused.value.errno in (errno.ENXIO, errno.EINVAL)
        done.set()

    writer = threading.Thread(target=write)
    writer.start()
    writer.join(20)
    assert done.is_set(), "the write to a FIFO nobody reads blocked"
    assert client.ping()["protocol"] == wire.PROTOCOL_VERSION


@needs_root
def test_root_and_no_user_replace_the_file_atomically(client: AgentClient, world: Path) -> None:
    target = world / "replaced"
    target.write_bytes(b"old")
    inode = target.stat().st_ino

    client.write_file(str(target), b"new", user="0:0")

    assert target.read_bytes() == b"new" and target.stat().st_ino != inode


def test_an_unknown_user_name_is_refused_and_nothing_is_written(client: AgentClient, world: Path) -> None:
    target = world / "never"
    with pytest.raises(AgentError, match="unable to find user no-such-user-here"):
        client.write_file(str(target), b"x" * (wire.CHUNK_SIZE + 1), user="no-such-user-here")
    assert not target.exists()
    assert client.ping()["protocol"] == wire.PROTOCOL_VERSION


@pytest.mark.skipif(os.geteuid() == 0, reason="what a normal user's agent may do: root may act as anyone")
def test_an_agent_that_is_not_root_writes_as_itself_and_no_one_else(client: AgentClient, world: Path) -> None:
    mine = world / "mine"
    client.write_file(str(mine), b"mine", user=f"{os.getuid()}:{os.getgid()}")
    assert mine.read_bytes() == b"mine"

    with pytest.raises(GuestOSError) as refused:
        client.write_file(str(world / "theirs"), b"x", user=str(USER))
    assert refused.value.errno == errno.EPERM


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
