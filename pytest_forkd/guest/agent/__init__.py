"""The guest agent: runs commands and moves files for the host over one byte stream.

It runs inside the guest as the package ``/opt/forkd/agent``, next to
``wire.py`` which defines the protocol (read its docstring first) and
``tarstream.py``, with the Python standard library only: /init imports it,
so that its byte-compiled form is used, and calls :func:`main` with the port
device (``/dev/vportNpM``) as argument. On the host the same code runs over a
socketpair for tests: ``Agent(fd, fd).serve_forever()`` in a thread, or
``python3 -m pytest_forkd.guest.agent --stdio`` (or ``python3 DIR/agent
--stdio`` on a copy as the guest has it) with the channel on stdin and stdout.

One reader thread decodes requests and answers pings itself (they only read
clocks); a spawn goes to the one thread that starts and follows every spawned
process (a vfork and an exec: short); every other complete request is handled
in its own thread, so a long command never delays a ping; every frame is
written under one lock. The agent
never dies on a bad request: it answers with an error, logs to stderr (the
guest console) and keeps serving.

Commands run in their own session and, in the guest, their own cgroup v2
(see :class:`CommandCgroups`): the agent itself is exempt from the
out-of-memory killer and each command is its preferred victim, so an OOM or a
fork bomb ends the command, not the agent, and a timeout kills the whole
cgroup. Output streams to the host as it is produced, within a credit window
(see ``exec`` in wire.py), so the agent holds a bounded amount of it whatever
a command prints. A command is finished when its first process exits: output
that its background processes write afterwards is drained and discarded, and
they keep running, so ``server &`` does not block the exec until its timeout.

The parts, each importing only those listed before it:

* ``common``: limits, request errors, field parsing, frame writing;
* ``streams``: output within the host's credit, and the bounded buffers behind it;
* ``files``: request payloads (in memory, an upload beside its destination or into it as a user, a tar stream
  unpacked as it arrives);
* ``terminal``: pseudo-terminals and terminal signals;
* ``cgroups``: a cgroup per command, and the agent kept out of the OOM killer's reach;
* ``users``: the container image the agent may serve in (its config) and the users commands run as;
* ``launch``: starting a command as its user, in its cgroup, with one program start;
* ``commands``: running one command to its end (``exec``);
* ``processes``: processes started by ``spawn``, which outlive their request, and the one thread that follows them;
* ``server``: the protocol loop, request dispatch, cancel, and :func:`main`.

Imports are limited to what the protocol needs: under TCG every module costs.
Nothing here may import outside the standard library but ``wire`` and
``tarstream`` (the guest has nothing else); the ``try`` around those imports
is what lets the same files run as ``pytest_forkd.guest.agent`` on the host
and as the top-level ``agent`` in the guest.
"""

from __future__ import annotations

from .cgroups import CommandCgroups, protect_from_oom_killer
from .common import (
    AGENT_MEMORY_RESERVE,
    AGENT_TAIL_LIMIT,
    CANCEL_WAIT,
    CGROUP_ROOT,
    COMMAND_OOM_SCORE_ADJ,
    COMMAND_PIDS_MAX,
    CREDIT_STALL_TIMEOUT,
    KILL_WAIT,
    MAX_OUTPUT_WINDOW,
    MIN_COMMAND_MEMORY,
    OUTPUT_DRAIN_AFTER_EXIT,
    RECONNECT_POLL_INTERVAL,
    RequestError,
    log_to_stderr,
    mix_into_urandom,
    set_wall_clock,
)
from .server import Agent, main

# Parts that tests drive on their own (explicitly re-exported; not in __all__).
from .streams import _LiveBuffer as _LiveBuffer
from .terminal import _unignore_terminal_signals as _unignore_terminal_signals

__all__ = [
    "AGENT_MEMORY_RESERVE",
    "AGENT_TAIL_LIMIT",
    "CANCEL_WAIT",
    "CGROUP_ROOT",
    "COMMAND_OOM_SCORE_ADJ",
    "COMMAND_PIDS_MAX",
    "CREDIT_STALL_TIMEOUT",
    "KILL_WAIT",
    "MAX_OUTPUT_WINDOW",
    "MIN_COMMAND_MEMORY",
    "OUTPUT_DRAIN_AFTER_EXIT",
    "RECONNECT_POLL_INTERVAL",
    "Agent",
    "CommandCgroups",
    "RequestError",
    "log_to_stderr",
    "main",
    "mix_into_urandom",
    "protect_from_oom_killer",
    "set_wall_clock",
]
