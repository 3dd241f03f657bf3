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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inspect_ai._util.error import PrerequisiteError
from inspect_ai.util import (
    ComposeConfig,
    ExecResult,
    OutputLimitExceededError,
    SandboxEnvironmentLimits,
    SandboxUserUnsupportedError,
)
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from pytest_forkd.errors import ConfigError, ForkdError, did_you_mean
from pytest_forkd.guest.client import GuestOSError
from pytest_forkd.guest.exec_result import ExecResult as GuestResult
from pytest_forkd.integrations.compose import (
    COMPOSE_FILES,
    DOCKERFILE,
    dockerfile_service,
    is_compose_file,
    is_dockerfile,
    load_compose,
    log_ignored,
    parse_compose,
)
from pytest_forkd.integrations.sessions import ImageGuest

if TYPE_CHECKING:
    from pydantic.functional_validators import ModelWrapValidatorHandler
    from pydantic_core import ErrorDetails
    from typing_extensions import Self

#: Where commands run and relative paths resolve when the snapshot names no ``workdir``
#: (the guest's init starts the agent in root's home).
DEFAULT_WORKDIR = "/root"
#: The config file Inspect finds next to a task when ``sandbox="forkd"`` names none.
CONFIG_FILE = "forkd.yaml"
#: What Inspect looks for next to a task, in this order: forkd's own file, then Docker's (forkd is docker-compatible).
CONFIG_FILES = [CONFIG_FILE, *COMPOSE_FILES, DOCKERFILE]
#: How Inspect's docker sandbox names sample metadata in a compose file (``${SAMPLE_METADATA_KEY}``).
METADATA_PREFIX = "SAMPLE_METADATA_"
#: Who runs a command when ``exec`` names no user: the guest agent's own user.
ROOT_USERS = frozenset({"root", "0"})
#: Prefix of what the guest agent writes when it cannot start a command (not the command's own output).
AGENT_EXEC_PREFIX = "forkd-exec: exec: "
#: The fields of :class:`ForkdSandboxConfig` a user writes (``session`` is set by the pytest plugin).
CONFIG_FIELDS = ("config", "snapshot")
#: How every line of a sandbox's error starts.
ERROR_PREFIX = "forkd sandbox: "


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

    @model_validator(mode="wrap")
    @classmethod
    def _every_mistake(cls, data: Any, handler: ModelWrapValidatorHandler[Self]) -> Self:
        """A config with mistakes fails with one line per mistake, each naming its field (pydantic's error still)."""
        try:
            return handler(data)
        except ValidationError as exc:
            raise ValueError("\n".join(_field_problems(exc.errors()))) from None


def _field_problems(errors: list[ErrorDetails]) -> list[str]:
    """One line per mistake pydantic found: the field, what is wrong, the key a misspelt one most likely meant."""
    lines = []
    for error in errors:
        field = ".".join(str(part) for part in error["loc"])
        where = f"{ERROR_PREFIX}config.{field}" if field else f"{ERROR_PREFIX}config"
        if error["type"] == "extra_forbidden":
            lines.append(
                f"{where}: unknown key; {did_you_mean(field, CONFIG_FIELDS)}valid keys: {', '.join(CONFIG_FIELDS)}"
            )
        else:
            lines.append(f"{where}: {error['msg'][:1].lower()}{error['msg'][1:]}, got {error['input']!r}")
    return lines


