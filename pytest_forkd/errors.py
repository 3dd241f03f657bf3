"""One exception hierarchy for everything pytest-forkd raises.

Every error is a :class:`ForkdError`, so callers can catch the whole family,
and every message says what was wrong and how to fix it.
"""

from __future__ import annotations


class ForkdError(Exception):
    """Base class of every error raised by pytest-forkd."""


class ConfigError(ForkdError):
    """A recipe, forkd.yaml or option is malformed; the message names the field path."""


class InvalidTagError(ConfigError):
    """A snapshot or image name does not match ``^[A-Za-z0-9_-]{1,64}$``."""


class HostNotReady(ForkdError):
    """The host lacks something pytest-forkd needs (QEMU binary, /dev/shm space...)."""


class ImageError(ForkdError):
    """A guest image is unknown or could not be built."""


class UnknownImage(ImageError):
    """No image of that name has been built."""


class VMError(ForkdError):
    """A VM could not be started, or misbehaved."""


class VMStartError(VMError):
    """QEMU did not come up (no QMP socket, no agent connection) within its deadline."""


class GuestCrashed(VMError):
    """The guest panicked, powered off or its QEMU died; carries the console tail."""

    def __init__(self, message: str, console_tail: str = "") -> None:
        self.console_tail = console_tail
        if console_tail:
            message = f"{message}\n--- last lines of the guest console ---\n{console_tail}"
        super().__init__(message)


class AgentError(VMError):
    """The guest agent answered with an error (bad path, protocol mismatch...)."""


class ExecError(ForkdError):
    """A guest command failed and ``check=True`` was given."""

    def __init__(self, message: str, result: object = None) -> None:
        self.result = result
        super().__init__(message)


class ExecTimeout(ExecError):
    """A guest command exceeded its timeout; its process group was killed.

    ``result`` holds the partial output captured before the kill.
    """


class SnapshotError(ForkdError):
    """A snapshot is unknown, incompatible, incomplete or could not be taken."""


class UnknownSnapshot(SnapshotError):
    """No snapshot with that tag exists in the store."""


class IncompatibleSnapshot(SnapshotError):
    """A snapshot was taken with another engine or image than the current one."""


class BackendError(ForkdError):
    """A storage backend is unknown or unavailable on this host."""
