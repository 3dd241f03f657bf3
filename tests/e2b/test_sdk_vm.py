"""The official E2B SDK, unchanged, against forkd_e2b: every sandbox a real forked microVM.

One server for the module's tests (the plugin's session fixture): the
``base`` template is prepared once, and each test makes its own sandboxes,
which the fixture kills after it.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from typing import TYPE_CHECKING, Any

import pytest
from support import processes_mentioning, wait_until_dead

pytest.importorskip("e2b")
from e2b import AsyncSandbox, CommandExitException, Sandbox, SandboxNotFoundException, TimeoutException  # noqa: E402

if TYPE_CHECKING:
    from pytest_forkd.plugin.e2b import ForkdE2B

pytestmark = pytest.mark.vm


def test_commands_files_list_and_kill(forkd_e2b: ForkdE2B) -> None:
    sandbox = Sandbox.create(envs={"FROM_CREATE": "sandbox"})
    result = sandbox.commands.run("echo $GREETING $FROM_CREATE from $(pwd)", envs={"GREETING": "hi"})
    assert result.stdout == "hi sandbox from /home/user\n" and result.exit_code == 0
    assert sandbox.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    with pytest.raises(CommandExitException) as caught:
        sandbox.commands.run("echo out; echo err >&2; exit 3")
    assert (caught.value.exit_code, caught.value.stdout, caught.value.stderr) == (3, "out\n", "err\n")
    handle = sandbox.commands.run("sleep 1; echo done", background=True)
    assert handle.pid in [process.pid for process in sandbox.commands.list()]
    assert handle.wait().stdout == "done\n"

    data = os.urandom(5 << 20)
    sandbox.files.write("/tmp/blob.bin", data)
    assert bytes(sandbox.files.read("/tmp/blob.bin", format="bytes")) == data
    vm = forkd_e2b.vm(sandbox.sandbox_id)  # the sandbox is a forkd VM: check its guest directly too
    assert hashlib.sha256(vm.read_file("/tmp/blob.bin")).hexdigest() == hashlib.sha256(data).hexdigest()

    sandbox.files.write("notes/a.txt", "first")  # relative: the user's home, /home/user
    assert [(entry.name, entry.path) for entry in sandbox.files.list("notes")] == [("a.txt", "/home/user/notes/a.txt")]
    sandbox.files.rename("notes/a.txt", "notes/b.txt")
    assert not sandbox.files.exists("notes/a.txt") and sandbox.files.read("notes/b.txt") == "first"
    sandbox.files.remove("notes")
    assert not sandbox.files.exists("notes") and vm.exec("test -e /home/user/notes").exit_code == 1

    # Calls that name no user run as E2B's `user` (the SDK sends none to envd >= 0.4.0); root when asked.
    sandbox.files.write("mine/owned.txt", "x")  # a file of the user's own, in a directory made for it
    assert sandbox.files.get_info("mine/owned.txt").owner == sandbox.files.get_info("mine").owner == "user"
    assert vm.exec("stat -c %U:%G /home/user/mine/owned.txt").stdout == "user:user\n"
    sandbox.files.write("/tmp/by-root.txt", "r", user="root")
    assert sandbox.files.get_info("/tmp/by-root.txt").owner == "root"
    as_user = sandbox.commands.run("id -un; id -u; echo $HOME $USER $LOGNAME; pwd").stdout.split("\n")
    assert as_user[0] == "user" and as_user[1] != "0" and as_user[2:4] == ["/home/user user user", "/home/user"]
    as_root = sandbox.commands.run("id -un; id -u; echo $HOME $USER; pwd", user="root").stdout
    assert as_root == "root\n0\n/root root\n/home/user\n"  # commands start in the template's /home/user
    with pytest.raises(CommandExitException):  # the user is not root: /etc is not its to write
        sandbox.commands.run("touch /etc/not-yours")
    python = sandbox.commands.run("python3 -c 'import os, sys; print(os.getuid() != 0, sys.version_info >= (3, 8))'")
    assert python.stdout == "True True\n"  # the guest's Python runs for the user too

    assert sandbox.sandbox_id in [item.sandbox_id for item in Sandbox.list().next_items()]
    assert sandbox.sandbox_id in forkd_e2b.sandboxes
    qemu = vm.machine.pid
    sandbox.kill()
    assert vm.closed and wait_until_dead(qemu)
    assert sandbox.sandbox_id not in [item.sandbox_id for item in Sandbox.list().next_items()]
    with pytest.raises(SandboxNotFoundException):
        sandbox.get_info()
    with pytest.raises(TimeoutException):  # SandboxNotRunningException: "The sandbox ... was not found"
        sandbox.commands.run("true")


def test_fork_gives_copies_with_their_own_writes_while_the_source_runs_on(forkd_e2b: ForkdE2B) -> None:
    source = Sandbox.create()
    source.files.write("state", "source")
    server = source.commands.run("sleep 600", background=True, timeout=0)
    end = source.get_info().end_at
    children = source.fork(count=3)
    assert len({child.sandbox_id for child in children} | {source.sandbox_id}) == 4
    for number, child in enumerate(children):
        assert child.files.read("state") == "source"
        child.files.write("state", f"child {number}")
        assert server.pid in [process.pid for process in child.commands.list()]  # the running process too
    assert [child.files.read("state") for child in children] == ["child 0", "child 1", "child 2"]
    assert source.files.read("state") == "source"
    assert source.get_info().end_at == end and source.commands.run("echo alive").stdout == "alive\n"
    origins = {forkd_e2b.vm(child.sandbox_id).origin.path for child in children}  # type: ignore[union-attr]
    assert len(origins) == 1, "the source was branched once and its children forked from that branch"


def test_children_killed_as_soon_as_they_are_forked_leave_no_qemu(
    forkd_e2b: ForkdE2B, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fork() answers before its children are restored: a kill then waits for the restore and ends the VM."""
    source = Sandbox.create()
    factory = forkd_e2b.server.session.factory
    restored: list[Any] = []
    fork_snapshot = factory.fork_snapshot

    def recording(*args: Any, **kwargs: Any) -> Any:
        vms = fork_snapshot(*args, **kwargs)
        restored.extend(vms)
        return vms

    monkeypatch.setattr(factory, "fork_snapshot", recording)  # the children's restores (the pools restore apart)
    children = source.fork(count=2)
    assert [child.kill() for child in children] == [True, True]
    assert not {child.sandbox_id for child in children} & set(forkd_e2b.sandbox_ids())
    assert len(restored) == 2 and all(vm.closed for vm in restored)
    assert all(wait_until_dead(vm.machine.pid) for vm in restored), "a killed child's QEMU is left"
    assert source.commands.run("echo on").stdout == "on\n"