def config_problems(exc: ValidationError) -> str:
    """The lines a :class:`ForkdSandboxConfig` that failed validation reports, one per mistake."""
    lines = []
    for error in exc.errors():
        cause = (error.get("ctx") or {}).get("error")
        if error["type"] == "value_error" and str(cause).startswith(ERROR_PREFIX):
            lines += str(cause).splitlines()
        else:
            lines += _field_problems([error])
    return "\n".join(lines)


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

    A bad config or an unknown snapshot is one line (a forkd.yaml with several
    mistakes, one line for each); a snapshot whose setup failed also shows the
    failing command's output.
    """
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, ConfigError):
        return ForkdSandboxError("\n".join(ERROR_PREFIX + line for line in text.splitlines()))
    return ForkdSandboxError(ERROR_PREFIX + text)


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
        except ValidationError as exc:
            raise ForkdSandboxError(config_problems(exc)) from None
    raise ForkdSandboxError(
        f"forkd sandbox: config must be a forkd.yaml path or ForkdSandboxConfig, got {type(config).__name__}"
    )


def deserialize_config(data: dict[str, Any]) -> ForkdSandboxConfig:
    """:meth:`ForkdSandboxEnvironment.config_deserialize`: a config read back from an eval log."""
    try:
        return ForkdSandboxConfig.model_validate(data)
    except ValidationError as exc:
        raise ForkdSandboxError(config_problems(exc)) from None


def config_path(config: ForkdSandboxConfig, base: Path) -> Path | None:
    """The forkd.yaml a config names, absolute (relative names resolve against ``base``, the task's directory)."""
    if config.config is None:
        return None
    path = Path(os.path.expanduser(config.config))
    return path if path.is_absolute() else (base / path).absolute()


# -- container images --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImageSample:
    """What a sample of a compose file or Dockerfile config runs in: the image's guest, and its default user."""

    guest: ImageGuest
    user: str | None = None
    """``user:`` of the compose service (None: the image's ``User``)."""


def is_image_config(config: object) -> bool:
    """Whether a config names a container image as Docker would: a compose file, a Dockerfile, a ComposeConfig."""
    if isinstance(config, str):
        return is_compose_file(config) or is_dockerfile(config)
    return isinstance(config, ComposeConfig)


def image_sample(config: object, *, base: Path, environ: Mapping[str, str]) -> ImageSample:
    """The image sample a compose file, Dockerfile or ComposeConfig describes; ConfigError names what is wrong.

    Relative paths resolve against ``base`` (the task's directory);
    ``environ`` is what the compose file is interpolated with.
    """
    if isinstance(config, ComposeConfig):
        data = config.model_dump(by_alias=True, exclude_none=True)
        service = parse_compose(data, base=base, origin="ComposeConfig", environ=environ)
    elif isinstance(config, str) and is_compose_file(config):
        service = load_compose(base / os.path.expanduser(config), environ=environ)
    elif isinstance(config, str) and is_dockerfile(config):
        service = dockerfile_service(base / os.path.expanduser(config))
    else:
        raise ForkdSandboxError(f"forkd sandbox: config {config!r} names no compose file or Dockerfile")
    log_ignored(service)
    return ImageSample(guest=ImageGuest.of_service(service), user=service.user)


def metadata_environment(config: object, metadata: Mapping[str, object], *, base: Path) -> dict[str, str]:
    """``SAMPLE_METADATA_<KEY>`` for each metadata key a compose file mentions, as Inspect's docker sandbox does."""
    if not (isinstance(config, str) and is_compose_file(config)) or not metadata:
        return {}
    try:
        text = (base / os.path.expanduser(config)).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return {}
    variables = {f"{METADATA_PREFIX}{key.replace(' ', '_').upper()}": str(value) for key, value in metadata.items()}
    return {name: value for name, value in variables.items() if name in text}


# -- paths -------------------------------------------------------------------------------------------------------


def guest_path(path: str, workdir: str) -> str:
    """A path of Inspect's (relative to the sample's working directory) as an absolute guest path."""
    return path if posixpath.isabs(path) else posixpath.normpath(posixpath.join(workdir, path))


# -- exec --------------------------------------------------------------------------------------------------------


def is_root(user: str | None) -> bool:
    return user is None or user in ROOT_USERS


def guest_user(user: str | None) -> str | None:
    """A user as the guest agent takes it: ``root`` as uid 0, which needs no /etc/passwd entry."""
    return "0" if user == "root" else user


#: What the guest agent says when a user is not in the image's /etc/passwd (or a group not in /etc/group).
UNKNOWN_USER = ("unable to find user", "unable to find group")


def user_error(user: str, error: Exception) -> SandboxUserUnsupportedError | None:
    """The error Inspect documents for a command the guest could not run as ``user``; None for other errors."""
    text = str(error)
    if any(marker in text for marker in UNKNOWN_USER) or text.startswith("user must be"):
        return SandboxUserUnsupportedError(
            f"forkd sandbox: the guest has no user {user!r} (no such entry in its /etc/passwd); add the user "
            "to the image (or in the setup of the snapshot in forkd.yaml), or run as root (user='root')"
        )
    return None


#: Beyond this many bytes of JSON, an argv goes to the guest in a script file rather than in the request
#: (the agent protocol keeps a request's JSON under 1 MiB; the kernel takes 2 MiB of arguments).
LARGE_ARGV_BYTES = 256 << 10


def argv_too_large(argv: list[str]) -> bool:
    return len(json.dumps(argv)) > LARGE_ARGV_BYTES


def argv_script(argv: list[str]) -> str:
    """A shell script that runs ``argv`` (removing itself first): how a command too large for a request runs."""
    return 'rm -f -- "$0"\nset -- ' + " ".join(shlex.quote(arg) for arg in argv) + '\nexec "$@"\n'


def launch_error(argv: list[str], result: GuestResult) -> PermissionError | None:
    """PermissionError when the guest agent could not start ``argv[0]`` because it is not executable.

    The agent says so itself, in one line, whoever the command runs as.
    """
    stderr = result.stderr.strip()
    if (
        result.exit_code == 126
        and not result.stdout_bytes
        and stderr.startswith(f"{AGENT_EXEC_PREFIX}{argv[0]}: ")
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


#: Writes stdin to "$1" in place, making its folder first: ``write_file`` for a user other than root, as
#: Docker's sandbox writes (``mkdir -p`` and ``tee`` as the container's user), so the file's modes apply.
WRITE_AS_USER = 'd=${1%/*}; if [ -n "$d" ] && [ "$d" != "$1" ]; then mkdir -p -- "$d" || exit 1; fi; cat > "$1"'


#: Above this many bytes, ``write_file`` as another user streams the contents straight into the file through
#: the agent's own ``write_file`` as that user, rather than as the command's stdin, which the agent holds in memory.
STDIN_WRITE_LIMIT = 1 << 20


def write_as_user(path: str) -> list[str]:
    """The command that writes its stdin to ``path`` as the user it runs as."""
    return ["/bin/sh", "-c", WRITE_AS_USER, "forkd-write", path]


def read_as_user(path: str) -> list[str]:
    """The command that prints ``path`` as the user it runs as (its permissions apply)."""
    return ["cat", "--", path]


def file_error(stderr: str, path: str) -> OSError:
    """A failed ``write_as_user``/``read_as_user`` as the exception Inspect documents, naming Inspect's ``path``."""
    said = stderr.casefold()
    if "no such file" in said:
        return FileNotFoundError(errno.ENOENT, "No such file or directory", path)
    if "permission denied" in said or "read-only file system" in said:
        return PermissionError(errno.EACCES, "Permission denied", path)
    if "is a directory" in said:
        return IsADirectoryError(errno.EISDIR, "Is a directory", path)
    if "not a directory" in said:
        return NotADirectoryError(errno.ENOTDIR, "Not a directory", path)
    return OSError(errno.EIO, stderr.strip()[:500] or "the guest could not access the file", path)


def read_limit_error() -> OutputLimitExceededError:
    """The error for a file larger than Inspect's read limit (the contents are not included)."""
    return OutputLimitExceededError(limit_str=SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR, truncated_output=None)


def decode_text(data: bytes) -> str:
    """UTF-8 text with its newlines as they are (``\\r\\n`` stays); UnicodeDecodeError if it is not UTF-8."""
    return data.decode("utf-8")
