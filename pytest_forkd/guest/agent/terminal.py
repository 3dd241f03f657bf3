"""Pseudo-terminals for commands that ask for one, and the signals a terminal sends."""

from __future__ import annotations

import fcntl
import os
import struct
import subprocess
import termios  # here, not where used: a terminal is opened while the thread is a command's user (see launch.py)

from .common import RequestError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def _terminal_size(fields: dict[str, Any]) -> tuple[int, int] | None:
    """``pty``: absent, false or null for pipes; true (24x80) or ``[rows, columns]`` for a terminal."""
    value = fields.get("pty")
    if value is None or value is False:
        return None
    if value is True:
        return (24, 80)
    if (
        isinstance(value, list)
        and len(value) == 2
        and all(type(number) is int and 0 < number < 65536 for number in value)
    ):
        return (value[0], value[1])
    raise RequestError("BadRequest", f"'pty' must be true or [rows, columns] between 1 and 65535, got {value!r}")


def _set_window_size(fd: int, size: tuple[int, int]) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", size[0], size[1], 0, 0))


def _take_terminal() -> None:
    """In the child, after setsid: make its stdin (the terminal) its controlling terminal."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _start_on_terminal(
    command: list[str], env: dict[str, str] | None, cwd: str | None, size: tuple[int, int]
) -> tuple[subprocess.Popen[bytes], int]:
    """Start ``command`` as a session leader on a new pseudo-terminal; return it and the terminal's master fd."""
    master, slave = os.openpty()
    try:
        _set_window_size(master, size)
        process = subprocess.Popen(
            command,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            cwd=cwd,
            env=env,
            start_new_session=True,
            preexec_fn=_take_terminal,
        )
    except BaseException:
        os.close(master)
        raise
    finally:
        os.close(slave)
    return process, master


def _unignore_terminal_signals() -> None:
    """Give the commands the agent runs the default reaction to Ctrl-C and Ctrl-\\.

    A signal ignored by a process stays ignored in every program it runs, and a
    shell cannot undo that; an agent started from the background of a script
    (SIGINT and SIGQUIT ignored) would run commands that a typed Ctrl-C does not
    stop. A handled signal is reset to its default by exec, so the agent handles
    them itself instead of ignoring them.
    """
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGQUIT) is signal.SIG_IGN:
        signal.signal(signal.SIGQUIT, lambda signum, frame: None)
