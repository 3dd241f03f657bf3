"""The fields of the agent's requests that carry user input, checked on the host before anything is sent.

``exec`` and ``spawn`` take a command (a shell line or an argv), its
environment, working directory, output cap, terminal and user; a mistake is
an exception here, naming the argument, rather than an error reply from the
guest. The channel (:class:`~pytest_forkd.guest.client.AgentClient`) sends
what these build; the core's VM validates the same arguments first for its
own messages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import InvalidArgument
from . import wire

#: Bytes of each output stream (stdout, stderr) an exec keeps by default.
DEFAULT_MAX_OUTPUT = wire.DEFAULT_MAX_OUTPUT


def exec_request(
    command: str | Sequence[str],
    *,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    max_output: int | None = DEFAULT_MAX_OUTPUT,
    pty: bool | tuple[int, int] = False,
    user: str | None = None,
) -> dict[str, Any]:
    """The fields of an exec request, checked; ``max_output`` None: the guest sends all output.

    ``user``: who runs it (``name``, ``uid``, ``name:group``, ``uid:gid``); None: the image's user.
    """
    request: dict[str, Any] = {"op": "exec", **_command_fields(command)}
    if pty:
        request["pty"] = terminal_size(pty)
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
        request["timeout"] = float(timeout)
    if env is not None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise TypeError("env must map str to str")
        request["env"] = dict(env)
    if cwd is not None:
        request["cwd"] = cwd
    if user is not None:
        request["user"] = user
    if max_output is not None:
        if isinstance(max_output, bool) or not isinstance(max_output, int) or max_output < 0:
            raise InvalidArgument(
                f"max_output must be a number of bytes >= 0, got {max_output!r}; pass e.g. 4 << 20 (4 MiB)"
            )
        request["max_output"] = max_output
    return request


def spawn_request(
    command: str | Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    max_output: int = DEFAULT_MAX_OUTPUT,
    pty: bool | tuple[int, int] = False,
    user: str | None = None,
    stdin: bool = True,
) -> dict[str, Any]:
    """The fields of a spawn request, checked: an exec request without timeout, whose process outlives it.

    ``stdin=False``: the process gets no stdin pipe and reads end-of-file at once (a terminal keeps its input).
    """
    request = exec_request(command, env=env, cwd=cwd, max_output=max_output, pty=pty, user=user)
    request["op"] = "spawn"
    if not stdin:
        request["stdin"] = False
    return request


def terminal_size(pty: bool | tuple[int, int] | Sequence[int]) -> bool | list[int]:
    """The ``pty`` field: True (the guest's default 24x80) or ``[rows, columns]``."""
    if pty is True:
        return True
    if (
        isinstance(pty, (tuple, list))
        and len(pty) == 2
        and all(type(number) is int and 0 < number < 65536 for number in pty)
    ):
        return [pty[0], pty[1]]
    raise InvalidArgument(f"pty must be True, False or (rows, columns) between 1 and 65535, got {pty!r}")


def _command_fields(command: str | Sequence[str]) -> dict[str, Any]:
    if isinstance(command, str):
        return {"shell": command}
    argv = list(command)
    if not argv or not all(isinstance(arg, str) for arg in argv):
        raise TypeError(f"command must be a shell string or a non-empty sequence of str, got {command!r}")
    return {"argv": argv}
