"""The newc writer: headers, alignment, entry kinds, and agreement with GNU cpio."""

from __future__ import annotations

import io
import os
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from pytest_forkd.image.cpio import CpioWriter, write_empty_archive


@dataclass
class Entry:
    name: str
    mode: int
    uid: int
    gid: int
    rdev: tuple[int, int]
    data: bytes


def parse_newc(archive: bytes) -> list[Entry]:
    """An independent reader: checks magic and 4-byte alignment of every header and data block."""
    entries = []
    offset = 0
    while True:
        assert offset % 4 == 0
        header = archive[offset : offset + 110]
        assert header[:6] == b"070701", header[:6]
        fields = [int(header[6 + 8 * index : 14 + 8 * index], 16) for index in range(13)]
        mode, uid, gid, filesize, rdevmajor, rdevminor, namesize = (
            fields[1],
            fields[2],
            fields[3],
            fields[6],
            fields[9],
            fields[10],
            fields[11],
        )
        name_start = offset + 110
        name = archive[name_start : name_start + namesize - 1].decode()
        assert archive[name_start + namesize - 1] == 0
        data_start = name_start + namesize + (-(110 + namesize) % 4)
        data = archive[data_start : data_start + filesize]
        offset = data_start + filesize + (-filesize % 4)
        if name == "TRAILER!!!":
            return entries
        entries.append(Entry(name, mode, uid, gid, (rdevmajor, rdevminor), data))


EXPECTED_NAMES = sorted(["bin", "bin/sh", "bin/tool", "usr", "usr/lib", "usr/lib/blob", "usr/lib/empty", "dev/console"])


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "bin").mkdir(parents=True)
    (root / "usr" / "lib").mkdir(parents=True)
    (root / "bin" / "tool").write_bytes(b"#!/bin/sh\necho hi\n")
    os.chmod(root / "bin" / "tool", 0o755)
    (root / "usr" / "lib" / "blob").write_bytes(bytes(range(256)) * 5 + b"odd")
    (root / "usr" / "lib" / "empty").write_bytes(b"")
    (root / "bin" / "sh").symlink_to("/bin/busybox")
    os.chmod(root / "usr" / "lib", 0o700)
    return root


def archive_of(root: Path) -> bytes:
    stream = io.BytesIO()
    with CpioWriter(stream) as writer:
        writer.add_tree(root)
        writer.add_device("dev/console", stat.S_IFCHR, 5, 1)
    return stream.getvalue()


def test_tree_round_trips_through_an_independent_reader(tree: Path) -> None:
    entries = {entry.name: entry for entry in parse_newc(archive_of(tree))}
    assert sorted(entries) == EXPECTED_NAMES
    order = list(entries)
    for name in order:  # the kernel needs each directory before what is in it
        parent = name.rpartition("/")[0]
        assert not parent or parent == "dev" or order.index(parent) < order.index(name)
    assert stat.S_ISDIR(entries["usr/lib"].mode) and stat.S_IMODE(entries["usr/lib"].mode) == 0o700
    assert stat.S_ISREG(entries["bin/tool"].mode) and stat.S_IMODE(entries["bin/tool"].mode) == 0o755
    assert entries["bin/tool"].data == b"#!/bin/sh\necho hi\n"
    assert entries["usr/lib/blob"].data == bytes(range(256)) * 5 + b"odd"
    assert entries["usr/lib/empty"].data == b""
    assert stat.S_ISLNK(entries["bin/sh"].mode) and entries["bin/sh"].data == b"/bin/busybox"
    assert stat.S_ISCHR(entries["dev/console"].mode) and entries["dev/console"].rdev == (5, 1)
    assert all(entry.uid == 0 and entry.gid == 0 for entry in entries.values())


@pytest.mark.skipif(shutil.which("cpio") is None, reason="GNU cpio is not installed")
def test_gnu_cpio_lists_the_same_entries(tree: Path, tmp_path: Path) -> None:
    listing = (
        subprocess.run(["cpio", "-t", "--quiet"], input=archive_of(tree), capture_output=True, check=True)
        .stdout.decode()
        .split()
    )
    assert sorted(listing) == EXPECTED_NAMES
    extracted = tmp_path / "out"
    extracted.mkdir()
    subprocess.run(
        ["cpio", "-i", "--quiet", "--make-directories", "--nonmatching", "dev/*"],
        input=archive_of(tree),
        cwd=extracted,
        check=True,
    )
    assert (extracted / "usr/lib/blob").read_bytes() == (tree / "usr/lib/blob").read_bytes()
    assert os.readlink(extracted / "bin/sh") == "/bin/busybox"


def test_counts_entries_and_bytes(tree: Path) -> None:
    stream = io.BytesIO()
    writer = CpioWriter(stream)
    writer.add_tree(tree)
    writer.close()
    assert writer.entries == 8  # seven tree entries and the trailer
    assert writer.bytes_written == len(stream.getvalue())


def test_refuses_special_files(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    os.mkfifo(root / "pipe")
    with pytest.raises(ValueError, match="only files, directories and symlinks"):
        CpioWriter(io.BytesIO()).add_tree(root)


def test_empty_archive_is_padded_and_valid(tmp_path: Path) -> None:
    path = tmp_path / "stub"
    write_empty_archive(path, 4096)
    data = path.read_bytes()
    assert len(data) == 4096
    assert parse_newc(data) == []
    assert data.rstrip(b"\0").endswith(b"TRAILER!!!")
