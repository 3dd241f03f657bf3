"""The in-sandbox call being served: which sandbox, as which user, and whether its client is still there.

The gate in :mod:`pytest_forkd.e2b.app` checks the call (token, sandbox,
auto-resume) before any service runs and sets :data:`CURRENT`; the envd
services and HTTP routes read it instead of parsing the headers again. A
context variable, because the Connect runtime calls the services from the
request's own task (and copies the context into the tasks it starts).
"""

from __future__ import annotations

import asyncio
import contextvars
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pytest_forkd.e2b.api_errors import ApiError

if TYPE_CHECKING:
    from pytest_forkd.e2b.registry import SandboxRegistry
    from pytest_forkd.e2b.sandbox import Sandbox


@dataclass
class CallScope:
    sandbox: Sandbox
    user: str | None
    """The user the call runs as: the one it names (basic auth), else the sandbox's default, E2B's ``user``.

    None only in a template where ``user`` could not be made: then the image's own user (root in forkd's image).
    """
    disconnected: asyncio.Event
    """Set when the client goes away, so a stream ends at once instead of at its next message."""
    registry: SandboxRegistry
    keepalive_s: float | None = None
    """Seconds between keepalive events on a stream (the SDK's ``Keepalive-Ping-Interval``), None: none."""


CURRENT: contextvars.ContextVar[CallScope] = contextvars.ContextVar("e2b_call_scope")


def current() -> CallScope:
    try:
        return CURRENT.get()
    except LookupError:
        raise ApiError(500, "an in-sandbox call reached a service without passing the gate") from None


def user_home(user: str | None) -> str:
    """The home of ``user`` (where its relative paths start): E2B's /home/user for ``user`` and for None."""
    if user is None or user == "user":
        return "/home/user"
    if user == "root":
        return "/root"
    return f"/home/{user}"
