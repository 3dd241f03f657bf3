"""Tar streams without a VM: packing with excludes, and unpacking archives that try to escape."""

from __future__ import annotations

import io
import os
import socket
import stat
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_pair import AgentPair
from trees import differences, listing, make_tree

from pytest_forkd.core import copy as copy_module
from pytest_forkd.errors import CopyError, GuestProtocolError, UnsafeArchive
from pytest_forkd.guest import tarstream, wire
from pytest_forkd.guest.client import AgentClient
from pytest_forkd.guest.tarstream import ArchiveRefused, ChunkPipe, Excludes, PipeStalled, pack, unpack


def packed(source: Path, exclude: tuple[str, ...] = ()) -> bytes:
    out = io.BytesIO()
    pack(str(source), out, exclude)
    return out.getvalue()


def archive(*members: tuple[str, bytes, object]) -> bytes:
    """A tar archive of (name, type, data-or-linkname) members, as a hostile sender would make it."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, data in members:
            info = tarfile.TarInfo(name)
            info.type = kind
            info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
            if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE):
                info.linkname = str(data)
                tar.addfile(info)
            elif kind == tarfile.REGTYPE:
                info.size = len(data)  # type: ignore[arg-type]
                tar.addfile(info, io.BytesIO(data))  # type: ignore[arg-type]
            else:
                tar.addfile(info)
    return out.getvalue()


ROOT = (".", tarfile.DIRTYPE, b"")


def test_a_tree_round_trips_with_modes_links_and_nanosecond_mtimes(tmp_path: Path) -> None:
    make_tree(tmp_path / "src", files=60, total_bytes=300_000)
    stats = unpack(io.BytesIO(packed(tmp_path / "src")), str(tmp_path / "dst"))

    assert differences(listing(tmp_path / "src"), listing(tmp_path / "dst")) == []
    assert stats.files == len(listing(tmp_path / "src"))


def test_a_single_file_or_link_is_the_destination_itself(tmp_path: Path) -> None:
    (tmp_path / "tool").write_text("#!/bin/sh\n")
    os.chmod(tmp_path / "tool", 0o750)
    os.symlink("/nowhere", tmp_path / "link")

    unpack(io.BytesIO(packed(tmp_path / "tool")), str(tmp_path / "new" / "dir" / "tool2"))
    unpack(io.BytesIO(packed(tmp_path / "link")), str(tmp_path / "new" / "link2"))

    assert stat.S_IMODE((tmp_path / "new" / "dir" / "tool2").stat().st_mode) == 0o750
    assert os.readlink(tmp_path / "new" / "link2") == "/nowhere"


def test_excludes_match_names_at_any_depth_or_relative_paths() -> None:
    excludes = Excludes(["*.pyc", "__pycache__", "build/*", "docs/_build/"])
    assert excludes.excluded("a.pyc") and excludes.excluded("pkg/sub/b.pyc")
    assert excludes.excluded("pkg/__pycache__")
    assert excludes.excluded("build/x.o") and not excludes.excluded("src/build/x.o")
    assert excludes.excluded("docs/_build") and not excludes.excluded("docs/index.rst")
    assert not excludes.excluded("main.py")


def test_packing_skips_excluded_directories_whole_and_special_files(tmp_path: Path) -> None:
    source = tmp_path / "src"
    (source / "__pycache__").mkdir(parents=True)
    (source / "__pycache__" / "m.pyc").write_bytes(b"x")
    (source / "m.py").write_text("m")
    os.mkfifo(source / "fifo")
    out = io.BytesIO()
    stats = pack(str(source), out, ["__pycache__"])
    with tarfile.open(fileobj=io.BytesIO(out.getvalue())) as tar:
        assert tar.getnames() == [".", "m.py"]
    assert stats.skipped == 1


@pytest.mark.parametrize(
    ("members", "refused"),
    [
        ((ROOT, ("../../escape", tarfile.REGTYPE, b"x")), "../../escape"),
        ((ROOT, ("a/../../escape", tarfile.REGTYPE, b"x")), "a/../../escape"),
        ((ROOT, ("/tmp/absolute", tarfile.REGTYPE, b"x")), "/tmp/absolute"),
        ((ROOT, ("hard", tarfile.LNKTYPE, "/etc/passwd")), "hard"),
        ((ROOT, ("dev", tarfile.CHRTYPE, b"")), "dev"),
        ((ROOT, ("blk", tarfile.BLKTYPE, b"")), "blk"),
        ((ROOT, ("fifo", tarfile.FIFOTYPE, b"")), "fifo"),
        (((".", tarfile.REGTYPE, b"root is a file"), ("below", tarfile.REGTYPE, b"x")), "below"),
    ],
)
def test_members_that_could_escape_are_refused(tmp_path: Path, members: tuple, refused: str) -> None:
    destination = tmp_path / "a" / "b" / "dest"
    with pytest.raises(ArchiveRefused) as caught:
        unpack(io.BytesIO(archive(*members)), str(destination))
    assert caught.value.member == refused
    assert not (tmp_path / "escape").exists() and not (tmp_path / "a" / "escape").exists()
    assert not Path("/tmp/absolute").exists()


def test_nothing_is_written_through_a_link_from_the_archive_or_already_there(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    with pytest.raises(ArchiveRefused, match="symbolic link") as caught:
        unpack(
            io.BytesIO(archive(ROOT, ("out", tarfile.SYMTYPE, str(outside)), ("out/pwned", tarfile.REGTYPE, b"x"))),
            str(tmp_path / "dest"),
        )
    assert caught.value.member == "out/pwned"
    assert list(outside.iterdir()) == []

    # A link already at the destination is replaced by a file of the archive, never written through.
    (tmp_path / "dest2").mkdir()
    (outside / "victim").write_text("untouched")
    os.symlink(outside / "victim", tmp_path / "dest2" / "f")
    os.symlink(outside, tmp_path / "dest2" / "sub")
    unpack(io.BytesIO(archive(ROOT, ("f", tarfile.REGTYPE, b"new"))), str(tmp_path / "dest2"))
    assert (outside / "victim").read_text() == "untouched"
    assert not (tmp_path / "dest2" / "f").is_symlink() and (tmp_path / "dest2" / "f").read_bytes() == b"new"
    with pytest.raises(ArchiveRefused):
        unpack(io.BytesIO(archive(ROOT, ("sub/x", tarfile.REGTYPE, b"x"))), str(tmp_path / "dest2"))
    with pytest.raises(NotADirectoryError):  # a directory member onto that link: not followed either
        unpack(io.BytesIO(archive(ROOT, ("sub", tarfile.DIRTYPE, b""))), str(tmp_path / "dest2"))
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]


def test_sizes_members_and_headers_are_bounded(tmp_path: Path) -> None:
    data = archive(ROOT, ("a", tarfile.REGTYPE, b"x" * 1000), ("b", tarfile.REGTYPE, b"y" * 1000))
    with pytest.raises(ArchiveRefused, match="max_size"):
        unpack(io.BytesIO(data), str(tmp_path / "d1"), max_bytes=1500)
    with pytest.raises(ArchiveRefused, match="max_files"):
        unpack(io.BytesIO(data), str(tmp_path / "d2"), max_members=2)
    huge = io.BytesIO()
    with tarfile.open(fileobj=huge, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("x")
        info.pax_headers = {"comment": "z" * (tarstream.MAX_HEADER_BYTES + 10)}
        tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(ArchiveRefused, match="extended header"):
        unpack(io.BytesIO(huge.getvalue()), str(tmp_path / "d3"))


def test_empty_garbage_and_truncated_streams_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ArchiveRefused, match="not a tar stream|empty"):
        unpack(io.BytesIO(b""), str(tmp_path / "e"))
    with pytest.raises(ArchiveRefused):
        unpack(io.BytesIO(b"\x01garbage" * 200), str(tmp_path / "g"))
    data = archive(ROOT, ("big", tarfile.REGTYPE, b"z" * 50_000))
    with pytest.raises(ArchiveRefused, match="truncated|cut short"):
        unpack(io.BytesIO(data[:20_000]), str(tmp_path / "t"))


def test_setid_bits_are_dropped_when_asked(tmp_path: Path) -> None:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        info = tarfile.TarInfo("prog")
        info.mode = 0o6755
        tar.addfile(info, io.BytesIO(b""))
    unpack(io.BytesIO(out.getvalue()), str(tmp_path / "d"), strip_setid=True)
    assert stat.S_IMODE((tmp_path / "d" / "prog").stat().st_mode) == 0o755


def test_the_destination_rule_file_onto_directory_and_directory_onto_file(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("f")
    with pytest.raises(IsADirectoryError) as caught:
        unpack(io.BytesIO(archive((".", tarfile.REGTYPE, b"x"))), str(tmp_path / "dir"))
    assert caught.value.filename == str(tmp_path / "dir")
    with pytest.raises(NotADirectoryError) as caught:
        unpack(io.BytesIO(archive(ROOT)), str(tmp_path / "file"))
    assert caught.value.filename == str(tmp_path / "file")
    with pytest.raises(NotADirectoryError) as caught:
        unpack(io.BytesIO(archive(ROOT)), str(tmp_path / "file" / "below"))
    assert caught.value.filename == str(tmp_path / "file" / "below")


def test_a_chunk_pipe_bounds_what_it_holds_and_notices_stalls() -> None:
    pipe = ChunkPipe(limit=10)
    pipe.put(b"0123456789")
    blocked = threading.Thread(target=pipe.put, args=(b"more",))
    blocked.start()
    blocked.join(0.05)
    assert blocked.is_alive()  # full: the writer waits for the reader
    assert pipe.read(4) == b"0123"
    blocked.join(5)
    assert not blocked.is_alive()
    pipe.close_reader()
    pipe.put(b"dropped")  # the reader left: writers never block again

    stalled = ChunkPipe(stall_timeout=0.05)
    started = time.monotonic()
    with pytest.raises(PipeStalled):
        stalled.read(10)
    assert time.monotonic() - started < 5

    overflowing = ChunkPipe(overflow=5)
    with pytest.raises(OverflowError):
        overflowing.put(b"123456")


# -- the host's copy functions against the real agent, over a socketpair ----------------------------


@pytest.fixture
def client() -> Iterator[AgentClient]:
    with AgentPair() as pair, AgentClient(pair.host_end) as client:
        yield client


def test_copy_in_and_out_through_the_agent_protocol(client: AgentClient, tmp_path: Path) -> None:
    make_tree(tmp_path / "src", files=40, total_bytes=3 * wire.CHUNK_SIZE)  # several frames each way
    copied_in = copy_module.copy_in(client, str(tmp_path / "src"), str(tmp_path / "guest"))
    copied_out = copy_module.copy_out(client, str(tmp_path / "guest"), str(tmp_path / "back"))

    assert differences(listing(tmp_path / "src"), listing(tmp_path / "back")) == []
    assert copied_in.bytes == copied_out.bytes >= 3 * wire.CHUNK_SIZE
    assert client.ping()["protocol"] == wire.PROTOCOL_VERSION


def test_copy_errors_name_the_path_and_the_channel_goes_on(client: AgentClient, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(CopyError, match="nothing-here") as caught:
        copy_module.copy_out(client, str(tmp_path / "nothing-here"), str(tmp_path / "out"))
    assert caught.value.path == str(tmp_path / "nothing-here")
    with pytest.raises(CopyError, match="file/below"):
        copy_module.copy_in(client, str(tmp_path / "file"), str(tmp_path / "file" / "below"))
    assert client.ping()["protocol"] == wire.PROTOCOL_VERSION


def test_a_hostile_archive_is_refused_by_copy_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # This guest answers nothing but the copy: when the host refuses the archive before its last
    # frame came, its cancel goes unanswered for CANCEL_TIMEOUT.
    monkeypatch.setattr(copy_module, "CANCEL_TIMEOUT", 1.0)
    host_end, guest_end = socket.socketpair()
    reader = wire.FrameReader(guest_end.recv)
    evil = archive(ROOT, ("../escape", tarfile.REGTYPE, b"x"))

    def hostile() -> None:
        frame = reader.read_frame()
        request_id = frame.fields["id"]
        guest_end.sendall(wire.encode_header({"id": request_id, "more": True, "fd": 1}, len(evil)) + evil)
        guest_end.sendall(wire.encode_header({"id": request_id, "files": 2, "bytes": 1}))

    thread = threading.Thread(target=hostile, daemon=True)
    thread.start()
    with AgentClient(host_end) as client, pytest.raises(UnsafeArchive) as caught:
        copy_module.copy_out(client, "/anything", str(tmp_path / "dest"))
    guest_end.close()
    assert caught.value.path == "../escape"
    assert not (tmp_path / "escape").exists()


def test_a_guest_that_sends_past_its_credit_or_the_archive_is_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(copy_module, "CANCEL_TIMEOUT", 0.1)  # this guest answers nothing, not even a cancel
    host_end, guest_end = socket.socketpair()
    reader = wire.FrameReader(guest_end.recv)
    good = archive(ROOT, ("ok", tarfile.REGTYPE, b"fine"))
    flood = b"\0" * wire.OUTPUT_CHUNK_SIZE

    def hostile() -> None:
        request_id = reader.read_frame().fields["id"]  # type: ignore[union-attr]
        try:
            guest_end.sendall(wire.encode_header({"id": request_id, "more": True, "fd": 1}, len(good)) + good)
            for _ in range(64):  # 16 MiB, never waiting for credit
                guest_end.sendall(wire.encode_header({"id": request_id, "more": True, "fd": 1}, len(flood)) + flood)
        except OSError:
            pass  # the host hung up

    thread = threading.Thread(target=hostile, daemon=True)
    thread.start()
    with AgentClient(host_end) as client, pytest.raises((UnsafeArchive, GuestProtocolError)):
        copy_module.copy_out(client, "/anything", str(tmp_path / "dest"))
    guest_end.close()
    thread.join(10)
