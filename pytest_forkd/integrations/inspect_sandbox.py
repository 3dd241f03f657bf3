"""The Inspect sandbox environment ``forkd``: every sample runs its tools in a forked microVM.

Registered through the ``inspect_ai`` entry point of pytest-forkd, so after
``pip install "pytest-forkd[inspect]"`` a task says ``sandbox="forkd"`` (or
``inspect eval ... --sandbox forkd``) and nothing needs importing.

Lifecycle, as Inspect drives it:

- ``task_init`` (once per task and config): opens the process's forkd
  session for that config (its forkd.yaml and snapshot, see
  :class:`~pytest_forkd.integrations.inspect_support.ForkdSandboxConfig`), builds
  or restores the snapshot and starts the pool of children restored ahead of
  demand. A broken forkd.yaml or an unknown snapshot fails the eval here with
  forkd's one-line message.
- A config that names a container image as Docker would (a ``compose.yaml``,
  a ``Dockerfile``, Inspect's ``ComposeConfig``; see
  :mod:`~pytest_forkd.integrations.compose`) gets one warm parent per image:
  ``task_init`` pulls or builds the image and boots its snapshot once. A
  compose file forkd cannot run, an image that cannot be pulled or a build
  that fails is then the error of each sample of that config (forkd's one
  line), and samples of other configs go on.
- ``sample_init`` (per sample, several at once): hands the sample a
  copy-on-write child of the snapshot, from the pool; Inspect then writes the
  sample's ``files`` and runs its ``setup`` script through it.
- ``exec``/``read_file``/``write_file``: the guest agent's calls, with
  Inspect's limits and error types (see :mod:`~pytest_forkd.integrations.inspect_support`).
  A guest that dies raises :class:`~pytest_forkd.errors.GuestCrashed` (with
  the console tail), which fails that sample only.
- ``sample_cleanup`` kills the sample's VM; ``task_cleanup`` closes the
  session (every VM it started, the pool included).

The VM calls block, so they run in worker threads (:mod:`pytest_forkd.aio`);
the sandbox needs Inspect's default asyncio backend.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import posixpath
import secrets
import shlex
import threading
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, overload

import anyio
from inspect_ai.util import (
    ExecResult,
    SandboxConnection,
    SandboxEnvironment,
    SandboxEnvironmentConfigType,
    SandboxEnvironmentLimits,
    SandboxEnvironmentSpec,
    display_type,
    sandboxenv,
)
from pydantic import BaseModel

from pytest_forkd.aio.offload import offload, running_loop
from pytest_forkd.aio.vm import AsyncVM
from pytest_forkd.core.cores import usable_cores
from pytest_forkd.core.pool import available_memory_mib, memory_bound
from pytest_forkd.errors import AgentError, ExecTimeout, ForkdError, InvalidArgument, WrongEventLoop
from pytest_forkd.guest.client import GuestOSError
from pytest_forkd.guest.exec_result import ExecResult as GuestResult
from pytest_forkd.integrations.inspect_support import (
    CONFIG_FILES,
    DEFAULT_WORKDIR,
    STDIN_WRITE_LIMIT,
    ForkdSandboxConfig,
    ForkdSandboxError,
    ImageSample,
    argv_script,
    argv_too_large,
    config_path,
    decode_text,
    deserialize_config,
    exec_result,
    file_error,
    guest_path,
    guest_user,
    image_sample,
    is_image_config,
    is_root,
    launch_error,
    metadata_environment,
    os_error,
    parse_config,
    read_as_user,
    read_limit_error,
    startup_error,
    timeout_error,
    user_error,
    write_as_user,
)
from pytest_forkd.integrations.sessions import SESSIONS, ImageDefaults, ImageGuest, image_defaults, open_image_session
from pytest_forkd.project.session import ForkdSession

__all__ = ["ForkdSandboxConfig", "ForkdSandboxEnvironment", "ForkdSandboxError", "lend_session"]

log = logging.getLogger(__name__)

#: Memory one sample's VM is counted at for ``default_concurrency``: a child's RSS (~80 MiB) and the
#: pages its commands typically dirty.
SAMPLE_MIB = 128
#: Samples per host core at most: under TCG every busy guest takes a core.
SAMPLES_PER_CORE = 4
# Which session each config Inspect passes (a path string, a model, None) was resolved to at task_init:
# sample_init runs in another working directory, where a relative forkd.yaml path means something else.
_resolved: dict[Hashable, Hashable] = {}
_resolved_lock = threading.Lock()


def _config_identity(config: SandboxEnvironmentConfigType | None) -> Hashable:
    return config if isinstance(config, (str, ForkdSandboxConfig)) or config is None else repr(config)


def _session_key(config: ForkdSandboxConfig, base: Path) -> Hashable:
    if config.session is not None:
        return ("lent", config.session)
    path = config_path(config, base)
    return ("own", str(path) if path is not None else None, config.snapshot)


def _open_session(key: Hashable) -> ForkdSession:
    """Open the session a key names, build or restore its snapshot and start its pool (blocking)."""
    assert isinstance(key, tuple)
    if key[0] == "lent":
        raise ForkdSandboxError(
            f"forkd sandbox: forkd session {key[1]!r} is gone; the pytest fixture that lent it "
            "(forkd_inspect_sandbox) has ended: run the eval inside the test that uses it"
        )
    _, config, snapshot = key
    session = ForkdSession.open(config=config, snapshot=snapshot, progress=log.info)
    try:
        _warm(session)
    except BaseException:
        session.close()
        raise
    return session


def _warm(session: ForkdSession) -> None:
    """Build or restore the session's snapshot and start its pool: samples then only fork (blocking)."""
    session.snapshot  # noqa: B018 - the property builds the snapshot and keeps children ready


