"""What the Inspect sandbox ``forkd`` needs besides the class itself: its config, and Inspect's errors.

Kept apart from :mod:`pytest_forkd.integrations.inspect_sandbox` so that each
rule (how a config names a forkd.yaml and a snapshot, how a guest's answer
becomes the error Inspect documents for it, how a command runs as another
user) can be read and tested on its own, without a VM.

Imports :mod:`inspect_ai` (and pydantic, which Inspect depends on): loaded
only when Inspect loads the sandbox.
"""

from __future__ import annotations

import errno
import json
import os
import posixpath
import shlex
from pathlib import Path
from typing import Any

from inspect_ai._util.error import PrerequisiteError
from inspect_ai.util import (
    ExecResult,
    OutputLimitExceededError,
    SandboxEnvironmentLimits,
    SandboxUserUnsupportedError,
)
from pydantic import BaseModel, ConfigDict

from pytest_forkd.errors import ConfigError, ForkdError
from pytest_forkd.guest.client import GuestOSError
from pytest_forkd.guest.exec_result import ExecResult as GuestResult

#: Where commands run and relative paths resolve when the snapshot names no ``workdir``
#: (the guest's init starts the agent in root's home).
DEFAULT_WORKDIR = "/root"
#: The config file Inspect finds next to a task when ``sandbox="forkd"`` names none.
CONFIG_FILE = "forkd.yaml"
#: Who runs a command when ``exec`` names no user: the guest agent's own user.
ROOT_USERS = frozenset({"root", "0"})
#: Prefix of what the guest agent writes when it cannot start a command (not the command's own output).
AGENT_EXEC_PREFIX = "forkd-exec: exec: "


