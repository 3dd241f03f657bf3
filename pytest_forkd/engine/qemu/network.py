"""QEMU user-mode (slirp) networking for a :class:`~pytest_forkd.engine.network.NetworkSpec`.

The policy (modes, allowed host ports, forwards) lives in
:mod:`pytest_forkd.engine.network`; this module turns it into QEMU arguments
and HMP commands. ``host`` mode is a user-mode network with ``restrict=on``
whose only way out is a ``guestfwd`` relay per allowed host port; forwards
are ``hostfwd_add`` commands sent through QMP's ``human-monitor-command``.

Why the card and the policy are kept apart: the card is a device, and a
child must be restored with exactly its parent's device set (the device-state
stream of a VM with a card does not load into one without, nor the other
way round); it is part of :class:`~pytest_forkd.engine.qemu.machine.MachineSpec`.
The policy (``restrict``, the allowed ports, the forwards) is configuration
of the user-mode network stack, which lives in each QEMU process and is
rebuilt in every child. (Measured on QEMU 7.2: the stack's own saved state
travels with the device state and loads into a child whose stack has other
options, restricted or not, with other guest forwards. Listening sockets
carry over; a host client's open connection stays with the parent, and the
child's copy of the guest socket has no peer on the host.)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Final

from pytest_forkd.engine.network import (  # the policy, re-exported (see __all__) for existing importers
    FORWARD_WAIT_S,
    GATEWAY_ADDRESS,
    GUEST_ADDRESS,
    HOST_ADDRESS_OUTBOUND,
    HOST_ADDRESS_RESTRICTED,
    MODES,
    NetworkChoice,
    NetworkError,
    NetworkMode,
    NetworkSpec,
    check_card,
    free_host_port,
    listening_addresses,
    network_from_record,
    network_spec,
    port_number,
)

__all__ = [
    "FORWARD_WAIT_S",
    "GATEWAY_ADDRESS",
    "GUEST_ADDRESS",
    "HOST_ADDRESS_OUTBOUND",
    "HOST_ADDRESS_RESTRICTED",
    "MODES",
    "NETDEV_ID",
    "RELAY_SCRIPT",
    "NetworkChoice",
    "NetworkError",
    "NetworkMode",
    "NetworkSpec",
    "check_card",
    "device_args",
    "free_host_port",
    "hostfwd_command",
    "hostfwd_remove_command",
    "listening_addresses",
    "netdev_args",
    "network_from_record",
    "network_spec",
    "port_number",
]

#: QEMU's id of the user-mode network backend, used by hostfwd_add.
NETDEV_ID: Final = "forkd-net"
#: The relay run for each guest connection to an allowed host port (stdin/stdout are the connection).
RELAY_SCRIPT: Final = Path(__file__).with_name("relay.py")


def device_args(spec: NetworkSpec) -> list[str]:
    """The network card: identical in a parent and its children (part of the machine)."""
    if not spec.has_card:
        return []
    return ["-device", f"virtio-net-device,netdev={NETDEV_ID}"]


def netdev_args(spec: NetworkSpec, python: str | None = None) -> list[str]:
    """The user-mode network stack behind the card: policy, rebuilt in every QEMU process."""
    if not spec.has_card:
        return []
    options = [f"user,id={NETDEV_ID}", "net=10.0.2.0/24", f"host={GATEWAY_ADDRESS}", "ipv6=off"]
    if spec.mode == "host":
        options.append("restrict=on")
        relay = f"{_escape(python or sys.executable)} -I -S {_escape(str(RELAY_SCRIPT))}"
        for port in spec.allow:
            options.append(f"guestfwd=tcp:{HOST_ADDRESS_RESTRICTED}:{port}-cmd:{relay} {port}")
    return ["-netdev", ",".join(options)]


def hostfwd_command(host_port: int, guest_port: int) -> str:
    """The HMP command that forwards 127.0.0.1:host_port on the host to the guest's guest_port."""
    return f"hostfwd_add {NETDEV_ID} tcp:127.0.0.1:{host_port}-{GUEST_ADDRESS}:{guest_port}"


def hostfwd_remove_command(host_port: int) -> str:
    """The HMP command that removes the forward of 127.0.0.1:host_port."""
    return f"hostfwd_remove {NETDEV_ID} tcp:127.0.0.1:{host_port}"


def _escape(text: str) -> str:
    """A value inside a QEMU option list: commas are doubled; spaces would split the relay's argv."""
    if " " in text:
        raise NetworkError(
            f"the path {text!r} contains a space, which QEMU's guestfwd command cannot carry; "
            "install pytest-forkd (and its Python) under a path without spaces"
        )
    return text.replace(",", ",,")
