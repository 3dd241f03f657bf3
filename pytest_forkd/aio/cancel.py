"""Cancelling a request in the guest: the one place where the async layer reaches into AgentClient.

An awaited ``exec`` runs the ordinary blocking ``VM.exec`` in a worker thread
(see :mod:`pytest_forkd.aio.offload`). To kill its command when the awaiting
task is cancelled, the host must name the request to the agent's ``cancel``
operation (see :mod:`pytest_forkd.guest.wire`), and only the client knows the
ids it gives its requests. So a :class:`RequestTicket` learns the id as the
worker thread sends the request.

Coupling to :class:`~pytest_forkd.guest.client.AgentClient` internals, all of
it here: its instance method ``_send_message(fields, payload)`` (called once
per request, before any frame of it is written, with ``fields["id"]``) is
wrapped once per client, and the cancel request is sent with
``_request(request, wait=...)`` (or, in a client built on call objects,
``_start(call, request)`` and ``_wait(call, timeout)``). Everything else goes
through the public API.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import AgentError
from ..guest.client import AgentClient

T = TypeVar("T")

#: How long the host waits for the reply to a cancel request. The agent
#: answers once the command is killed and reaped (or after its own 5 s).
CANCEL_REPLY_TIMEOUT = 15.0

_current = threading.local()
_install_lock = threading.Lock()
_WRAPPED = "_forkd_request_tickets"


class Withdrawn(Exception):
    """The request was cancelled before it was sent; nothing of it reached the guest."""


class RequestTicket:
    """Learns which agent request one blocking call makes, so that it can be cancelled in the guest."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._target: tuple[AgentClient, int] | None = None
        self._withdrawn = False

    def run(self, client: AgentClient, call: Callable[[], T]) -> T:
        """Run ``call`` (which talks to ``client``) in this thread, noting the id of its first request."""
        _watch(client)
        with self._lock:
            if self._withdrawn:
                raise Withdrawn()
        _current.ticket = self
        try:
            return call()
        finally:
            _current.ticket = None

    def withdraw(self) -> tuple[AgentClient, int] | None:
        """Stop the call from sending; return ``(client, request id)`` if it already sent its request."""
        with self._lock:
            self._withdrawn = True
            return self._target

    def _sending(self, client: AgentClient, fields: dict[str, Any]) -> None:
        with self._lock:
            if self._target is not None:
                return  # only the call's first request is the one to cancel
            if self._withdrawn:
                raise Withdrawn()
            self._target = (client, fields["id"])


def _watch(client: AgentClient) -> None:
    """Wrap ``client._send_message`` once, so that tickets see the ids of the requests it sends."""
    with _install_lock:
        if getattr(client, _WRAPPED, False):
            return
        send_message = client._send_message

        def sending(fields: dict[str, Any], payload: bytes) -> None:
            ticket = getattr(_current, "ticket", None)
            if ticket is not None and "op" in fields:
                ticket._sending(client, fields)
            send_message(fields, payload)

        client._send_message = sending  # type: ignore[method-assign]
        setattr(client, _WRAPPED, True)


def cancel_request(client: AgentClient, request_id: int, timeout: float = CANCEL_REPLY_TIMEOUT) -> dict[str, Any]:
    """Ask the agent to stop request ``request_id``; returns its reply ``{found, finished}``.

    Raises AgentError when the agent does not know the operation (a guest
    image older than this pytest-forkd), and the client's errors when the
    guest does not answer.
    """
    request = {"op": "cancel", "target": request_id}
    fields: dict[str, Any]
    if hasattr(client, "_request"):
        fields, _ = client._request(request, wait=timeout)
    else:  # a client whose requests are call objects: start one for a small reply and wait for it
        from ..guest import client as client_module

        call = client_module._MessageCall("cancel", client_module.MAX_SMALL_REPLY)
        client._start(call, request)
        fields = client._wait(call, timeout)
    if "finished" not in fields:
        raise AgentError(f"the guest agent sent a malformed cancel reply {fields!r}; rebuild the guest image")
    return fields
