"""One exception hierarchy for everything pytest-forkd raises.

Every error is a :class:`ForkdError`, so callers can catch the whole family,
and every message says what was wrong and how to fix it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

_T = TypeVar("_T")


class ForkdError(Exception):
    """Base class of every error raised by pytest-forkd."""


class ConfigError(ForkdError):
    """A recipe, forkd.yaml or option is malformed; the message names the field path.

    A file or a set of options with several mistakes raises one ConfigError
    listing them all, one line each (see :class:`ConfigProblems`).
    """


def did_you_mean(word: object, choices: Iterable[str]) -> str:
    """``"did you mean 'snapshots'? "`` for the valid name closest to a misspelt ``word``, else ``""``.

    Put before the list of valid names: ``f"unknown key; {did_you_mean(key, keys)}valid keys: ..."``.
    """
    import difflib  # only when a mistake is reported

    if not isinstance(word, str):
        return ""
    valid = list(choices)
    lowered = {choice.lower(): choice for choice in valid}
    matches = difflib.get_close_matches(word.lower(), list(lowered), n=1)
    return f"did you mean {lowered[matches[0]]!r}? " if matches else ""


class ConfigProblems:
    """The mistakes of one file (or set of options), gathered so that one run reports every one of them.

    Each check runs in :meth:`collect` (or :meth:`attempt`), which records the
    ConfigError it raises and carries on; :meth:`raise_all` then raises one
    ConfigError whose message lists them all, one line each, in the order
    found (a single mistake is raised as it was, keeping its type).
    """

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._errors: list[ConfigError] = []

    def __bool__(self) -> bool:
        return bool(self.lines)

    def add(self, line: str) -> None:
        """Record a mistake described in one line (naming the file and field path)."""
        self.lines.append(line)
        self._errors.append(ConfigError(line))

    @contextmanager
    def collect(self) -> Iterator[None]:
        """Record the ConfigError the block raises, and go on after the block."""
        try:
            yield
        except ConfigError as exc:
            self.lines.extend(str(exc).splitlines() or [type(exc).__name__])
            self._errors.append(exc)

    def attempt(self, check: Callable[[], _T], fallback: _T) -> _T:
        """``check()``, or ``fallback`` when it raises a ConfigError (recorded)."""
        with self.collect():
            return check()
        return fallback

    def raise_all(self) -> None:
        """Raise the mistakes recorded, if any: the one as it was, or one ConfigError listing them all."""
        if len(self._errors) == 1:
            raise self._errors[0]
        if self.lines:
            raise ConfigError("\n".join(self.lines))


class IncomparableRuns(ConfigError):
    """Two benchmark runs differ in machine, accelerator, backend or QEMU version, and the comparison is strict."""


class InvalidArgument(ConfigError, ValueError):
    """An argument of a public call is out of range or malformed (memory, vCPUs, timeout, guest path...).

    Also a :class:`ValueError`, so code written against the standard exception still catches it.
    Raised before any QEMU process starts.
    """


class InvalidTagError(InvalidArgument):
    """A snapshot or image name does not match ``^[A-Za-z0-9_-]{1,64}$``."""


class WaitTimeout(ForkdError, TimeoutError):
    """Something forkd waited for (:func:`pytest_forkd.waiting.poll_until`) did not happen before the deadline.

    Also a :class:`TimeoutError`. ``last_error`` is the exception the last
    attempt raised, when the wait retried on errors.
    """

    last_error: BaseException | None = None


class HostNotReady(ForkdError):
    """The host lacks something pytest-forkd needs (QEMU binary, /dev/shm space...)."""


class ImageError(ForkdError):
    """A guest image is unknown or could not be built."""


class UnknownImage(ImageError):
    """No image of that name has been built."""


class ImageNotPulled(UnknownImage):
    """A container image is not in the local store and the pull policy (``never``) forbids fetching it."""


class ImageNotFound(ImageError):
    """A registry has no such repository or tag, or a local image file or layout does not exist."""


class RegistryAuthRequired(ImageError):
    """A registry wants credentials that were not found or were refused; the message says how to log in."""


class RegistryUnreachable(ImageError):
    """A registry did not answer (name lookup, connection, TLS); the message names it."""


class NoMatchingPlatform(ImageError):
    """An image has no linux/amd64 variant; ``platforms`` lists the ones it offers."""

    def __init__(self, message: str, *, platforms: list[str] | None = None) -> None:
        self.platforms = list(platforms or [])
        super().__init__(message)


class DigestMismatch(ImageError):
    """A blob's content does not match its digest (a tampered or corrupted layer); the message names the digest."""


