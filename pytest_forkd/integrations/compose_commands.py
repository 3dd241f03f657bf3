"""A compose service's main process, as Docker starts it: ``entrypoint`` and ``command``, and its ``healthcheck``.

Docker runs one process per container: the entrypoint followed by the
command, each the service's own or else the image's (``ENTRYPOINT``,
``CMD``), with Compose's rules:

- ``entrypoint:`` replaces the image's ENTRYPOINT and drops its CMD;
  ``command:`` replaces the CMD. ``null`` (or no key) keeps the image's,
  ``[]`` or ``""`` makes it empty.
- A list is an argv (exec form). A string is split into words as Compose
  splits it (quotes and backslashes, no shell, no variables). A shell form
  written in a Dockerfile (``CMD python3 -m http.server``) is in the image
  config already as ``/bin/sh -c "..."``.
- ``healthcheck.test``: ``[CMD, args...]`` runs the argv, ``[CMD-SHELL,
  text]`` or a string runs ``/bin/sh -c text``, ``[NONE]`` or ``disable:
  true`` turns it off; durations are Go's (``30s``, ``1m30s``, ``500ms``).

forkd runs that process in the parent VM before its snapshot (see
:mod:`.service_process`), so every sample's VM starts with it running: the
way to start a server once. :class:`ServiceProcess` is the plain data of it;
the image's part is only known once the image is pulled, so
:meth:`ServiceProcess.argv` joins the two then. An image whose own
ENTRYPOINT/CMD is only an interactive shell or interpreter (``bash``,
``sh``, ``python3``: what base images ship, meant for ``docker run -it``) is
not started when the service names neither: it would only wait for a
terminal.
"""

from __future__ import annotations

import math
import posixpath
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from pytest_forkd.integrations.compose_errors import Where, shown
from pytest_forkd.integrations.compose_yaml import compose_boolean

__all__ = ["Healthcheck", "ServiceProcess", "parse_duration", "service_process"]

#: Docker's healthcheck defaults (``docker inspect`` of a container without them).
DEFAULT_INTERVAL_S: Final = 30.0
DEFAULT_TIMEOUT_S: Final = 30.0
DEFAULT_RETRIES: Final = 3
DEFAULT_START_INTERVAL_S: Final = 5.0
HEALTHCHECK_KEYS: Final = frozenset(
    {"test", "interval", "timeout", "retries", "start_period", "start_interval", "disable"}
)
#: Programs that, run without a script, only read a terminal: an image's CMD of one of these is not started.
INTERACTIVE_PROGRAMS: Final = re.compile(
    r"(?:sh|bash|dash|ash|zsh|ksh|mksh|fish|csh|tcsh|busybox|python[0-9.]*|ipython[0-9.]*|node|nodejs|irb|jshell|ghci)"
)

_DURATION_UNITS: Final = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_PART: Final = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


@dataclass(frozen=True)
class Healthcheck:
    """``healthcheck:`` of a service: a command that exits 0 once the main process is ready."""

    test: tuple[str, ...]
    """The argv run in the guest (``CMD-SHELL`` text as ``/bin/sh -c TEXT``)."""
    interval_s: float = DEFAULT_INTERVAL_S
    timeout_s: float = DEFAULT_TIMEOUT_S
    retries: int = DEFAULT_RETRIES
    start_period_s: float = 0.0
    start_interval_s: float = DEFAULT_START_INTERVAL_S

    @property
    def deadline_s(self) -> float:
        """How long ``docker compose up --wait`` may wait for it (start period, then every retry), as Inspect
        estimates it: past that the service counts as unhealthy."""
        grace = self.timeout_s if self.start_period_s > 0 else 0.0
        return self.start_period_s + grace + self.retries * (self.interval_s + self.timeout_s)


@dataclass(frozen=True)
class ServiceProcess:
    """The main process a compose service asks for, before the image's ENTRYPOINT and CMD are known."""

    entrypoint: tuple[str, ...] | None = None
    """``entrypoint:`` as an argv; None: the image's; ``()``: none."""
    command: tuple[str, ...] | None = None
    """``command:`` as an argv; None: the image's CMD (none when ``entrypoint`` is set); ``()``: none."""
    interactive: bool = False
    """``tty`` or ``stdin_open``: the process gets a terminal for stdin, as ``docker run -it`` gives it."""
    healthcheck: Healthcheck | None = None

    def argv(self, image_entrypoint: Sequence[str], image_cmd: Sequence[str]) -> tuple[str, ...]:
        """The process Docker would start, given the image's ENTRYPOINT and CMD; ``()``: nothing to start."""
        entrypoint = self.entrypoint if self.entrypoint is not None else tuple(image_entrypoint)
        if self.command is not None:
            command = self.command
        elif self.entrypoint is not None:
            command = ()  # an entrypoint set in the compose file drops the image's CMD, as Compose does
        else:
            command = tuple(image_cmd)
        argv = (*entrypoint, *command)
        if self.entrypoint is None and self.command is None and not self.interactive and only_a_terminal(argv):
            return ()
        return argv

    def describe(self) -> dict[str, object]:
        """What the process is, as plain JSON (part of the snapshot's recipe: a change rebuilds it)."""
        health = self.healthcheck
        return {
            "entrypoint": None if self.entrypoint is None else list(self.entrypoint),
            "command": None if self.command is None else list(self.command),
            "interactive": self.interactive,
            "healthcheck": None
            if health is None
            else {
                "test": list(health.test),
                "interval_s": health.interval_s,
                "timeout_s": health.timeout_s,
                "retries": health.retries,
                "start_period_s": health.start_period_s,
                "start_interval_s": health.start_interval_s,
            },
        }


