"""VM.copy_in / VM.copy_out against a real guest: whole trees both ways, excludes, bad input, a hostile guest."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import wait_for_agent
from trees import differences, listing, make_tree

from pytest_forkd.core import copy as copy_module
from pytest_forkd.core.factory import VMFactory
from pytest_forkd.core.vm import VM
from pytest_forkd.errors import CopyError, InvalidArgument, UnsafeArchive
from pytest_forkd.storage.snapshot import Snapshot


@pytest.fixture(scope="module")
def roomy_snapshot(factory: VMFactory) -> Snapshot:
    """A 512 MiB guest, frozen once: a 256 MiB guest's root filesystem has no room for a 50 MiB tree."""
    root = factory.boot(memory_mib=512)
    return root.freeze("itest-copy-512", keep_running=False)


@pytest.fixture
def roomy_vm(roomy_snapshot: Snapshot) -> Iterator[VM]:
    child = roomy_snapshot.fork(1)[0]
    yield child
    child.close()


def guest(vm: VM, command: str) -> str:
    return vm.exec(command, check=True).stdout.strip()


def test_a_tree_of_1000_files_and_50_mib_with_links_and_modes_goes_in_and_out_identical(
    roomy_vm: VM, tmp_path: Path
) -> None:
    vm = roomy_vm
    source = tmp_path / "source"
    counts = make_tree(source, files=1000, total_bytes=50 << 20)
    expected = listing(source)
    assert sum(entry.size for entry in expected.values() if entry.kind == "file") >= 50 << 20

    copied_in = vm.copy_in(source, "/srv/tree")
    copied_out = vm.copy_out("/srv/tree", tmp_path / "back")

    assert differences(expected, listing(tmp_path / "back")) == []
    assert copied_in.files == copied_out.files == len(expected)
    assert copied_in.bytes == copied_out.bytes >= 50 << 20
    assert counts["links"] >= 3
    # In the guest itself: modes, links and times as on the host.
    assert guest(vm, "stat -c %a /srv/tree/d00 /srv/tree/d01").split() == ["700", "555"]
    assert guest(vm, "readlink /srv/tree/absolute-link") == "/etc/hostname"
    assert guest(vm, "readlink /srv/tree/dangling-link") == "does/not/exist"
    assert guest(vm, "stat -c %Y /srv/tree") == str(expected["."].mtime_ns // 10**9)
    copies = [entry for entry in vm.transcript.entries if entry["kind"].startswith("copy_")]
    assert [(entry["kind"], entry["path"], entry["bytes"]) for entry in copies] == [
        ("copy_in", "/srv/tree", copied_in.bytes),
        ("copy_out", "/srv/tree", copied_out.bytes),
    ]


def test_the_destination_names_the_copy_itself(vm: VM, tmp_path: Path) -> None:
    (tmp_path / "tool.sh").write_text("#!/bin/sh\necho tool ran\n")
    os.chmod(tmp_path / "tool.sh", 0o755)
    project = tmp_path / "project"
    (project / "pkg").mkdir(parents=True)
    (project / "pkg" / "mod.py").write_text("X = 1\n")

    vm.copy_in(tmp_path / "tool.sh", "/opt/new/bin/tool")  # a file lands at exactly that path, parents made
    assert guest(vm, "/opt/new/bin/tool") == "tool ran"
    vm.exec("mkdir -p /srv/app && echo kept > /srv/app/existing", check=True)
    vm.copy_in(str(project), "/srv/app")  # a directory's contents merge into the directory
    assert guest(vm, "cat /srv/app/existing /srv/app/pkg/mod.py") == "kept\nX = 1"

    vm.copy_out("/srv/app/pkg/mod.py", tmp_path / "out" / "mod.py")
    assert (tmp_path / "out" / "mod.py").read_text() == "X = 1\n"
    vm.copy_out("/init", tmp_path / "init")
    assert (tmp_path / "init").read_bytes() == vm.read_file("/init")
    assert os.access(tmp_path / "init", os.X_OK)


def test_excludes_leave_out_names_at_any_depth_and_relative_paths(vm: VM, tmp_path: Path) -> None:
    source = tmp_path / "src"
    for relative in ("a.py", "a.pyc", "pkg/b.py", "pkg/__pycache__/b.pyc", "build/out.o", "docs/build/x", ".git/HEAD"):
        (source / relative).parent.mkdir(parents=True, exist_ok=True)
        (source / relative).write_text(relative)

    vm.copy_in(source, "/srv/ex", exclude=["*.pyc", "__pycache__", ".git", "build/*"])
    found = set(guest(vm, "cd /srv/ex && find . -type f | sort").split())
    assert found == {"./a.py", "./pkg/b.py", "./docs/build/x"}

    vm.copy_out("/srv/ex", tmp_path / "back", exclude=["docs"])
    back = tmp_path / "back"
    assert sorted(str(p.relative_to(back)) for p in back.rglob("*") if p.is_file()) == ["a.py", "pkg/b.py"]
    assert (back / "build").is_dir()  # "build/*" left out what is in it, not the directory


def assert_usable(vm: VM) -> None:
    assert vm.exec("echo still here").stdout == "still here\n"


def test_copying_paths_that_do_not_exist_names_them_and_the_vm_stays_usable(vm: VM, tmp_path: Path) -> None:
    with pytest.raises(CopyError, match="no-such-dir") as caught:
        vm.copy_in(tmp_path / "no-such-dir", "/srv/x")
    assert caught.value.errno == errno.ENOENT and "on the host" in str(caught.value)
    with pytest.raises(CopyError, match="/srv/missing") as caught:
        vm.copy_out("/srv/missing", tmp_path / "out")
    assert caught.value.errno == errno.ENOENT and caught.value.path == "/srv/missing"
    assert not (tmp_path / "out").exists()
    assert_usable(vm)


def test_a_file_where_a_directory_is_expected_is_a_copy_error(vm: VM, tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "f").write_text("f")

    with pytest.raises(CopyError, match="/root/marker") as caught:  # a file of the base snapshot
        vm.copy_in(tree, "/root/marker")
    assert caught.value.errno == errno.ENOTDIR
    with pytest.raises(CopyError, match="/root/marker/below") as caught:
        vm.copy_in(tree, "/root/marker/below")
    assert caught.value.errno == errno.ENOTDIR
    with pytest.raises(CopyError, match="/root") as caught:  # a file onto a directory
        vm.copy_in(tree / "sub" / "f", "/root")
    assert caught.value.errno == errno.EISDIR
    (tmp_path / "plain").write_text("a file on the host")
    with pytest.raises(CopyError, match="plain") as caught:
        vm.copy_out("/etc", tmp_path / "plain")
    assert caught.value.errno == errno.ENOTDIR
    assert vm.read_file("/root/marker") == b"from-base\n"
    assert_usable(vm)


def test_no_space_left_in_the_guest_is_a_copy_error_naming_the_path(vm: VM, tmp_path: Path) -> None:
    vm.exec("mkdir -p /mnt/small && mount -t tmpfs -o size=256k tmpfs /mnt/small", check=True)
    big = tmp_path / "big"
    big.mkdir()
    (big / "data.bin").write_bytes(os.urandom(1 << 20))

    with pytest.raises(CopyError, match="/mnt/small/tree") as caught:
        vm.copy_in(big, "/mnt/small/tree")
    assert caught.value.errno == errno.ENOSPC
    assert "no space left" in str(caught.value)
    assert_usable(vm)
    vm.copy_in(tmp_path / "big", "/srv/big")  # elsewhere there is room
    assert guest(vm, "stat -c %s /srv/big/data.bin") == str(1 << 20)


def test_bad_arguments_are_refused_before_anything_is_sent(vm: VM, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="relative"):
        vm.copy_in(tmp_path, "srv/relative")
    with pytest.raises(InvalidArgument, match="exclude"):
        vm.copy_out("/etc", tmp_path / "x", exclude=[3])  # type: ignore[list-item]
    with pytest.raises(InvalidArgument, match="local_path"):
        vm.copy_out("/etc", None)  # type: ignore[arg-type]
    assert_usable(vm)


# -- a hostile guest ---------------------------------------------------------------------------------

HOSTILE_TAR_AGENT = r"""
import io, os, signal, sys, tarfile, time
sys.path.insert(0, "/opt/forkd")
import wire

agent_pid, seconds = int(sys.argv[1]), float(sys.argv[2])
port = None
for name in os.listdir("/sys/class/virtio-ports"):
    with open(f"/sys/class/virtio-ports/{name}/name") as names:
        if names.read().strip() == "agent":
            port = f"/dev/{name}"
time.sleep(0.5)
os.kill(agent_pid, signal.SIGKILL)
deadline = time.monotonic() + 20
while True:
    try:
        fd = os.open(port, os.O_RDWR)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.001)
reader = wire.FrameReader(lambda n: os.read(fd, n))

def write(data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]

def frame(fields, payload=b""):
    write(wire.encode_header(fields, len(payload)) + payload)

def archive(members):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, data in members:
            info = tarfile.TarInfo(name)
            info.type = kind
            if kind == tarfile.SYMTYPE or kind == tarfile.LNKTYPE:
                info.linkname = data
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()

root = (".", tarfile.DIRTYPE, b"")
ARCHIVES = {
    "/evil/dotdot": archive([root, ("ok.txt", tarfile.REGTYPE, b"fine"), ("../../escape.txt", tarfile.REGTYPE, b"x")]),
    "/evil/absolute": archive([root, ("/tmp/forkd-absolute-escape", tarfile.REGTYPE, b"x")]),
    "/evil/through-link": archive([root, ("out", tarfile.SYMTYPE, sys.argv[3]),
                                   ("out/pwned", tarfile.REGTYPE, b"x")]),
    "/evil/hardlink": archive([root, ("hard", tarfile.LNKTYPE, "/etc/passwd")]),
    "/evil/device": archive([root, ("dev", tarfile.CHRTYPE, b"")]),
}
ARCHIVES["/evil/stall"] = archive([root, ("big.bin", tarfile.REGTYPE, b"x" * 100000)])[:20000]

def pong(request, **extra):
    frame({"id": request["id"], "pid": os.getpid(), "monotonic": time.monotonic(),
           "wall_time": time.time(), "protocol": wire.PROTOCOL_VERSION, **extra})

until = time.monotonic() + seconds
while time.monotonic() < until:
    try:
        request = reader.read_frame()
    except wire.MalformedFrame:
        continue
    if request is None or request.fields.get("op") in (None, "credit"):
        continue
    fields = request.fields
    if fields["op"] == "ping":
        pong(fields, hostile=True)
    elif fields["op"] == "cancel":
        frame({"id": fields["id"], "found": True, "finished": True})
    elif fields["op"] == "copy_out":
        data = ARCHIVES[fields["path"]]
        frame({"id": fields["id"], "more": True, "fd": 1}, data)
        if fields["path"] != "/evil/stall":
            frame({"id": fields["id"], "files": 3, "bytes": 5, "skipped": 0})
    else:
        frame({"id": fields["id"], "error": {"type": "BadRequest", "message": "hostile"}})
os.close(fd)
"""


def take_over(vm: VM, seconds: float, outside: Path) -> int:
    """Replace the VM's agent with one that answers copy_out with crafted archives; returns its pid."""
    vm.write_file("/tmp/hostile_tar.py", HOSTILE_TAR_AGENT)
    agent_pid = vm.ping()["pid"]
    vm.exec(f"setsid python3 /tmp/hostile_tar.py {agent_pid} {seconds} {outside} >/tmp/hostile.log 2>&1 &")
    reply = wait_for_agent(vm, lambda reply: bool(reply.get("hostile")), "the hostile agent to take over", timeout=60)
    return int(reply["pid"])


def test_a_hostile_archive_from_the_guest_is_refused_and_nothing_lands_outside(
    vm: VM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(copy_module, "STALL_TIMEOUT", 3.0)
    outside = tmp_path / "outside"
    outside.mkdir()
    hostile_pid = take_over(vm, 25, outside)

    for case, member in (
        ("dotdot", "../../escape.txt"),
        ("absolute", "/tmp/forkd-absolute-escape"),
        ("through-link", "out/pwned"),
        ("hardlink", "hard"),
        ("device", "dev"),
    ):
        destination = tmp_path / "dest" / case
        with pytest.raises(UnsafeArchive) as caught:
            vm.copy_out(f"/evil/{case}", destination)
        assert caught.value.path == member, caught.value
    with pytest.raises(CopyError, match="stopped sending"):
        vm.copy_out("/evil/stall", tmp_path / "dest" / "stall")

    assert not (tmp_path / "escape.txt").exists() and not (tmp_path / "dest" / "escape.txt").exists()
    assert not Path("/tmp/forkd-absolute-escape").exists()
    assert list(outside.iterdir()) == []
    assert (tmp_path / "dest" / "dotdot" / "ok.txt").read_bytes() == b"fine"  # what came before was fine
    # The hostile agent leaves, init starts the real one, which serves the same VM.
    wait_for_agent(vm, lambda reply: reply["pid"] != hostile_pid, "the real agent to come back")
    assert_usable(vm)
    assert vm.broken is None


def test_async_vm_copies_and_a_cancelled_copy_leaves_the_vm_usable(vm: VM, tmp_path: Path) -> None:
    import asyncio

    from pytest_forkd import AsyncVM

    source = tmp_path / "src"
    make_tree(source, files=20, total_bytes=6 << 20)
    big = tmp_path / "big"
    big.mkdir()
    for index in range(4):
        (big / f"part{index}").write_bytes(os.urandom(10 << 20))

    async def main() -> None:
        avm = AsyncVM(vm)
        copied = await avm.copy_in(source, "/tmp/async-tree")
        await avm.copy_out("/tmp/async-tree", tmp_path / "back", exclude=["link*"])
        assert copied.bytes >= 6 << 20
        task = asyncio.ensure_future(avm.copy_in(big, "/tmp/cancelled-tree"))  # seconds, even under KVM
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (await avm.exec("echo after")).stdout == "after\n"

    asyncio.run(main())
    expected = {path: entry for path, entry in listing(source).items() if not path.split("/")[-1].startswith("link")}
    assert differences(expected, listing(tmp_path / "back")) == []
    assert vm.broken is None
