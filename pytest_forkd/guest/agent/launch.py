"""Starting a command as its user, in its own cgroup, as a preferred OOM victim: with one program start.

In an emulated guest every program start costs milliseconds, so a command
must not pay for helper programs that only prepare it. Two ways, each the
cheapest for its case:

- ``/bin/sh -c SCRIPT`` as root: the shell is started anyway, so the two
  root steps (join the cgroup, raise the OOM score) go in front of its
  script, as shell builtins on the script's first line (its line numbers
  stay right). Nothing runs before them.
- Anything else: the agent starts the program itself as the user
  (:func:`~.users.starting_as`: the ``vfork`` takes the thread's ids), then
  moves it into its cgroup and raises its OOM score from outside. Until the
  move the program runs in the agent's cgroup; whatever it forked meanwhile
  is found there by its session (every command leads a new one) and moved
  after it (:meth:`CommandCgroups.adopt`).
"""

from __future__ import annotations

import contextlib
import os
import signal

from .cgroups import set_oom_score
from .common import COMMAND_OOM_SCORE_ADJ, RequestError
from .users import starting_as

TYPE_CHECKING = False
if TYPE_CHECKING:
    import subprocess
    from collections.abc import Callable

    from .cgroups import CommandCgroups, _CommandGroup
    from .users import Credentials


def start_command(
    argv: list[str],
    start: Callable[[list[str]], subprocess.Popen[bytes]],
    *,
    group: _CommandGroup | None,
    cgroups: CommandCgroups | None,
    credentials: Credentials,
    oom_target: bool,
) -> subprocess.Popen[bytes]:
    """``start(argv)`` (a Popen in a new session) made to run as ``credentials``, in ``group``, as an OOM target.

    Raises what ``start`` raises (the program cannot be executed, the
    working directory cannot be entered, both as the user), PermissionError
    when the agent cannot switch to the user, and RequestError when the
    started process cannot be moved into its cgroup (it is killed then).
    """
    procs = os.fsdecode(group.procs) if group is not None else None
    if credentials.is_root and len(argv) == 3 and argv[:2] == ["/bin/sh", "-c"] and "'" not in (procs or ""):
        steps = f"echo 0 > '{procs}' || exit 125; " if procs is not None else ""
        if oom_target:
            steps += f"echo {COMMAND_OOM_SCORE_ADJ} > /proc/self/oom_score_adj; "
        return start(["/bin/sh", "-c", steps + argv[2]] if steps else argv)
    with starting_as(credentials):
        process = start(argv)
    try:
        if group is not None and cgroups is not None:
            cgroups.adopt(group, process.pid, COMMAND_OOM_SCORE_ADJ if oom_target else None)
        elif oom_target:
            set_oom_score(process.pid, COMMAND_OOM_SCORE_ADJ)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise RequestError("Internal", f"cannot move the command into its cgroup: {exc}") from exc
    return process