async def _acquire(config: SandboxEnvironmentConfigType | None) -> ForkdSession:
    """One more user of the session for ``config`` (task_init), opened and warmed in a worker thread."""
    parsed = parse_config(config)
    key = _session_key(parsed, Path.cwd())
    identity = _config_identity(config)
    with _resolved_lock:
        known = _resolved.get(identity)
        if known is not None and known != key:
            raise ForkdSandboxError(
                f"forkd sandbox: config {config!r} names different forkd.yaml files for tasks in different "
                "directories; give the forkd.yaml as an absolute path"
            )
        _resolved[identity] = key
    acquired = False
    try:
        session = await anyio.to_thread.run_sync(functools.partial(SESSIONS.acquire, key, lambda: _open_session(key)))
        acquired = True
        if parsed.session is not None:  # a lent session: its snapshot may not be ready yet
            await anyio.to_thread.run_sync(functools.partial(_warm, session))
    except BaseException as exc:
        if acquired:
            SESSIONS.release(key)
        if SESSIONS.users(key) == 0:  # nobody uses it: forget the config, as task_cleanup would
            with _resolved_lock:
                _resolved.pop(identity, None)
        if isinstance(exc, ForkdError) and not isinstance(exc, ForkdSandboxError):
            raise startup_error(exc) from exc
        raise
    return session


def _release(config: SandboxEnvironmentConfigType | None) -> None:
    with _resolved_lock:
        key = _resolved.get(_config_identity(config))
    if key is not None:
        SESSIONS.release(key)
        if SESSIONS.users(key) == 0:
            with _resolved_lock:
                _resolved.pop(_config_identity(config), None)


async def _session_for(config: SandboxEnvironmentConfigType | None) -> ForkdSession:
    """The session task_init opened for ``config``; opened now (and kept until exit) if there was no task_init."""
    with _resolved_lock:
        key = _resolved.get(_config_identity(config))
    session = SESSIONS.get(key) if key is not None else None
    if session is not None:
        return session
    log.info("forkd sandbox: sample_init without task_init; the session stays open until the process exits")
    return await _acquire(config)


# -- configs that name a container image (compose.yaml, Dockerfile, ComposeConfig) --------------------------------


@dataclass
class _ImageConfigState:
    """What ``task_init`` of one image config left for its samples and its ``task_cleanup``."""

    base: Path
    """The task's directory, where the config's relative paths resolve (samples run elsewhere)."""
    keys: list[Hashable] = field(default_factory=list)
    """Sessions this config uses, one user each (released by ``task_cleanup``)."""
    failures: dict[Hashable, ForkdError] = field(default_factory=dict)
    """Images that could not be had: each sample of them fails with this, without trying again."""


