"""The OpenAI Agents SDK session of one forkd VM: the SDK's shell, file and workspace calls, answered by the guest.

:class:`ForkdSandboxSession` is the backend session (the SDK's
``BaseSandboxSession``) that :class:`~pytest_forkd.integrations.openai_agents.ForkdSandboxClient`
wraps for the SDK. Each holds one copy-on-write child VM and runs:

- ``exec``: the argv the SDK prepared (``sh -lc '<command>'`` for shell
  commands) through the guest agent, with the manifest root as working
  directory and the manifest's environment; a timeout kills the command in
  the guest and raises the SDK's ``ExecTimeoutError``. A guest that died
  raises forkd's :class:`~pytest_forkd.errors.GuestCrashed` with its console
  tail: the SDK has no error for a sandbox that crashed, and the tail is
  what explains it.
- ``read``/``write``: files through the agent (binary-safe, parents made).
- ``persist_workspace``/``hydrate_workspace``: the manifest root as a tar
  stream with workspace-relative members, moved with ``VM.copy_out``/
  ``VM.copy_in`` (which check what they unpack) and packed or unpacked on
  the host with the SDK's own tar checks.
- PTY: ``pty_exec_start``/``pty_write_stdin`` run the command as a spawned
  guest process (on a guest terminal when the SDK asks for ``tty``), so the
  SDK's ``exec_command`` tool can leave a long command running and its
  ``write_stdin`` tool can talk to it.

forkd's own powers stay reachable: :attr:`ForkdSandboxSession.vm` is the VM,
:meth:`ForkdSandboxSession.checkpoint` a checkpoint to roll back to or fork
from.

Every VM call blocks, so each runs in a thread of its own
(:mod:`pytest_forkd.aio`); the event loop never waits on the guest.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import io
import signal
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar

from agents.sandbox.errors import (
    ExecTimeoutError,
    WorkspaceArchiveReadError,
    WorkspaceArchiveWriteError,
    WorkspaceReadNotFoundError,
    WorkspaceStartError,
)
from agents.sandbox.session.base_sandbox_session import BaseSandboxSession
from agents.sandbox.session.pty_types import (
    PTY_PROCESSES_MAX,
    PtyExecUpdate,
    allocate_pty_process_id,
    clamp_pty_yield_time_ms,
    process_id_to_prune_from_meta,
    resolve_pty_write_yield_time_ms,
    truncate_text_by_tokens,
)
from agents.sandbox.session.sandbox_session_state import SandboxSessionState
from agents.sandbox.session.workspace_payloads import coerce_write_payload
from agents.sandbox.types import ExecResult, User
from agents.sandbox.util.tar_utils import (
    UnsafeTarMemberError,
    safe_extract_tarfile,
    should_skip_tar_member,
    validate_tarfile,
)
from agents.sandbox.workspace_paths import sandbox_path_str

from pytest_forkd.aio.offload import offload, uninterruptible
from pytest_forkd.aio.vm import AsyncCheckpoint, AsyncVM, Starting
from pytest_forkd.core.process import GuestProcess
from pytest_forkd.core.vm import VM
from pytest_forkd.errors import CopyError, ExecTimeout, ProcessTimeout
from pytest_forkd.guest.client import GuestOSError

T = TypeVar("T")

#: The ``type`` of forkd's session state and client options in the SDK's registries.
BACKEND_ID = "forkd"

#: Output kept per exec and per PTY read (each of stdout and stderr): the SDK truncates by tokens itself.
EXEC_MAX_OUTPUT = 16 << 20


class ForkdSandboxSessionState(SandboxSessionState):
    """What the SDK stores of a forkd session (``serialize_session_state``), enough to resume it.

    ``forkd_snapshot``/``forkd_config`` (or ``forkd_image``) say where a
    replacement VM comes from; ``vm_name`` names the live child, which a
    client of the same process reattaches to on ``resume``.
    """

    type: Literal["forkd"] = "forkd"
    forkd_snapshot: str = "base"
    forkd_config: str | None = None
    forkd_pool: int | None = None
    forkd_image: str | None = None
    forkd_network_mode: Literal["none"] | None = None
    vm_name: str | None = None


@dataclass
class _PtyEntry:
    """One command started by ``pty_exec_start``: its guest process and when the model last touched it."""

    process: GuestProcess
    tty: bool
    last_used: float = field(default_factory=time.monotonic)


class ForkdSandboxSession(BaseSandboxSession):
    """An Agents SDK sandbox session whose sandbox is one forkd VM (see the module docstring)."""

    state: ForkdSandboxSessionState

    def __init__(self, *, state: ForkdSandboxSessionState, vm: VM, started: bool = False) -> None:
        self.state = state
        self._vm = vm
        self._avm = AsyncVM(vm, follow_loop=True)
        self._started = started
        self._root_ready = started
        self._pty: dict[int, _PtyEntry] = {}
        self._pty_ids: set[int] = set()
        state.vm_name = vm.name

    # -- forkd's extras -------------------------------------------------------------------------
    @property
    def vm(self) -> VM:
        """The VM behind this session (synchronous handle: ``exec``, ``read_file``, ``changes``...)."""
        return self._vm

    @property
    def avm(self) -> AsyncVM:
        """The VM behind this session as an :class:`~pytest_forkd.aio.AsyncVM` (awaitable operations)."""
        return self._avm

    def checkpoint(self, tag: str | None = None) -> Starting[AsyncCheckpoint]:
        """A checkpoint of the VM now: ``async with session.checkpoint():`` rolls back on exit unless ``keep()``.

        ``cp = await session.checkpoint()`` keeps it: ``await cp.rollback()``
        returns the whole VM (workspace, processes, memory) to this moment,
        ``await cp.fork(n)`` starts VMs from it.
        """
        return self._avm.checkpoint(tag)

    # -- lifecycle ------------------------------------------------------------------------------
    async def _call(self, what: str, function: Callable[[], T]) -> T:
        """Run a blocking VM call in a thread of its own; a cancellation waits for it (it changes the VM)."""
        return await uninterruptible(offload(asyncio.get_running_loop(), function, name=f"forkd-agents-{what}"))

    def _root(self) -> str:
        return sandbox_path_str(self._workspace_root_path())

    async def _prepare_backend_workspace(self) -> None:
        root = self._root()
        try:
            await self._call("mkdir", lambda: self._vm.exec(["mkdir", "-p", root], check=True, timeout=60))
        except Exception as exc:
            raise WorkspaceStartError(path=Path(root), cause=exc) from exc
        self._root_ready = True

    async def _after_start(self) -> None:
        self._started = True

    async def _after_start_failed(self) -> None:
        self._started = False

    async def running(self) -> bool:
        return self._started and not self._vm.closed

    async def _shutdown_backend(self) -> None:
        """Kill the VM: a stopped forkd VM cannot be started again, ``resume`` forks a new one instead."""
        self._started = False
        if not self._vm.closed:
            await self._call("close", self._vm.close)

    # -- commands -------------------------------------------------------------------------------
    def _cwd(self) -> str | None:
        """The commands' working directory: the manifest root, once start() made it."""
        return self._root() if self._root_ready else None

    async def _exec_internal(self, *command: str | Path, timeout: float | None = None) -> ExecResult:
        argv = [str(part) for part in command]
        env = await self.state.manifest.environment.resolve() or None
        cwd = self._cwd()
        try:
            result = await self._avm.exec(argv, timeout=timeout, env=env, cwd=cwd, max_output=EXEC_MAX_OUTPUT)
        except ExecTimeout as exc:
            raise ExecTimeoutError(command=command, timeout_s=timeout, cause=exc) from exc
        return ExecResult(stdout=result.stdout_bytes, stderr=result.stderr_bytes, exit_code=result.exit_status)

    # -- files ----------------------------------------------------------------------------------
    async def read(self, path: Path, *, user: str | User | None = None) -> io.IOBase:
        if user is not None:
            await self._check_read_with_exec(path, user=user)
        workspace_path = await self._validate_path_access(path)
        guest_path = sandbox_path_str(workspace_path)
        try:
            data = await self._call("read", lambda: self._vm.read_file(guest_path))
        except GuestOSError as exc:
            if exc.errno == errno.ENOENT:
                raise WorkspaceReadNotFoundError(path=path, cause=exc) from exc
            raise WorkspaceArchiveReadError(path=path, cause=exc) from exc
        return io.BytesIO(data)

    async def write(self, path: Path, data: io.IOBase, *, user: str | User | None = None) -> None:
        payload = coerce_write_payload(path=path, data=data)
        workspace_path = await self._validate_path_access(path, for_write=True)
        if user is not None:
            await self._check_write_with_exec(workspace_path, user=user)
        content = payload.stream.read()
        body = content.encode() if isinstance(content, str) else bytes(content)
        guest_path = sandbox_path_str(workspace_path)
        parent = sandbox_path_str(workspace_path.parent)

        def write() -> None:
            self._vm.exec(["mkdir", "-p", parent], check=True, timeout=60)
            self._vm.write_file(guest_path, body)

        try:
            await self._call("write", write)
        except GuestOSError as exc:
            raise WorkspaceArchiveWriteError(path=workspace_path, cause=exc) from exc

    # -- workspace archives ---------------------------------------------------------------------
    async def persist_workspace(self) -> io.IOBase:
        """The manifest root as a tar stream (members relative to it), without the SDK's skip paths."""
        root = self._root()
        skip = self._persist_workspace_skip_relpaths()

        def pack() -> io.IOBase:
            with _scratch() as scratch:
                tree = scratch / "workspace"
                self._vm.copy_out(root, tree)
                archive = tempfile.TemporaryFile()
                try:
                    with tarfile.open(fileobj=archive, mode="w") as tar:

                        def keep(member: tarfile.TarInfo) -> tarfile.TarInfo | None:
                            if should_skip_tar_member(member.name, skip_rel_paths=skip, root_name=None):
                                return None
                            member.uid = member.gid = 0
                            member.uname = member.gname = ""
                            return member

                        tar.add(tree, arcname=".", filter=keep)
                    archive.seek(0)
                except BaseException:
                    archive.close()
                    raise
                return archive

        try:
            return await self._call("persist", pack)
        except (tarfile.TarError, OSError, GuestOSError, CopyError) as exc:
            raise WorkspaceArchiveReadError(path=Path(root), cause=exc) from exc

    async def hydrate_workspace(self, data: io.IOBase) -> None:
        """Unpack a tar stream from ``persist_workspace`` (of this backend or another) into the manifest root."""
        root = self._root()

        def unpack() -> None:
            with _scratch() as scratch, tempfile.TemporaryFile() as archive:
                while chunk := data.read(1 << 20):
                    archive.write(chunk.encode() if isinstance(chunk, str) else chunk)
                archive.seek(0)
                tree = scratch / "workspace"
                tree.mkdir()
                with tarfile.open(fileobj=archive, mode="r:*") as tar:
                    validate_tarfile(tar, allow_external_symlink_targets=False)
                    safe_extract_tarfile(tar, root=tree, allow_external_symlink_targets=False)
                self._vm.exec(["mkdir", "-p", root], check=True, timeout=60)
                self._vm.copy_in(tree, root)

        try:
            await self._call("hydrate", unpack)
        except UnsafeTarMemberError as exc:
            raise WorkspaceArchiveWriteError(
                path=Path(root), context={"reason": exc.reason, "member": exc.member}, cause=exc
            ) from exc
        except (tarfile.TarError, OSError, GuestOSError, CopyError) as exc:
            raise WorkspaceArchiveWriteError(path=Path(root), cause=exc) from exc

    # -- PTY ------------------------------------------------------------------------------------
    def supports_pty(self) -> bool:
        return True

    async def pty_exec_start(
        self,
        *command: str | Path,
        timeout: float | None = None,
        shell: bool | list[str] = True,
        user: str | User | None = None,
        tty: bool = False,
        yield_time_s: float | None = None,
        max_output_tokens: int | None = None,
    ) -> PtyExecUpdate:
        """Start the command as a guest process; return what it printed within the yield time.

        Without ``tty`` its stderr is merged into its stdout (as on the
        SDK's other backends, the model sees one stream). A process still
        running afterwards gets a ``process_id`` for ``pty_write_stdin``.
        """
        _ = timeout  # as on the SDK's own backends: a PTY process runs until it ends or is terminated
        argv = self._prepare_exec_command(*command, shell=shell, user=user)
        if not tty:
            argv = ["sh", "-c", 'exec "$@" 2>&1', "sh", *argv]
        env = await self.state.manifest.environment.resolve() or None
        cwd = self._cwd()
        process = await self._call(
            "spawn", lambda: self._vm.spawn(argv, env=env, cwd=cwd, pty=tty, max_output=EXEC_MAX_OUTPUT)
        )
        entry = _PtyEntry(process=process, tty=tty)
        process_id = allocate_pty_process_id(self._pty_ids)
        self._pty_ids.add(process_id)
        pruned = self._prune_pty()
        self._pty[process_id] = entry
        if pruned is not None:
            await self._call("pty-kill", pruned.process.kill)
        yield_ms = clamp_pty_yield_time_ms(10_000 if yield_time_s is None else int(yield_time_s * 1000))
        return await self._collect(process_id, entry, yield_ms, max_output_tokens)

    async def pty_write_stdin(
        self,
        *,
        session_id: int,
        chars: str,
        yield_time_s: float | None = None,
        max_output_tokens: int | None = None,
    ) -> PtyExecUpdate:
        entry = self._resolve_pty_session_entry(pty_processes=self._pty, session_id=session_id)
        if chars:
            if not entry.tty:
                raise RuntimeError("stdin is not available for this process")
            await self._call("pty-stdin", lambda: entry.process.write_stdin(chars))
        yield_ms = resolve_pty_write_yield_time_ms(
            yield_time_ms=250 if yield_time_s is None else int(yield_time_s * 1000), input_empty=chars == ""
        )
        entry.last_used = time.monotonic()
        return await self._collect(session_id, entry, yield_ms, max_output_tokens)

    async def pty_terminate_all(self) -> None:
        entries = list(self._pty.values())
        self._pty.clear()
        self._pty_ids.clear()
        if self._vm.closed:
            return
        for entry in entries:
            with suppress(Exception):  # ended meanwhile, or the guest is gone: nothing left to kill
                await self._call("pty-kill", functools.partial(entry.process.kill, signal.SIGKILL))

    def _prune_pty(self) -> _PtyEntry | None:
        if len(self._pty) < PTY_PROCESSES_MAX:
            return None
        meta = [(pid, entry.last_used, entry.process.poll() is not None) for pid, entry in self._pty.items()]
        victim = process_id_to_prune_from_meta(meta)
        if victim is None:
            return None
        self._pty_ids.discard(victim)
        return self._pty.pop(victim, None)

    async def _collect(
        self, process_id: int, entry: _PtyEntry, yield_ms: int, max_output_tokens: int | None
    ) -> PtyExecUpdate:
        """What the process printed until it ended or ``yield_ms`` passed, and its exit code if it ended."""
        process = entry.process

        def read() -> tuple[bytes, int | None]:
            deadline = time.monotonic() + yield_ms / 1000
            chunks: list[bytes] = []
            ended = False
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    chunk = process.stdout.read_chunk(timeout=left)
                except ProcessTimeout:
                    break
                if not chunk:
                    ended = True
                    break
                chunks.append(chunk)
            exit_code = process.wait(timeout=30) if ended else process.poll()
            return b"".join(chunks), exit_code

        output, exit_code = await self._call("pty-read", read)
        decoded = output.decode("utf-8", errors="replace")
        text, original_token_count = truncate_text_by_tokens(decoded, max_output_tokens)
        live_id: int | None = process_id
        if exit_code is not None:
            self._pty.pop(process_id, None)
            self._pty_ids.discard(process_id)
            live_id = None
        return PtyExecUpdate(
            process_id=live_id,
            output=text.encode("utf-8"),
            exit_code=exit_code,
            original_token_count=original_token_count,
        )


@contextmanager
def _scratch() -> Iterator[Path]:
    """A private host directory for one archive's tree, removed afterwards whatever happens."""
    with tempfile.TemporaryDirectory(prefix="forkd-agents-") as directory:
        yield Path(directory)