def only_a_terminal(argv: Sequence[str]) -> bool:
    """Whether ``argv`` is a shell or interpreter with options only (``bash``, ``/bin/sh``, ``python3 -i``)."""
    if not argv:
        return False
    program = posixpath.basename(argv[0])
    return bool(INTERACTIVE_PROGRAMS.fullmatch(program)) and all(arg.startswith("-") for arg in argv[1:])


def service_process(body: Mapping[str, Any], where: Where, field_path: str, *, unhonoured: list[str]) -> ServiceProcess:
    """The main process a service ``body`` asks for (``entrypoint``, ``command``, ``healthcheck``, ``tty``)."""
    interactive = any(
        _flag(body.get(key), where, f"{field_path}.{key}") for key in ("tty", "stdin_open") if key in body
    )
    return ServiceProcess(
        entrypoint=_argv(body.get("entrypoint"), where, f"{field_path}.entrypoint"),
        command=_argv(body.get("command"), where, f"{field_path}.command"),
        interactive=interactive,
        healthcheck=_healthcheck(body.get("healthcheck"), where, f"{field_path}.healthcheck", unhonoured),
    )


def _argv(value: object, where: Where, field_path: str) -> tuple[str, ...] | None:
    """``command``/``entrypoint``: None when unset, a list as it is, a string split into words as Compose does."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return tuple(shlex.split(value))
        except ValueError as exc:
            raise where.error(field_path, f"cannot split {value!r} into words ({exc}); fix the quoting") from None
    if isinstance(value, list):
        words = []
        for index, item in enumerate(value):
            if isinstance(item, bool) or not isinstance(item, (str, int, float)):
                raise where.error(f"{field_path}[{index}]", f"expected a word (text), got {shown(item)}")
            words.append(str(item))
        if any("\0" in word for word in words):
            raise where.error(field_path, "a word contains a NUL character")
        return tuple(words)
    raise where.error(field_path, f"expected a list of words or a string, got {shown(value)}")


def _healthcheck(value: object, where: Where, field_path: str, unhonoured: list[str]) -> Healthcheck | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise where.error(field_path, f"expected a mapping (test, interval, timeout, retries...), got {shown(value)}")
    for key in value:
        if key not in HEALTHCHECK_KEYS and not str(key).startswith("x-"):
            raise where.error(
                f"{field_path}.{key}", f"unknown key; a healthcheck has {', '.join(sorted(HEALTHCHECK_KEYS))}"
            )
    if "disable" in value and _flag(value["disable"], where, f"{field_path}.disable"):
        return None
    test = value.get("test")
    if test is None:
        # Docker would run the image's own HEALTHCHECK with these timings; forkd does not read it.
        unhonoured.append("healthcheck without test (the image's HEALTHCHECK is not run)")
        return None
    argv = _test(test, where, f"{field_path}.test")
    if argv is None:
        return None
    retries = value.get("retries", DEFAULT_RETRIES)
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise where.error(f"{field_path}.retries", f"expected a whole number >= 0, got {shown(retries)}")
    return Healthcheck(
        test=argv,
        interval_s=_duration(value, "interval", DEFAULT_INTERVAL_S, where, field_path),
        timeout_s=_duration(value, "timeout", DEFAULT_TIMEOUT_S, where, field_path),
        retries=retries,
        start_period_s=_duration(value, "start_period", 0.0, where, field_path),
        start_interval_s=_duration(value, "start_interval", DEFAULT_START_INTERVAL_S, where, field_path),
    )


def _test(test: object, where: Where, field_path: str) -> tuple[str, ...] | None:
    """The argv of ``healthcheck.test``; None for ``[NONE]``."""
    if isinstance(test, str):
        if not test.strip():
            raise where.error(field_path, "an empty command; give one, or disable the healthcheck")
        return ("/bin/sh", "-c", test)
    if not isinstance(test, list) or not test or not all(isinstance(word, str) for word in test):
        raise where.error(field_path, f"expected [CMD, ...], [CMD-SHELL, text], [NONE] or a string, got {shown(test)}")
    kind, rest = test[0], test[1:]
    if kind == "NONE":
        return None
    if kind == "CMD" and rest:
        return tuple(rest)
    if kind == "CMD-SHELL" and len(rest) == 1:
        return ("/bin/sh", "-c", rest[0])
    raise where.error(field_path, f"expected [CMD, program, args...], [CMD-SHELL, text] or [NONE], got {shown(test)}")


def _duration(value: Mapping[str, Any], key: str, default: float, where: Where, field_path: str) -> float:
    if value.get(key) is None:
        return default
    seconds = parse_duration(value[key])
    if seconds is None:
        raise where.error(
            f"{field_path}.{key}", f"expected a duration such as 30s, 1m30s or 500ms, got {shown(value[key])}"
        )
    return seconds


def parse_duration(text: object) -> float | None:
    """A Go duration (``1m30s``, ``1.5s``, ``500ms``; ``0``) in seconds; None when ``text`` is not one."""
    if not isinstance(text, str):
        return None
    compact = "".join(text.split())
    if compact == "0":
        return 0.0
    position, total = 0, 0.0
    while position < len(compact):
        match = _DURATION_PART.match(compact, position)
        if match is None:
            return None
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        position = match.end()
    return total if position and math.isfinite(total) else None


def _flag(value: object, where: Where, field_path: str) -> bool:
    flag = compose_boolean(value)
    if flag is None:
        raise where.error(field_path, f"expected true or false, got {shown(value)}")
    return flag