_image_configs: dict[Hashable, _ImageConfigState] = {}
#: What each image session's image gives its commands (working directory, user), read once when it opens.
_image_defaults: dict[Hashable, ImageDefaults] = {}


def _image_state(config: SandboxEnvironmentConfigType | None) -> _ImageConfigState:
    with _resolved_lock:
        return _image_configs.setdefault(_config_identity(config), _ImageConfigState(base=Path.cwd()))


def _progress(announce: bool) -> Callable[[str], None]:
    """Where the lines of a pull, a build and a snapshot's boot go: the log, and during ``task_init`` the console.

    Inspect suspends its task display around ``task_init`` (its docker
    sandbox prints its pulls and builds there), so a build is never silent;
    samples run under the live display, where only the log is safe. Display
    ``none`` keeps stdout machine-readable, so there the lines are logged only.
    """
    if not announce or display_type() == "none":
        return log.info

    def show(line: str) -> None:
        log.debug(line)
        print(line, flush=True)

    return show


def _open_image(key: Hashable, guest: ImageGuest, announce: bool = False) -> ForkdSession:
    """Open an image's session: build or pull, boot its snapshot once, start its pool (blocking)."""
    session = open_image_session(guest, progress=_progress(announce))
    try:
        _warm(session)
        _image_defaults[key] = image_defaults(session)
    except BaseException:
        session.close()
        raise
    return session


async def _image_session(
    config: SandboxEnvironmentConfigType | None, environ: dict[str, str], *, announce: bool = False
) -> tuple[ForkdSession, ImageSample, ImageDefaults]:
    """The session of the image a config names (interpolated with ``environ``), opened once for the config.

    Raises forkd's one-line error when the config cannot be read, or when its
    image could not be had (remembered: the next sample fails at once).
    """
    state = _image_state(config)
    sample = await anyio.to_thread.run_sync(functools.partial(image_sample, config, base=state.base, environ=environ))
    key: Hashable = ("image", sample.guest)
    with _resolved_lock:
        failure = state.failures.get(key)
        held = key in state.keys
    if failure is not None:
        raise _again(failure)
    session = SESSIONS.get(key) if held else None
    if session is None:
        try:
            session = await anyio.to_thread.run_sync(
                functools.partial(SESSIONS.acquire, key, lambda: _open_image(key, sample.guest, announce))
            )
        except ForkdError as exc:
            with _resolved_lock:
                state.failures[key] = exc
            raise
        with _resolved_lock:
            state.keys.append(key)
    return session, sample, _image_defaults.get(key, ImageDefaults())


def _again(exc: ForkdError) -> ForkdError:
    """A fresh error like ``exc`` (same type and message) to raise in one more sample."""
    try:
        again = type(exc)(*exc.args)
    except TypeError:
        again = ForkdSandboxError(str(exc))
    return again if str(again) == str(exc) else ForkdSandboxError(str(exc))


async def _acquire_image(config: SandboxEnvironmentConfigType | None) -> None:
    """``task_init`` of an image config: make its image's warm parent now; a failure is its samples' error."""
    try:
        await _image_session(config, dict(os.environ), announce=True)
    except ForkdError as exc:
        log.warning(f"forkd sandbox: the samples of {config!r} will fail: {exc}")


def _release_image(config: SandboxEnvironmentConfigType | None) -> None:
    with _resolved_lock:
        state = _image_configs.pop(_config_identity(config), None)
    for key in state.keys if state is not None else ():
        SESSIONS.release(key)
        if SESSIONS.users(key) == 0:
            _image_defaults.pop(key, None)


@contextlib.contextmanager
def lend_session(session: ForkdSession) -> Iterator[SandboxEnvironmentSpec]:
    """A sandbox spec whose samples fork from an open forkd session (the pytest plugin's), for ``Task(sandbox=...)``.

    The samples' VMs are children of ``session.snapshot`` (the pytest
    session's parent state) and are killed after each sample; the session
    itself stays open: its owner closes it. Evals must run inside the
    ``with`` block.
    """
    ident = secrets.token_hex(6)
    key = ("lent", ident)
    SESSIONS.lend(key, session)
    config = ForkdSandboxConfig(session=ident)
    # The plugin counts the tests still to come to bound its pool; an eval's samples are not among them,
    # so while the spec is lent the pool sizes itself from demand alone.
    expected, session.children_expected = session.children_expected, None
    try:
        yield SandboxEnvironmentSpec("forkd", config)
    finally:
        session.children_expected = expected
        SESSIONS.release(key)
        with _resolved_lock:
            _resolved.pop(config, None)


