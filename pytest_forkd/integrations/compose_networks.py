"""A compose service's networks as a VM's network: outbound access exactly when Docker would give it.

A container reaches the outside through the networks it is attached to: with
``network_mode``, Docker's own (``none``: nothing; ``bridge``, ``host``:
everything the host reaches); otherwise through its ``networks:`` (the
project's ``default`` network when it names none), each defined under the
top-level ``networks:``. A network marked ``internal: true`` has no route out
(CTF-style evals rely on it), nor has a bridge whose masquerading is turned
off; any other network a container is attached to gives it one.

forkd's VM of the service gets the ``outbound`` network when at least one of
its networks reaches out, and no network card (so no default route) when
none does. Its loopback works either way, so a server the service starts on
127.0.0.1 answers the sample.

A network whose reach forkd cannot know is refused with one line, never
guessed wider: an ``external`` network (made outside the file) and a driver
other than Docker's own. Settings that change what the sample sees but that a
VM does not give (fixed addresses, IPv6, driver options) are reported as not
honoured; names, labels and aliases mean nothing with one service.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal

from pytest_forkd.integrations.compose_errors import Where, shown
from pytest_forkd.integrations.compose_yaml import compose_boolean

__all__ = ["DEFAULT_NETWORK", "NetworkMode", "check_networks", "service_network"]

NetworkMode = Literal["none", "outbound"]

#: The network Compose attaches a service to when it names none.
DEFAULT_NETWORK: Final = "default"
#: Docker's network drivers whose reach forkd knows: a route out unless internal (host: the host's own).
KNOWN_DRIVERS: Final = frozenset({"bridge", "overlay", "macvlan", "ipvlan", "host", "none"})
#: The keys of a top-level network definition (the compose specification's), by what forkd does with them.
NETWORK_NO_MEANING: Final = frozenset({"name", "labels", "attachable"})
NETWORK_NOT_HONOURED: Final = frozenset({"ipam", "enable_ipv6"})
NETWORK_READ: Final = frozenset({"driver", "driver_opts", "internal", "external", "enable_ipv4"})
#: The driver option that turns a bridge's outbound NAT off (a bridge without it reaches nothing outside).
MASQUERADE_OPTION: Final = "com.docker.network.bridge.enable_ip_masquerade"
#: The keys of a service's attachment to one network.
ATTACHMENT_NO_MEANING: Final = frozenset({"aliases", "priority", "gw_priority"})
ATTACHMENT_NOT_HONOURED: Final = frozenset(
    {"ipv4_address", "ipv6_address", "link_local_ips", "mac_address", "driver_opts", "interface_name"}
)


def check_networks(value: object, where: Where) -> Mapping[str, Any]:
    """The top-level ``networks:`` (each name's definition, None for Docker's defaults); ConfigError if malformed."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise where.error("networks", f"expected a mapping of network names, got {shown(value)}")
    for name, definition in value.items():
        if not isinstance(name, str) or not name:
            raise where.error("networks", f"expected a network name, got {shown(name)}")
        if definition is not None and not isinstance(definition, Mapping):
            raise where.error(f"networks.{name}", f"expected a mapping of network keys, got {shown(definition)}")
    return value


def service_network(
    body: Mapping[str, Any],
    networks: Mapping[str, Any],
    where: Where,
    field_path: str,
    *,
    ignored: list[str],
    unhonoured: list[str],
) -> NetworkMode:
    """The VM's network for a service ``body`` (at ``field_path``) of a file whose top-level networks are ``networks``.

    Keys accepted without effect go to ``ignored``; those that change what
    the sample sees and are not given, to ``unhonoured``.
    """
    mode = body.get("network_mode")
    attached = body.get("networks")
    if mode is not None and attached is not None:
        raise where.error(
            f"{field_path}.network_mode",
            "network_mode and networks are mutually exclusive (Compose refuses both); keep one",
        )
    if mode is not None:
        return _network_mode(mode, where, f"{field_path}.network_mode", unhonoured)
    names = _attached_names(attached, networks, where, f"{field_path}.networks", ignored, unhonoured)
    reaches = [_reach(name, networks.get(name), where, ignored, unhonoured) for name in names]
    return "outbound" if "outbound" in reaches else "none"


def _network_mode(mode: object, where: Where, field_path: str, unhonoured: list[str]) -> NetworkMode:
    """Docker's own networks: ``none`` has nothing; a container on ``bridge`` reaches out, as on ``host``."""
    if mode == "none":
        return "none"
    if mode in ("bridge", "default"):
        return "outbound"
    if mode == "host":
        unhonoured.append("network_mode: host (the VM has its own network; it reaches the host's loopback at 10.0.2.2)")
        return "outbound"
    if isinstance(mode, str) and mode.startswith(("service:", "container:")):
        raise where.error(field_path, f"{mode!r} shares another container's network, which a VM cannot; remove it")
    raise where.error(field_path, f"expected none, bridge or host, got {shown(mode)}")


