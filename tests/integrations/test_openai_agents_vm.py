"""The OpenAI Agents SDK's sandbox client on real VMs: sessions, workspaces, resume, forks, and a real agent run.

The SDK is driven through its public API only, offline: a scripted model
(:mod:`agents_sdk_model`) answers with tool calls, tracing is off, no API key
is set. One client (one ForkdSession on ``base``, pooled) serves the module,
so each session costs a fork, not a boot. The SDK's own
``UnixLocalSandboxClient`` is the control where the answer on the host
would differ from the answer in a VM.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

pytest.importorskip("agents", reason='needs the OpenAI Agents SDK: pip install "pytest-forkd[openai-agents]"')

from agents import Runner, set_tracing_disabled  # noqa: E402
from agents.run import RunConfig  # noqa: E402
from agents.sandbox import SandboxAgent, SandboxRunConfig  # noqa: E402
from agents.sandbox.capabilities import Shell  # noqa: E402
from agents.sandbox.errors import ExecTimeoutError, WorkspaceReadNotFoundError  # noqa: E402
from agents.sandbox.sandboxes.unix_local import UnixLocalSandboxClient  # noqa: E402
from agents.sandbox.snapshot import LocalSnapshotSpec  # noqa: E402
from agents_sdk_model import ScriptedModel  # noqa: E402
from support import assert_nothing_left, is_running, wait_until_dead  # noqa: E402

from pytest_forkd.errors import GuestCrashed  # noqa: E402
from pytest_forkd.integrations.openai_agents import (  # noqa: E402
    ForkdSandbox,
    ForkdSandboxClient,
    ForkdSandboxClientOptions,
)
from pytest_forkd.integrations.sessions import SESSIONS  # noqa: E402

pytestmark = pytest.mark.vm

set_tracing_disabled(True)


@pytest.fixture(scope="module")
def client() -> Iterator[ForkdSandboxClient]:
    """One client for the module: its ForkdSession restores ``base`` once and keeps a child pooled."""
    client = ForkdSandboxClient()
    yield client
    pids = [vm.machine.pid for vm in client.vms]
    client.close()
    assert client.vms == []
    assert [pid for pid in pids if not wait_until_dead(pid)] == []


@pytest_asyncio.fixture
async def session(client: ForkdSandboxClient) -> AsyncIterator[ForkdSandbox]:
    """A started session (manifest applied), deleted after the test."""
    made = await client.create(options=ForkdSandboxClientOptions())
    assert isinstance(made, ForkdSandbox)
    await made.start()
    yield made
    await client.delete(made)


async def started(client: ForkdSandboxClient, **create: object) -> ForkdSandbox:
    made = await client.create(options=ForkdSandboxClientOptions(), **create)  # type: ignore[arg-type]
    assert isinstance(made, ForkdSandbox)
    await made.start()
    return made


def text(result: object) -> str:
    return result.stdout.decode()  # type: ignore[attr-defined,no-any-return]


@pytest.mark.asyncio
async def test_sessions_are_isolated_vms_with_the_guest_kernel(client: ForkdSandboxClient) -> None:
    first, second = await started(client), await started(client)
    local = UnixLocalSandboxClient()
    control = await local.create(options=None)
    try:
        await control.start()
        host_kernel = text(await control.exec("uname -r")).strip()
        assert host_kernel == os.uname().release  # the control runs on the host

        first_kernel = text(await first.exec("uname -r")).strip()
        assert first_kernel and first_kernel != host_kernel
        assert text(await second.exec("uname -r")).strip() == first_kernel
        assert text(await first.exec("pwd")).strip() == "/workspace"  # the manifest root is the cwd

        wrote = await first.exec("echo only-in-first > mine.txt && cat /workspace/mine.txt")
        assert (wrote.exit_code, text(wrote)) == (0, "only-in-first\n")
        assert first.vm.read_file("/workspace/mine.txt") == b"only-in-first\n"
        missing = await second.exec("cat mine.txt")
        assert missing.exit_code != 0 and b"mine.txt" in missing.stderr
        assert first.vm.name != second.vm.name and first.vm.machine.pid != second.vm.machine.pid
    finally:
        await local.delete(control)
        await client.delete(first)
        await client.delete(second)


@pytest.mark.asyncio
async def test_clients_share_one_forkd_session_per_configuration() -> None:
    options = ForkdSandboxClientOptions(pool=0)  # a configuration of its own: no other test uses it
    key = ("forkd", None, "base", 0)
    first_client, second_client = ForkdSandboxClient(), ForkdSandboxClient()
    try:
        first = await first_client.create(options=options)
        second = await second_client.create(options=options)
        assert isinstance(first, ForkdSandbox) and isinstance(second, ForkdSandbox)
        assert first.vm.factory is second.vm.factory and SESSIONS.users(key) == 2
        first_client.close()
        assert first.vm.closed and SESSIONS.users(key) == 1
        assert (await second.exec("true")).exit_code == 0  # the session lives on for its other client
    finally:
        first_client.close()
        second_client.close()
    assert second.vm.closed and SESSIONS.users(key) == 0


@pytest.mark.asyncio
async def test_read_write_and_errors(session: ForkdSandbox) -> None:
    payload = bytes(range(256)) * 3
    await session.write(Path("deep/dir/blob.bin"), io.BytesIO(payload))
    assert session.vm.read_file("/workspace/deep/dir/blob.bin") == payload
    assert (await session.read(Path("deep/dir/blob.bin"))).read() == payload
    with pytest.raises(WorkspaceReadNotFoundError):
        await session.read(Path("no/such/file"))
    with pytest.raises(ExecTimeoutError):
        await session.exec("sleep 30", timeout=1)
    assert (await session.exec("echo still-usable")).exit_code == 0


@pytest.mark.asyncio
async def test_persist_workspace_of_one_hydrates_a_third(client: ForkdSandboxClient) -> None:
    first, second, third = await asyncio.gather(*(started(client) for _ in range(3)))  # concurrently
    local = UnixLocalSandboxClient()
    control = await local.create(options=None)
    try:
        await first.exec("mkdir -p src && printf 'print(1)\\n' > src/app.py && ln -s src/app.py link && echo x > top")
        archive = await first.persist_workspace()
        await third.hydrate_workspace(archive)
        listing = await third.exec("find . | sort && cat src/app.py && readlink link")
        assert text(listing) == ".\n./link\n./src\n./src/app.py\n./top\nprint(1)\nsrc/app.py\n"
        assert (await second.exec("test -e top")).exit_code == 1  # the second saw none of it

        # The archive is the SDK's portable format: the host backend reads it, and forkd reads the host's.
        await control.start()
        await control.hydrate_workspace(await first.persist_workspace())
        assert (await control.read(Path("src/app.py"))).read() == b"print(1)\n"
        await control.exec("echo from-host > host.txt")
        await second.hydrate_workspace(await control.persist_workspace())
        assert second.vm.read_file("/workspace/host.txt") == b"from-host\n"
    finally:
        await local.delete(control)
        for made in (first, second, third):
            await client.delete(made)


@pytest.mark.asyncio
async def test_delete_and_close_leave_no_vm(client: ForkdSandboxClient) -> None:
    deleted, closed = await started(client), await started(client)
    pids = [deleted.vm.machine.pid, closed.vm.machine.pid]
    assert all(is_running(pid) for pid in pids)

    await client.delete(deleted)
    assert not await deleted.running()
    async with closed:  # leaving it runs the SDK's aclose(): stop, then shutdown, which kills the VM
        assert await closed.running()
    assert not await closed.running()
    assert [pid for pid in pids if not wait_until_dead(pid)] == []
    assert {deleted.vm.name, closed.vm.name}.isdisjoint(vm.name for vm in client.vms)
    await client.delete(closed)  # idempotent


def write_then_answer(outputs: list[str]) -> dict[str, str] | str:
    """The scripted agent: write a file with the shell tool, then report what the tool said."""
    if not outputs:
        return {"cmd": "echo written-by-agent > result.txt && uname -r"}
    return f"done: {outputs[-1]}"


@pytest.mark.asyncio
async def test_sandbox_agent_writes_a_file_through_its_shell_tool(session: ForkdSandbox) -> None:
    model = ScriptedModel(write_then_answer)
    agent = SandboxAgent(name="writer", instructions="Write result.txt.", model=model)
    result = await Runner.run(agent, "go", run_config=RunConfig(sandbox=SandboxRunConfig(session=session)))

    assert "exec_command" in model.offered[0]
    assert session.vm.read_file("/workspace/result.txt") == b"written-by-agent\n"
    kernel = session.vm.exec("uname -r").stdout.strip()
    assert kernel in str(result.final_output) and "exited with code 0" in str(result.final_output)


@pytest.mark.asyncio
async def test_runner_owned_session_is_deleted_after_the_run(client: ForkdSandboxClient) -> None:
    during: list[int] = []
    before = {vm.name for vm in client.vms}

    def step(outputs: list[str]) -> dict[str, str] | str:
        during.extend(vm.machine.pid for vm in client.vms if vm.name not in before)
        return {"cmd": "touch made.txt"} if not outputs else "ok"

    agent = SandboxAgent(name="owned", instructions="x", model=ScriptedModel(step), capabilities=[Shell()])
    config = RunConfig(sandbox=SandboxRunConfig(client=client, options=ForkdSandboxClientOptions()))
    assert (await Runner.run(agent, "go", run_config=config)).final_output == "ok"
    assert during, "the run's session had no VM of this client"
    assert [pid for pid in set(during) if not wait_until_dead(pid)] == []
    assert {vm.name for vm in client.vms} <= before


@pytest.mark.asyncio
async def test_serialized_state_resumes_the_live_vm(client: ForkdSandboxClient, session: ForkdSandbox) -> None:
    await session.exec("echo kept > state.txt")
    payload = json.loads(json.dumps(client.serialize_session_state(session.state)))
    assert payload["type"] == "forkd" and payload["vm_name"] == session.vm.name

    state = client.deserialize_session_state(payload)
    assert state.model_dump() == session.state.model_dump()
    resumed = await client.resume(state)
    assert isinstance(resumed, ForkdSandbox) and resumed.vm is session.vm
    await resumed.start()
    assert text(await resumed.exec("cat state.txt")) == "kept\n"


@pytest.mark.asyncio
async def test_resume_without_the_vm_restores_the_persisted_workspace(
    client: ForkdSandboxClient, tmp_path: Path
) -> None:
    first = await started(client, snapshot=LocalSnapshotSpec(base_path=tmp_path))
    await first.exec("mkdir -p notes && echo persisted > notes/a.txt")
    old_pid = first.vm.machine.pid
    await first.aclose()  # persists the workspace to tmp_path, then kills the VM
    assert wait_until_dead(old_pid)
    payload = client.serialize_session_state(first.state)

    other = ForkdSandboxClient()  # another client (as another process would be) has no live VM for it
    try:
        resumed = await other.resume(other.deserialize_session_state(payload))
        assert isinstance(resumed, ForkdSandbox) and resumed.vm.name != payload["vm_name"]
        async with resumed:
            assert text(await resumed.exec("cat notes/a.txt")) == "persisted\n"
    finally:
        other.close()


@pytest.mark.asyncio
async def test_fork_a_session_mid_run(session: ForkdSandbox, client: ForkdSandboxClient) -> None:
    """One agent state, two continuations: each fork carries the run so far and diverges on its own."""

    def first_turn(outputs: list[str]) -> dict[str, str] | str:
        return (
            {"cmd": "echo step-1 > log.txt; sleep 600 >/dev/null 2>&1 & echo $! > sleeper.pid"}
            if not outputs
            else "paused"
        )

    agent = SandboxAgent(name="a", instructions="x", model=ScriptedModel(first_turn), capabilities=[Shell()])
    run_config = RunConfig(sandbox=SandboxRunConfig(session=session))
    history = await Runner.run(agent, "start", run_config=run_config)

    forks = await session.fork(2)
    try:
        for index, fork in enumerate(forks):
            assert await fork.running() and fork.vm.name != session.vm.name

            def continue_turn(outputs: list[str], index: int = index) -> dict[str, str] | str:
                return {"cmd": f"echo branch-{index} >> log.txt"} if len(outputs) == 1 else "resumed"

            agent = agent.clone(model=ScriptedModel(continue_turn))
            fork_config = RunConfig(sandbox=SandboxRunConfig(session=fork))
            await Runner.run(
                agent, history.to_input_list() + [{"role": "user", "content": "go on"}], run_config=fork_config
            )
        assert [text(await fork.exec("cat log.txt")) for fork in forks] == ["step-1\nbranch-0\n", "step-1\nbranch-1\n"]
        assert text(await session.exec("cat log.txt")) == "step-1\n"
        # The guest's processes were copied too: the background sleeper runs in every fork.
        for fork in forks:
            assert (await fork.exec("kill -0 $(cat sleeper.pid)")).exit_code == 0
    finally:
        for fork in forks:
            await client.delete(fork)


@pytest.mark.asyncio
async def test_checkpoint_rolls_the_sandbox_back(session: ForkdSandbox) -> None:
    await session.exec("echo before > f.txt")
    checkpoint = await session.checkpoint()
    await session.exec("echo after > f.txt && touch extra")
    await checkpoint.rollback()
    assert text(await session.exec("cat f.txt; ls")) == "before\nf.txt\n"


@pytest.mark.asyncio
async def test_pty_commands_keep_running_and_take_input(session: ForkdSandbox) -> None:
    started_update = await session.pty_exec_start("echo start; sleep 1; echo end", yield_time_s=0.3)
    assert started_update.exit_code is None and started_update.process_id is not None
    assert started_update.output == b"start\n"
    finished = await session.pty_write_stdin(session_id=started_update.process_id, chars="", yield_time_s=5)
    assert (finished.exit_code, finished.process_id, finished.output) == (0, None, b"end\n")

    prompt = await session.pty_exec_start("read x; echo got $x; tty", tty=True, yield_time_s=0.5)
    assert prompt.process_id is not None
    answered = await session.pty_write_stdin(session_id=prompt.process_id, chars="foo\n", yield_time_s=2)
    assert answered.exit_code == 0 and b"got foo\r\n/dev/pts/" in answered.output


@pytest.mark.asyncio
async def test_a_dead_vm_raises_guest_crashed_with_its_console(session: ForkdSandbox) -> None:
    await session.exec("echo last-words-of-the-guest > /dev/console")
    os.kill(session.vm.machine.pid, signal.SIGKILL)
    with pytest.raises(GuestCrashed) as caught:
        await session.exec("true")
    assert "QEMU exited" in str(caught.value)
    assert "last-words-of-the-guest" in caught.value.console_tail
    assert not await session.running()


CTRL_C_PROGRAM = """
import asyncio, sys
from pytest_forkd.integrations.openai_agents import ForkdSandboxClient

async def main():
    client = ForkdSandboxClient()  # never closed by the program: the exit handler must do it
    session = await client.create()
    await session.start()
    print(session.vm.machine.pid, flush=True)
    await session.exec("sleep 600")

asyncio.run(main())
"""


def test_ctrl_c_leaves_nothing() -> None:
    """A program interrupted mid-command leaves no QEMU process and no run directory behind."""
    shm_dir = Path(f"/dev/shm/forkd-agents-test-{os.getpid()}")
    env = {**os.environ, "FORKD_SHM_DIR": str(shm_dir)}
    program = subprocess.Popen(
        [sys.executable, "-c", CTRL_C_PROGRAM], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert program.stdout is not None
        pid = int(program.stdout.readline())
        assert is_running(pid)
        program.send_signal(signal.SIGINT)
        _, stderr = program.communicate(timeout=120)
        assert "KeyboardInterrupt" in stderr
        assert wait_until_dead(pid)
        assert_nothing_left(shm_dir)
    finally:
        if program.poll() is None:
            program.kill()
            program.wait()
        shutil.rmtree(shm_dir, ignore_errors=True)