class ForkdSandboxConfig(BaseModel):
    """Configuration of the ``forkd`` sandbox: ``sandbox=("forkd", ForkdSandboxConfig(...))``.

    ``config``: a forkd.yaml (relative to the task's directory), whose
    ``settings:`` apply and whose snapshots can be named; ``snapshot``: the
    snapshot every sample starts from (default: the one the forkd.yaml's
    settings select, else the built-in ``base``). A plain string config,
    ``sandbox=("forkd", "forkd.yaml")``, is the same as ``config=`` alone.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    config: str | None = None
    snapshot: str | None = None
    session: str | None = None
    """Internal: the id of a forkd session lent by the pytest plugin (see ``forkd_inspect_sandbox``)."""


class ForkdSandboxError(ConfigError, PrerequisiteError):
    """A forkd sandbox cannot start: Inspect's CLI prints the one-line message without a traceback.

    A :class:`~pytest_forkd.errors.ConfigError` too, so code that runs an eval
    can catch forkd's own family; the forkd error that caused it is its
    ``__cause__``.
    """

    def __init__(self, message: str) -> None:
        ConfigError.__init__(self, message)
        self.message = message


def startup_error(exc: ForkdError) -> ForkdSandboxError:
    """The error an eval fails with when the sandbox cannot be set up: forkd's message, no traceback in the CLI.

    A bad config or an unknown snapshot is one line; a snapshot whose setup
    failed also shows the failing command's output.
    """
    return ForkdSandboxError(f"forkd sandbox: {str(exc).strip() or type(exc).__name__}")


def parse_config(config: object) -> ForkdSandboxConfig:
    """A config as Inspect passes it (None, a path string, a model) as :class:`ForkdSandboxConfig`."""
    if config is None:
        return ForkdSandboxConfig()
    if isinstance(config, ForkdSandboxConfig):
        return config
    if isinstance(config, str):
        if not config.strip():
            raise ForkdSandboxError("forkd sandbox: the config is an empty string; name a forkd.yaml or leave it out")
        return ForkdSandboxConfig(config=config)
    if isinstance(config, BaseModel):
        try:
            return ForkdSandboxConfig.model_validate(config.model_dump())
        except ValueError as exc:
            raise ForkdSandboxError(f"forkd sandbox: config {config!r} is not a forkd config: {exc}") from None
    raise ForkdSandboxError(
        f"forkd sandbox: config must be a forkd.yaml path or ForkdSandboxConfig, got {type(config).__name__}"
    )


def deserialize_config(data: dict[str, Any]) -> ForkdSandboxConfig:
    """:meth:`ForkdSandboxEnvironment.config_deserialize`: a config read back from an eval log."""
    try:
        return ForkdSandboxConfig.model_validate(data)
    except ValueError as exc:
        raise ForkdSandboxError(f"forkd sandbox: unreadable config {data!r}: {exc}") from None


def config_path(config: ForkdSandboxConfig, base: Path) -> Path | None:
    """The forkd.yaml a config names, absolute (relative names resolve against ``base``, the task's directory)."""
    if config.config is None:
        return None
    path = Path(os.path.expanduser(config.config))
    return path if path.is_absolute() else (base / path).absolute()


# -- paths -------------------------------------------------------------------------------------------------------


def guest_path(path: str, workdir: str) -> str:
    """A path of Inspect's (relative to the sample's working directory) as an absolute guest path."""
    return path if posixpath.isabs(path) else posixpath.normpath(posixpath.join(workdir, path))


# -- exec --------------------------------------------------------------------------------------------------------


def is_root(user: str | None) -> bool:
    return user is None or user in ROOT_USERS


#: What :func:`as_user`'s wrapper says when the guest has no ``su``.
NO_SU = "su: not found (no su in the guest)"
#: Where ``su`` is looked for, by absolute path (never through the image's PATH, which the command keeps).
SU_PATHS = ("/usr/bin/su", "/bin/su", "/usr/sbin/su", "/sbin/su")


def as_user(user: str, argv: list[str]) -> list[str]:
    """``argv`` run as ``user`` through the guest's ``su``, itself found by absolute path (:data:`SU_PATHS`).

    ``su`` without ``-m`` sets HOME, SHELL, USER and LOGNAME to the user's and
    keeps the rest of the environment (PATH included: the command resolves
    as root's would) and the working directory; the user must be in the
    guest's /etc/passwd.
    """
    script = (
        "user=$1; shift; for su in " + " ".join(SU_PATHS) + '; do if [ -x "$su" ]; then '
        'exec "$su" -s /bin/sh "$user" -c \'exec "$0" "$@"\' "$@"; fi; done; '
        f'echo "{NO_SU}" >&2; exit 127'
    )
    return ["/bin/sh", "-c", script, "forkd-as-user", user, *argv]


#: Beyond this many bytes of JSON, an argv goes to the guest in a script file rather than in the request
#: (the agent protocol keeps a request's JSON under 1 MiB; the kernel takes 2 MiB of arguments).
LARGE_ARGV_BYTES = 256 << 10


def argv_too_large(argv: list[str]) -> bool:
    return len(json.dumps(argv)) > LARGE_ARGV_BYTES


def argv_script(argv: list[str]) -> str:
    """A shell script that runs ``argv`` (removing itself first): how a command too large for a request runs."""
    return 'rm -f -- "$0"\nset -- ' + " ".join(shlex.quote(arg) for arg in argv) + '\nexec "$@"\n'


def user_error(user: str, result: GuestResult) -> SandboxUserUnsupportedError | None:
    """The error for a command that ``su`` could not start as ``user``, or None if the command itself ran."""
    stderr = result.stderr.strip()
    if result.exit_code == 1 and stderr.startswith("su: unknown user"):
        return SandboxUserUnsupportedError(
            f"forkd sandbox: the guest has no user {user!r} (no such entry in its /etc/passwd); add the user "
            "in the setup of the snapshot in forkd.yaml, or run as root (user=None)"
        )
    if result.exit_code == 127 and stderr == NO_SU:
        return SandboxUserUnsupportedError(
            f"forkd sandbox: cannot run as {user!r}: the guest image has no su; add one to the image, or run as root"
        )
    return None


def launch_error(argv: list[str], result: GuestResult) -> PermissionError | None:
    """PermissionError when the guest agent could not start ``argv[0]`` because it is not executable."""
    stderr = result.stderr.strip()
    if (
        result.exit_code == 126
        and not result.stdout_bytes
        and stderr.startswith(AGENT_EXEC_PREFIX)
        and "\n" not in stderr
        and stderr.endswith("Permission denied")
    ):
        return PermissionError(errno.EACCES, f"Permission denied executing {shlex.join(argv)}", argv[0])
    return None


def exec_result(result: GuestResult, limit: int) -> ExecResult[str]:
    """A guest command's result as Inspect's; OutputLimitExceededError if a stream went past ``limit`` bytes.

    forkd kept the first and last halves of a longer stream (``truncated``);
    what was kept goes with the error as its ``truncated_output``.
    """
    if result.truncated or len(result.stdout_bytes) > limit or len(result.stderr_bytes) > limit:
        raise OutputLimitExceededError(
            limit_str=SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE_STR,
            truncated_output=(result.stdout + result.stderr)[-limit:],
        )
    return ExecResult(
        success=result.exit_code == 0,
        returncode=result.exit_status,
        stdout=result.stdout,
        stderr=result.stderr,
    )


def timeout_error(timeout: float, result: object) -> TimeoutError:
    """The TimeoutError Inspect expects, carrying the output the command wrote before it was killed."""
    error = TimeoutError(f"Command timed out after {timeout:g} seconds")
    if isinstance(result, GuestResult):
        partial = result.stdout + result.stderr
        if partial:
            error.truncated_output = partial  # type: ignore[attr-defined]
    return error


# -- files -------------------------------------------------------------------------------------------------------


def os_error(exc: GuestOSError, path: str) -> OSError:
    """A guest's OS error as the host exception Inspect's file methods document, naming Inspect's ``path``."""
    code = exc.errno
    if code == errno.ENOENT:
        return FileNotFoundError(code, "No such file or directory", path)
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return PermissionError(code, "Permission denied", path)
    if code == errno.EISDIR:
        return IsADirectoryError(code, "Is a directory", path)
    if code == errno.ENOTDIR:
        return NotADirectoryError(code, "Not a directory", path)
    return OSError(code, exc.strerror, path)


def read_limit_error() -> OutputLimitExceededError:
    """The error for a file larger than Inspect's read limit (the contents are not included)."""
    return OutputLimitExceededError(limit_str=SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR, truncated_output=None)


def decode_text(data: bytes) -> str:
    """UTF-8 text with its newlines as they are (``\\r\\n`` stays); UnicodeDecodeError if it is not UTF-8."""
    return data.decode("utf-8")