def _attached_names(
    attached: object,
    networks: Mapping[str, Any],
    where: Where,
    field_path: str,
    ignored: list[str],
    unhonoured: list[str],
) -> list[str]:
    """The networks a service is attached to (``default`` when it names none), each checked to be defined."""
    if attached is None:
        return [DEFAULT_NETWORK]
    if isinstance(attached, list):
        entries: dict[object, object] = {name: None for name in attached}
    elif isinstance(attached, Mapping):
        entries = dict(attached)
    else:
        raise where.error(field_path, f"expected a list or a mapping of network names, got {shown(attached)}")
    if not entries:
        raise where.error(field_path, "no network named; remove the key, or name one (network_mode: none for none)")
    names = []
    for name, settings in entries.items():
        if not isinstance(name, str) or not name:
            raise where.error(field_path, f"expected a network name, got {shown(name)}")
        if name != DEFAULT_NETWORK and name not in networks:
            defined = ", ".join(sorted(networks)) or "none"
            raise where.error(
                f"{field_path}.{name}",
                f"refers to an undefined network (defined under networks: {defined}); define it or fix the name",
            )
        _attachment(settings, where, f"{field_path}.{name}", ignored, unhonoured)
        names.append(name)
    return names


def _attachment(settings: object, where: Where, field_path: str, ignored: list[str], unhonoured: list[str]) -> None:
    if settings is None:
        return
    if not isinstance(settings, Mapping):
        raise where.error(field_path, f"expected a mapping (aliases, ipv4_address...), got {shown(settings)}")
    for key in settings:
        if isinstance(key, str) and key.startswith("x-"):
            continue
        if key in ATTACHMENT_NO_MEANING:
            ignored.append(f"{_tail(field_path)}.{key}")
        elif key in ATTACHMENT_NOT_HONOURED:
            unhonoured.append(f"{_tail(field_path)}.{key}")
        else:
            raise where.error(f"{field_path}.{key}", "unknown key; Docker Compose does not know it either (a typo?)")


def _reach(
    name: str, definition: Mapping[str, Any] | None, where: Where, ignored: list[str], unhonoured: list[str]
) -> NetworkMode:
    """Whether network ``name`` (its top-level definition) gives a route out; refused when forkd cannot know."""
    if definition is None:
        return "outbound"  # Docker's default: a bridge with outbound NAT
    field_path = f"networks.{name}"
    for key in definition:
        if isinstance(key, str) and key.startswith("x-"):
            continue
        if key in NETWORK_NO_MEANING:
            ignored.append(f"{field_path}.{key}")
        elif key in NETWORK_NOT_HONOURED:
            unhonoured.append(f"{field_path}.{key}")
        elif key not in NETWORK_READ:
            raise where.error(f"{field_path}.{key}", "unknown key; Docker Compose does not know it either (a typo?)")
    external = definition.get("external")
    if external is not None and (isinstance(external, Mapping) or _flag(external, where, f"{field_path}.external")):
        raise where.error(
            f"{field_path}.external",
            "a network made outside this file, whose reach forkd cannot know; define it here "
            "(internal: true for no outbound access) or use network_mode",
        )
    driver = definition.get("driver")
    if driver is not None and driver not in KNOWN_DRIVERS:
        raise where.error(
            f"{field_path}.driver",
            f"forkd knows the reach of Docker's drivers ({', '.join(sorted(KNOWN_DRIVERS))}), not {shown(driver)}; "
            "use one of them (internal: true for no outbound access)",
        )
    reaches: NetworkMode = "none" if driver == "none" else "outbound"
    if driver == "host":
        unhonoured.append(f"{field_path}.driver: host (the VM has its own network)")
    internal = definition.get("internal")
    if internal is not None and _flag(internal, where, f"{field_path}.internal"):
        reaches = "none"
    enable_ipv4 = definition.get("enable_ipv4")
    if enable_ipv4 is not None and not _flag(enable_ipv4, where, f"{field_path}.enable_ipv4"):
        reaches = "none"
    options = definition.get("driver_opts")
    if options is not None:
        if not isinstance(options, Mapping):
            raise where.error(f"{field_path}.driver_opts", f"expected a mapping of options, got {shown(options)}")
        for option, value in options.items():
            if option == MASQUERADE_OPTION:
                if compose_boolean(value if not isinstance(value, (int, float)) else str(value)) is False:
                    reaches = "none"  # a bridge without outbound NAT reaches nothing outside the host
            else:
                unhonoured.append(f"{field_path}.driver_opts.{option}")
    return reaches


def _flag(value: object, where: Where, field_path: str) -> bool:
    """A boolean field as Compose reads it (``true``, ``"yes"``, ``"off"``...); ConfigError for anything else."""
    flag = compose_boolean(value)
    if flag is None:
        raise where.error(field_path, f"expected true or false, got {shown(value)}")
    return flag


def _tail(field_path: str) -> str:
    """``services.default.networks.inner`` -> ``networks.inner``: how a service's own keys are listed."""
    return field_path.split(".", 2)[-1] if field_path.startswith("services.") else field_path