class ImageStoreFull(ImageError):
    """The disk filled up while an image was pulled, built or unpacked; the message names the folder."""


class LayerError(ImageError):
    """A layer is not a readable tar stream (corrupt, truncated, or of a kind forkd does not read)."""


class HostileLayer(LayerError):
    """A layer has an entry that would reach outside the image root, or that no image needs; it names the entry."""


class ImageBuildError(ImageError):
    """A Dockerfile failed to build (the message ends with the builder's last lines), or no builder is installed."""


class ImageToolMissing(ImageError, HostNotReady):
    """A program container images need (skopeo, a builder) is not installed; the message names the package."""


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


class NetworkError(VMError):
    """A guest network request cannot be met: the VM has no network, nothing listens on a port, no free port."""


class AgentError(VMError):
    """The guest agent answered with an error (bad path, protocol mismatch...)."""


class CopyError(ForkdError):
    """A file or tree could not be copied into or out of a guest.

    A path that does not exist, a file where a directory is expected (or the
    reverse), no space left in the guest, a guest that stopped sending.
    ``path`` names the path at fault (on the host or in the guest, as the
    message says) and ``errno`` the OS error number when there was one
    (compare with the :mod:`errno` constants). The VM stays usable.
    """

    def __init__(self, message: str, *, path: str | None = None, errno: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.errno = errno


class UnsafeArchive(CopyError):
    """The guest sent an archive that must not be unpacked on the host, and nothing more of it was.

    An absolute member name or one with ``..``, a member below a symbolic
    link, a hard link, a device file, more data or members than the copy
    allows: ``path`` is the member's name as the guest sent it.
    """


class GuestProtocolError(VMError):
    """The guest broke the agent protocol (malformed or oversized frames, replies nobody asked for).

    Raised to the calls of a channel that was cut off because its guest kept
    misbehaving past a budget, or whose reply reader stopped; the message
    says what the guest sent. A guest whose agent was replaced or damaged by
    the commands it ran shows up like this: start a fresh VM.
    """


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


class DamagedSnapshot(SnapshotError):
    """A stored snapshot's files do not match their record (missing, truncated, changed).

    ``tag`` names the snapshot and ``problems`` lists what is wrong, one sentence per file.
    """

    def __init__(self, message: str, *, tag: str = "", problems: list[str] | None = None) -> None:
        self.tag = tag
        self.problems = list(problems or [])
        super().__init__(message)


class IncompatibleSnapshot(SnapshotError):
    """A snapshot was taken with another engine or image than the current one."""


class ArchiveError(SnapshotError):
    """A snapshot archive is corrupt, truncated, of a newer format, or cannot be written or read."""


class BackendError(ForkdError):
    """A storage backend is unknown or unavailable on this host."""


class WrongEventLoop(ForkdError):
    """An asyncio handle (AsyncVM...) was used outside the event loop it belongs to."""


class ChangesError(ForkdError):
    """Filesystem changes cannot be computed: a point from another VM lineage, a filter matching nothing."""


class TranscriptError(ForkdError):
    """A transcript file is unreadable, from another format version, or lacks what is asked of it."""


class BisectError(ForkdError):
    """A bisection cannot proceed: the predicate raised, or a step could not be replayed."""


class ProcessError(AgentError):
    """A spawned guest process cannot be reached: it ended and its result was taken, its stdin is closed..."""


class CommandNotFound(ProcessError):
    """The program of a command to spawn does not exist in the guest (the message names it)."""


class NoSuchProcess(ProcessError):
    """No process with that pid was spawned in this guest (or it ended and its result was taken)."""


class ProcessTimeout(ExecTimeout, TimeoutError):
    """``GuestProcess.wait(timeout)`` ran out; unlike an exec timeout, the process keeps running."""
