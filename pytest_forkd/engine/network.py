"""Guest networking policy: which network a VM has, independent of the engine that provides it.

A guest has no network unless it asks for one. Three modes:

``none``
    No network card at all (the default).
``host``
    A network card on a private network: the guest reaches nothing but the
    host ports listed in ``allow``, each at :data:`HOST_ADDRESS_RESTRICTED`:PORT,
    relayed to 127.0.0.1:PORT on the host.
``outbound``
    A network card on an unrestricted network: the guest reaches whatever the
    host can, and the host's loopback at :data:`HOST_ADDRESS_OUTBOUND`.

In every mode with a card, ports forwarded from the host's loopback reach
servers inside the guest. The guest's address is static (:data:`GUEST_ADDRESS`,
configured by the guest's init), so a child restored from a snapshot has the
parent's address.

The card is a device, so a child has one exactly when its parent had; the
policy (allowed ports, forwards) is rebuilt in every child. How an engine
provides it is its own business: :mod:`pytest_forkd.engine.qemu.network`
builds QEMU's user-mode network from a :class:`NetworkSpec`.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, Union

from pytest_forkd.errors import InvalidArgument, NetworkError

NetworkMode = Literal["none", "host", "outbound"]
MODES: Final[tuple[str, ...]] = ("none", "host", "outbound")

#: The guest's own static address on the user-mode network, and slirp's gateway and DNS.
GUEST_ADDRESS: Final = "10.0.2.15"
GATEWAY_ADDRESS: Final = "10.0.2.2"
#: Where a guest in ``outbound`` mode reaches the host's loopback (slirp maps the gateway to it).
HOST_ADDRESS_OUTBOUND: Final = GATEWAY_ADDRESS
#: Where a guest in ``host`` mode reaches the allowed host ports (a slirp guest-forwarding address).
HOST_ADDRESS_RESTRICTED: Final = "10.0.2.100"

#: How long VM.forward() waits for a guest port to listen before it says nothing does.
FORWARD_WAIT_S: Final = 10.0

_KEYS: Final = ("mode", "allow", "forward")

__all__ = ["MODES", "NetworkChoice", "NetworkError", "NetworkSpec", "child_network", "network_spec", "port_number"]


@dataclass(frozen=True)
class NetworkSpec:
    """What network a VM has: a mode, the host ports it may reach, guest ports forwarded at start."""

    mode: NetworkMode = "none"
    allow: tuple[int, ...] = ()
    """Host loopback ports the guest may reach in ``host`` mode."""
    forward: tuple[int, ...] = ()
    """Guest ports forwarded to free host loopback ports as soon as the VM runs."""

    @property
    def has_card(self) -> bool:
        """Whether the VM has a network card (a device, so parents and children must agree)."""
        return self.mode != "none"

    @property
    def host_address(self) -> str | None:
        """The address at which the guest reaches the host, or None without a network."""
        return {"host": HOST_ADDRESS_RESTRICTED, "outbound": HOST_ADDRESS_OUTBOUND}.get(self.mode)

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "allow": list(self.allow), "forward": list(self.forward)}

    def with_forward(self, ports: Iterable[int]) -> NetworkSpec:
        return NetworkSpec(self.mode, self.allow, tuple(sorted(set(ports))))

    def describe(self) -> str:
        """One line for listings: ``host (ports 8080 at 10.0.2.100), forwards guest ports 8000``."""
        text: str = self.mode
        if self.mode == "host":
            text = f"host (ports {', '.join(map(str, self.allow)) or 'none'} at {HOST_ADDRESS_RESTRICTED})"
        if self.forward:
            text += f", forwards guest ports {', '.join(map(str, self.forward))}"
        return text


#: What ``network=`` arguments accept: a mode name, allowed host ports, a mapping, a NetworkSpec or None.
NetworkChoice = Union[NetworkSpec, str, Sequence[int], Mapping[str, Any], None]


def free_host_port() -> int:
    """A TCP port on the host's loopback that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def port_number(value: object, what: str) -> int:
    """``value`` as a TCP port (1-65535), or InvalidArgument naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise InvalidArgument(f"{what} must be a TCP port number from 1 to 65535, got {value!r}")
    return value


def network_spec(value: NetworkChoice | object, what: str = "network") -> NetworkSpec:
    """Read a network choice: None, a mode name, a mapping, a list of host ports, or a NetworkSpec.

    Accepted forms (``what`` names the argument or forkd.yaml field in errors)::

        None / "none"                         no network card
        "outbound"                            reach whatever the host reaches
        "host" / [8080, 9000]                 reach only these host loopback ports
        {"mode": "host", "allow": [8080], "forward": [8000]}
    """
    if value is None:
        return NetworkSpec()
    if isinstance(value, NetworkSpec):
        return value
    if isinstance(value, str):
        return NetworkSpec(mode=_mode(value, what))
    if isinstance(value, (list, tuple)):
        return NetworkSpec(mode="host", allow=_ports(value, f"{what}"))
    if isinstance(value, Mapping):
        unknown = [key for key in value if key not in _KEYS]
        if unknown:
            raise InvalidArgument(f"{what}.{unknown[0]}: unknown key; valid keys: {', '.join(_KEYS)}")
        mode = _mode(value.get("mode", "host" if "allow" in value else "none"), f"{what}.mode")
        allow = _ports(value.get("allow", ()), f"{what}.allow")
        forward = _ports(value.get("forward", ()), f"{what}.forward")
        if allow and mode != "host":
            raise InvalidArgument(
                f"{what}.allow: only mode 'host' takes a list of allowed host ports "
                f"(mode {mode!r} {'has no network' if mode == 'none' else 'reaches every port'})"
            )
        if forward and mode == "none":
            raise InvalidArgument(
                f"{what}.forward: a VM without network cannot forward ports; choose mode 'host' or 'outbound'"
            )
        return NetworkSpec(mode=mode, allow=allow, forward=forward)
    raise InvalidArgument(
        f"{what} must be one of {', '.join(map(repr, MODES))}, a list of allowed host ports or a mapping "
        f"with keys {', '.join(_KEYS)}; got {value!r} ({type(value).__name__})"
    )


def check_card(source: str, recorded: NetworkSpec, wanted: NetworkSpec) -> None:
    """NetworkError unless a child of ``source`` (network ``recorded``) can have network ``wanted``.

    The network card is a device: a child has exactly its parent's devices.
    """
    if wanted.has_card == recorded.has_card:
        return
    if recorded.has_card:
        raise NetworkError(
            f"{source!r} has a network card, so its children have one too and cannot have network mode 'none'; "
            "fork with mode 'host' (no allowed ports isolates them) or 'outbound', or start from a VM booted "
            "without network"
        )
    raise NetworkError(
        f"{source!r} has no network card, so its children cannot have network mode {wanted.mode!r} (a child has "
        "exactly its parent's devices); boot the VM with network='host' or 'outbound' (or declare `network:` in "
        "forkd.yaml) and snapshot that one"
    )


def network_from_record(data: object) -> NetworkSpec:
    """The NetworkSpec a snapshot recorded (None: taken without network)."""
    return NetworkSpec() if data is None else network_spec(data, "snapshot network")


def child_network(source: str, recorded: object, choice: NetworkChoice | object = None) -> NetworkSpec:
    """The network of the children of ``source``, whose snapshot recorded network ``recorded``.

    Without ``choice`` it is the recorded one. ``choice`` (any form
    :func:`network_spec` takes) gives them another policy, checked against the
    recorded card (:func:`check_card`); the guest ports the snapshot forwarded
    stay forwarded unless ``choice`` lists its own (the guest's servers are
    still there).
    """
    if choice is None:
        return network_from_record(recorded)
    wanted = network_spec(choice)
    parent = network_from_record(recorded)
    check_card(source, parent, wanted)
    return wanted if wanted.forward else wanted.with_forward(parent.forward)


def _mode(value: object, what: str) -> NetworkMode:
    if value not in MODES:
        raise InvalidArgument(f"{what}: unknown network mode {value!r}; use one of {', '.join(map(repr, MODES))}")
    return value  # type: ignore[return-value]


def _ports(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise InvalidArgument(f"{what} must be a list of TCP port numbers, got {value!r}")
    return tuple(sorted({port_number(port, f"{what}[{index}]") for index, port in enumerate(value)}))


def listening_addresses(proc_net_tcp: str, port: int) -> set[str]:
    """Addresses on which ``port`` is in LISTEN state, from /proc/net/tcp and tcp6 text."""
    found = set()
    for line in proc_net_tcp.splitlines():
        fields = line.split()
        if len(fields) < 4 or fields[3] != "0A" or ":" not in fields[1]:
            continue
        address, _, port_hex = fields[1].rpartition(":")
        try:
            if int(port_hex, 16) != port:
                continue
            raw = bytes.fromhex(address)
        except ValueError:
            continue
        if len(raw) == 4:
            found.add(".".join(str(b) for b in raw[::-1]))
        elif len(raw) == 16:
            words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]
            packed = b"".join(words)
            found.add(str(ipaddress.IPv6Address(packed)))
    return found
