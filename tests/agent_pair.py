"""The real guest agent served in this process over a socketpair, for unit tests of the wire protocol.

The agent writes its replies to a plain fd number, as it does to the guest's
virtio port. A request thread that outlives the test (a command the test left
running, a cancel it never confirmed) would write its late reply to that number
after the socket was closed, into whatever file the next test opened under it
(a ``git`` pipe, once). So the guest end is closed only when every thread
started with the agent has ended; one that has not is kept open (parked) for
the rest of the session rather than handing its number to someone else.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from pytest_forkd.guest.agent import Agent

_PARKED: list[socket.socket] = []
"""Guest ends an agent thread may still write to: open until the session ends, so their numbers stay taken."""


class AgentPair:
    """An agent serving ``guest_end`` in a thread; the test talks to it through ``host_end``."""

    def __init__(self, **options: Any) -> None:
        self.host_end, self.guest_end = socket.socketpair()
        self._before = set(threading.enumerate())
        quiet: dict[str, Any] = {
            "set_clock": lambda seconds: None,
            "reseed": lambda seed: None,
            "log": lambda line: None,
        }
        self.agent = Agent(self.guest_end.fileno(), self.guest_end.fileno(), **{**quiet, **options})
        self.thread = threading.Thread(target=self.agent.serve_forever, name="agent-serve", daemon=True)
        self.thread.start()

    def close(self, timeout: float = 3.0) -> bool:
        """Hang up as the host and wait for the agent's threads; True if all of them ended in ``timeout``.

        The guest end is closed when they did, and parked when they did not: parking is always
        safe, so ``timeout`` only trades a test's teardown time against an fd held until the end.
        (The output pump of a process whose output nobody read lives on by design: a later host
        could attach to it.)
        """
        self.host_end.close()
        deadline = time.monotonic() + timeout
        started = [thread for thread in threading.enumerate() if thread not in self._before]
        for thread in started:
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in started):
            _PARKED.append(self.guest_end)
            return False
        self.guest_end.close()
        return True

    def __enter__(self) -> AgentPair:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