@sandboxenv(name="forkd")
class ForkdSandboxEnvironment(SandboxEnvironment):
    """One sample's forkd microVM: a copy-on-write child of the task's snapshot."""

    def __init__(self, vm: AsyncVM, *, workdir: str | None = None, user: str | None = None) -> None:
        super().__init__()
        self.vm = vm
        """The sample's VM (``vm.sync`` is the :class:`~pytest_forkd.core.vm.VM`: checkpoints, branches, forks)."""
        self.workdir = workdir or vm.sync.cwd or DEFAULT_WORKDIR
        """Where commands run and relative paths resolve: the snapshot's ``workdir``, else /root (in a container
        image: the compose ``working_dir``, else the image's ``WorkingDir``)."""
        self.user = user
        """Who commands and file operations run as unless ``exec`` names a user: None is the guest's own (root in
        forkd's image, the image's ``User`` in a container image)."""

    # -- lifecycle -------------------------------------------------------------------------------------------

    @classmethod
    def config_files(cls) -> list[str]:
        """forkd.yaml, then Docker's files: with them Inspect treats forkd as docker-compatible."""
        return list(CONFIG_FILES)

    @classmethod
    def config_deserialize(cls, config: dict[str, Any]) -> BaseModel:
        return deserialize_config(config)

    @classmethod
    def default_concurrency(cls) -> int | None:
        """Samples at once by default: as many 128 MiB VMs as half the available memory holds, at most 4 a core."""
        return max(1, min(memory_bound(SAMPLE_MIB, available_memory_mib()), SAMPLES_PER_CORE * usable_cores()))

    @classmethod
    async def task_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None) -> None:
        try:
            running_loop("the forkd sandbox")
        except WrongEventLoop:
            raise ForkdSandboxError(
                "forkd sandbox: needs Inspect's asyncio backend (the default); unset INSPECT_ASYNC_BACKEND=trio"
            ) from None
        if is_image_config(config):
            await _acquire_image(config)
        else:
            await _acquire(config)

    @classmethod
    async def task_init_environment(
        cls, config: SandboxEnvironmentConfigType | None, metadata: dict[str, str]
    ) -> dict[str, str]:
        """``SAMPLE_METADATA_*`` for the metadata a compose file interpolates: Inspect inits each distinct one."""
        return metadata_environment(config, metadata, base=Path.cwd())

    @classmethod
    async def sample_init(
        cls, task_name: str, config: SandboxEnvironmentConfigType | None, metadata: dict[str, str]
    ) -> dict[str, SandboxEnvironment]:
        loop = running_loop("the forkd sandbox (set INSPECT_ASYNC_BACKEND=asyncio, Inspect's default)")
        workdir: str | None = None
        user: str | None = None
        if is_image_config(config):
            base = _image_state(config).base
            environ = {**os.environ, **metadata_environment(config, metadata, base=base)}
            session, sample, defaults = await _image_session(config, environ)
            workdir = sample.guest.workdir or defaults.working_dir
            user = sample.user if sample.user is not None else defaults.user
        else:
            session = await _session_for(config)

        def fork() -> Any:
            return session.fork(1)[0]

        # A cancelled sample (Ctrl-C, a time limit) closes the VM once it is up instead of leaking it.
        vm = await offload(loop, fork, name="forkd-inspect-fork", discard=lambda started: started.close())
        return {"default": cls(AsyncVM(vm, follow_loop=True), workdir=workdir, user=user)}

    @classmethod
    async def sample_cleanup(
        cls,
        task_name: str,
        config: SandboxEnvironmentConfigType | None,
        environments: dict[str, SandboxEnvironment],
        interrupted: bool,
    ) -> None:
        for environment in environments.values():
            if isinstance(environment, ForkdSandboxEnvironment):
                await environment.vm.close()

    @classmethod
    async def task_cleanup(cls, task_name: str, config: SandboxEnvironmentConfigType | None, cleanup: bool) -> None:
        # Even with --no-sandbox-cleanup: a VM cannot outlive the process that started it.
        if is_image_config(config):
            await anyio.to_thread.run_sync(functools.partial(_release_image, config))
        else:
            await anyio.to_thread.run_sync(functools.partial(_release, config))

    @classmethod
    async def cli_cleanup(cls, id: str | None) -> None:
        """``inspect sandbox cleanup forkd``: kill the QEMU processes and remove the run directories of dead evals.

        forkd keeps one run directory per process; one whose process is gone
        is stale, whatever ``id`` says. Runs of live processes are never
        touched, nor other users' runs.
        """
        removed = await anyio.to_thread.run_sync(_clean_stale_runs)
        if removed:
            print(f"forkd: removed {len(removed)} stale run director{'y' if len(removed) == 1 else 'ies'}:")
            for path in removed:
                print(f"  {path}")
        else:
            print("forkd: no stale run directories")

    # -- the sample's VM -------------------------------------------------------------------------------------

    async def exec(
        self,
        cmd: list[str],
        input: str | bytes | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        user: str | None = None,
        timeout: int | None = None,
        timeout_retry: bool = True,
        concurrency: bool = True,
    ) -> ExecResult[str]:
        """Run ``cmd`` (an argv, resolved on the guest's PATH) in the sample's VM.

        ``user`` runs it as that user, as ``docker exec --user`` does (a name
        from the guest's /etc/passwd, a number, ``NAME:GROUP``); without one,
        as the sample's user. An unknown user raises
        SandboxUserUnsupportedError. A ``timeout`` kills the command with
        everything it started and raises TimeoutError (no retry: the kill is
        in the guest, so a retry would only run it again). A stream longer
        than Inspect's exec output limit raises OutputLimitExceededError.
        """
        argv = list(cmd)
        if not argv:
            raise ValueError("exec needs a command: cmd is empty")
        if argv_too_large(argv):
            script = f"/tmp/.forkd-argv-{secrets.token_hex(8)}"
            await self.vm.write_file(script, argv_script(argv), mode=0o644)
            run = ["/bin/sh", script]
        else:
            run = argv
        runs_as = user if user is not None else self.user
        limit = SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE
        where = guest_path(cwd, self.workdir) if cwd is not None else self.workdir
        try:
            result = await self.vm.exec(
                run,
                stdin=input,
                env=env,
                cwd=where,
                timeout=timeout,
                max_output=limit,
                timing="workload",
                user=guest_user(runs_as),
            )
        except ExecTimeout as exc:
            raise timeout_error(timeout or 0, exc.result) from None
        except GuestOSError as exc:
            raise os_error(exc, exc.path or where) from None
        except (AgentError, InvalidArgument) as exc:
            refused = user_error(str(runs_as), exc) if runs_as is not None else None
            if refused is not None:
                raise refused from None
            raise
        denied = launch_error(argv, result)
        if denied is not None:
            raise denied
        return exec_result(result, limit)

    async def _as_user(
        self, argv: list[str], file: str, *, stdin: bytes | None = None, limit: int | None = None
    ) -> GuestResult:
        """Run a file operation's command as the sample's user: its permissions apply, as in Docker's sandbox."""
        try:
            return await self.vm.exec(argv, stdin=stdin, max_output=limit, user=guest_user(self.user))
        except GuestOSError as exc:
            raise os_error(exc, file) from None

    async def write_file(self, file: str, contents: str | bytes) -> None:
        """Write ``file`` (relative to the working directory), making its directories.

        As root, the file is replaced atomically; as another user (the
        image's or the compose file's), it is written in place as that user,
        so its permissions apply and it is the user's, as in Docker's sandbox.
        """
        path = guest_path(file, self.workdir)
        if not is_root(self.user):
            data = contents.encode("utf-8") if isinstance(contents, str) else bytes(contents)
            if len(data) > STDIN_WRITE_LIMIT:
                await self._write_large_as_user(path, file, data)
                return
            written = await self._as_user(write_as_user(path), file, stdin=data)
            if not written.ok:
                raise file_error(written.stderr, file)
            return
        try:
            await self.vm.write_file(path, contents)
            return
        except GuestOSError as exc:
            if exc.errno != 2:  # ENOENT: a directory on the way is missing
                raise os_error(exc, file) from None
        made = await self.vm.exec(["/bin/mkdir", "-p", "--", posixpath.dirname(path)])
        if not made.ok:
            raise NotADirectoryError(20, f"cannot create the directories of {file}: {made.stderr.strip()}", file)
        try:
            await self.vm.write_file(path, contents)
        except GuestOSError as exc:
            raise os_error(exc, file) from None

    async def _write_large_as_user(self, path: str, file: str, data: bytes) -> None:
        """Stream ``data`` into ``path`` in place as the sample's user (no second copy in guest memory)."""
        user = guest_user(self.user)
        try:
            await self.vm.write_file(path, data, user=user)
            return
        except GuestOSError as exc:
            if exc.errno != 2:  # ENOENT: a directory on the way is missing
                raise os_error(exc, file) from None
        made = await self._as_user(["mkdir", "-p", "--", posixpath.dirname(path)], file)
        if not made.ok:
            raise file_error(made.stderr, file)
        try:
            await self.vm.write_file(path, data, user=user)
        except GuestOSError as exc:
            raise os_error(exc, file) from None

    @overload
    async def read_file(self, file: str, text: Literal[True] = True) -> str: ...

    @overload
    async def read_file(self, file: str, text: Literal[False]) -> bytes: ...

    async def read_file(self, file: str, text: bool = True) -> Union[str | bytes]:
        """Read ``file``; larger than Inspect's read limit raises OutputLimitExceededError."""
        path = guest_path(file, self.workdir)
        if posixpath.basename(file.rstrip("/")) in (".", ".."):
            raise IsADirectoryError(21, "Is a directory", file)
        limit = SandboxEnvironmentLimits.MAX_READ_FILE_SIZE
        if not is_root(self.user):
            read = await self._as_user(read_as_user(path), file, limit=limit)
            if not read.ok:
                raise file_error(read.stderr, file)
            if read.truncated or len(read.stdout_bytes) > limit:
                raise read_limit_error()
            return decode_text(read.stdout_bytes) if text else read.stdout_bytes
        loop = running_loop("the forkd sandbox")
        vm = self.vm.sync
        try:
            data = await offload(
                loop, functools.partial(vm.read_file, path, max_size=limit), name=f"forkd-inspect-read-{vm.name}"
            )
        except GuestOSError as exc:
            raise os_error(exc, file) from None
        except AgentError as exc:
            if "the host accepts" in str(exc) or "larger than max_size" in str(exc):
                raise read_limit_error() from None
            raise
        return decode_text(data) if text else data

    async def connection(self, *, user: str | None = None) -> SandboxConnection:
        """``forkd shell`` in a new child of the snapshot this sample started from.

        Nothing outside this process can attach to the sample's own VM (its
        agent channel belongs to the eval), so the command opens a copy of
        the sample's *starting* state, not of what the sample did since.
        """
        if self.vm.closed:
            raise ConnectionError(f"the sample's VM {self.vm.name} is not running")
        origin = self.vm.origin
        if origin is None:
            raise NotImplementedError("this VM was not started from a snapshot, so forkd shell cannot open a copy")
        if not is_root(user):
            raise NotImplementedError(f"forkd shell opens a root shell; it cannot log in as {user!r}")
        command = shlex.join(["forkd", "shell", "--store", str(Path(origin.path).parent), origin.tag])
        return SandboxConnection(type="forkd", command=command)

    def default_polling_interval(self) -> float:
        return 0.2


def _clean_stale_runs() -> list[Path]:
    """Stale run directories of this user removed (their QEMU killed), under every root forkd may use."""
    from pytest_forkd.engine import rundir
    from pytest_forkd.paths import shm_root

    roots = [shm_root()]
    fallbacks = getattr(rundir, "fallback_roots", None)
    if callable(fallbacks):
        roots.extend(root for root in fallbacks() if root not in roots)
    removed: list[Path] = []
    for root in roots:
        removed.extend(rundir.clean_stale(root))
    return removed