def test_pause_frees_the_vm_and_connect_brings_back_files_and_a_running_process(forkd_e2b: ForkdE2B) -> None:
    sandbox = Sandbox.create()
    sandbox.files.write("kept.txt", "across the pause")
    ticker = sandbox.commands.run(
        "i=0; while true; do echo tick $i; i=$((i+1)); sleep 0.5; done", background=True, timeout=0
    )
    vm = forkd_e2b.vm(sandbox.sandbox_id)
    qemu, prefix = vm.machine.pid, f"{vm.machine.directory}/{vm.name}."
    assert sandbox.pause() is True
    assert vm.closed and wait_until_dead(qemu), "a paused sandbox keeps no QEMU process"
    assert processes_mentioning(prefix) == [], "nothing uses its files (console, sockets, memory)"
    assert list(vm.machine.directory.glob(f"{vm.name}.*")) == [], "and they are gone"
    assert sandbox.get_info().state.value == "paused"
    assert [item.state.value for item in Sandbox.list().next_items() if item.sandbox_id == sandbox.sandbox_id] == [
        "paused"
    ]

    resumed = Sandbox.connect(sandbox.sandbox_id)
    assert resumed.sandbox_id == sandbox.sandbox_id and resumed.get_info().state.value == "running"
    assert resumed.files.read("kept.txt") == "across the pause"
    assert ticker.pid in [process.pid for process in resumed.commands.list()]
    ticks = []
    for stdout, _, _ in resumed.commands.connect(ticker.pid):
        ticks += [int(line.split()[1]) for line in (stdout or "").splitlines() if line.startswith("tick")]
        if len(ticks) >= 3:
            break
    assert ticks == sorted(ticks) and ticks[-1] > ticks[0], "the process goes on counting after the resume"
    assert resumed.commands.kill(ticker.pid) is True


def test_the_async_sdk_runs_four_sandboxes_at_once(forkd_e2b: ForkdE2B) -> None:
    async def run() -> list[str]:
        sandboxes = await asyncio.gather(*(AsyncSandbox.create() for _ in range(4)))
        results = await asyncio.gather(
            *(sandbox.commands.run(f"echo {number}") for number, sandbox in enumerate(sandboxes))
        )
        await asyncio.gather(*(sandbox.kill() for sandbox in sandboxes))
        return [result.stdout for result in results]

    started = time.monotonic()
    outputs = asyncio.run(run())
    assert outputs == ["0\n", "1\n", "2\n", "3\n"]
    assert time.monotonic() - started < 600
    assert forkd_e2b.sandboxes == {}


def test_a_snapshot_is_a_template(forkd_e2b: ForkdE2B) -> None:
    source = Sandbox.create()
    source.files.write("/srv/prepared", "ready")
    snapshot = source.create_snapshot()
    copy = Sandbox.create(snapshot.snapshot_id)
    assert copy.files.read("/srv/prepared") == "ready"
    copy.files.write("/srv/prepared", "changed in the copy")
    assert source.files.read("/srv/prepared") == "ready"
    written = [entry for entry in forkd_e2b.vm(copy.sandbox_id).transcript.entries if entry["kind"] == "write_file"]
    assert [entry["path"] for entry in written] == ["/srv/prepared"]  # the VM's transcript shows the SDK's calls


def test_the_code_interpreter_keeps_state_and_names_errors(forkd_e2b: ForkdE2B) -> None:
    pytest.importorskip("pytest_forkd.e2b.interpreter")
    code_interpreter = pytest.importorskip("e2b_code_interpreter")
    sandbox = code_interpreter.Sandbox.create()  # template code-interpreter-v1: forkd's image with numpy and Pillow
    assert sandbox.run_code("x = 41").error is None
    assert sandbox.run_code("x + 1").text == "42"
    failed = sandbox.run_code("1 / 0")
    assert failed.error is not None and failed.error.name == "ZeroDivisionError"
    printed = sandbox.run_code("print('hello from', x)")
    assert printed.logs.stdout == ["hello from 41\n"]
    # as E2B's Jupyter server runs its kernels: as root (its template's start command is sudo), in /home/user
    assert sandbox.run_code("import os; os.getuid(), os.getcwd()").text == "(0, '/home/user')"
    assert sandbox.get_info().template_id == "code-interpreter-v1"
    # what E2B's template offers a first cell (smolagents' E2BExecutor imports both), in a 512 MiB guest
    stack = sandbox.run_code(
        "import numpy, PIL.Image; int(numpy.linalg.det(numpy.eye(3))), PIL.Image.new('L', (2, 2)).size"
    )
    assert (stack.error, stack.text) == (None, "(1, (2, 2))")
    assert forkd_e2b.vm(sandbox.sandbox_id).memory_mib == 512
