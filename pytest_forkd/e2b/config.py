"""What a server is started with: address, key, templates, ports, limits.

One frozen :class:`ServerConfig` is shared by the command line (``forkd e2b
serve``), the ``forkd_e2b`` fixture and the server itself, so the defaults
and the checks of every option are written once. Everything a hostile
client could use to make the server hold more than a bounded amount of
memory or guest state has a limit here.
"""

from __future__ import annotations

import ipaddress
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pytest_forkd.errors import ConfigError

#: The SDKs' fixed ports with ``E2B_DEBUG=true``: the API, envd and the code interpreter on localhost.
DEBUG_API_PORT = 3000
DEBUG_ENVD_PORT = 49983
DEBUG_INTERPRETER_PORT = 49999
#: The in-sandbox ports the SDKs name in ``E2b-Sandbox-Port``.
ENVD_PORT = 49983
INTERPRETER_PORT = 49999
#: The template the SDK asks for by default, and the code interpreter's default.
DEFAULT_TEMPLATE = "base"
CODE_INTERPRETER_TEMPLATE = "code-interpreter-v1"
#: The user a call runs as when it names none, and where commands start when they name no cwd: what envd
#: does with E2B's templates (user ``user``, working directory /home/user). The SDKs send no user to an envd
#: of version 0.4.0 and later (e2b/envd/versions.py ENVD_DEFAULT_USER), older ones send ``user`` themselves.
DEFAULT_USER = "user"
DEFAULT_WORKDIR = "/home/user"
#: The version of envd this server answers as: the SDKs enable what it serves by it (e2b/envd/versions.py).
ENVD_VERSION = "0.6.4"

_TEMPLATE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")


@dataclass(frozen=True)
class Limits:
    """Bounds on what one client can make the server hold."""

    max_sandboxes: int = 32
    """Running and paused sandboxes at once (more answers 429, as E2B's concurrency limit does)."""
    max_json_body: int = 1 << 20
    """Bytes of a JSON request body (the sandbox API, the code interpreter)."""
    max_rpc_message: int = 16 << 20
    """Bytes of one Connect RPC message (stdin data, paths)."""
    max_upload: int = 1 << 30
    """Bytes of one uploaded file (after gzip decompression); the guest's free memory bounds it further."""
    max_download: int = 256 << 20
    """Bytes of one downloaded file (a guest's files live in its memory, so few are larger)."""
    max_timeout_s: int = 24 * 3600
    """Longest sandbox timeout a client may set (E2B's own maximum)."""
    max_processes: int = 256
    """Processes started through one sandbox's envd that are still running."""
    max_watchers: int = 64
    """Directory watchers of one sandbox."""


@dataclass(frozen=True)
class ServerConfig:
    """How one E2B-compatible server runs; see ``forkd e2b serve --help``."""

    host: str = "127.0.0.1"
    port: int = 0
    """0: a free port, chosen when the server starts."""
    api_key: str = field(default_factory=lambda: "e2b_" + secrets.token_hex(20), repr=False)
    templates: Mapping[str, str] = field(default_factory=dict)
    """``--template NAME=REF``: a template name for a forkd.yaml snapshot, a stored one or an image reference."""
    debug_ports: bool = False
    """Also serve the SDKs' ``E2B_DEBUG=true`` ports (3000, 49983, 49999 on the same host)."""
    default_timeout_s: int = 300
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        check_host(self.host)
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be a port number 0-65535 (0: any free port), got {self.port!r}")
        if not isinstance(self.api_key, str) or not 8 <= len(self.api_key) <= 256 or not self.api_key.isprintable():
            raise ConfigError("--api-key must be 8 to 256 printable characters")
        for name in self.templates:
            check_template_name(name, "--template")
        limit = self.limits.max_timeout_s
        if (
            isinstance(self.default_timeout_s, bool)
            or not isinstance(self.default_timeout_s, int)
            or not (0 < self.default_timeout_s <= limit)
        ):
            raise ConfigError(f"--timeout must be 1 to {limit} seconds, got {self.default_timeout_s!r}")

    @property
    def url_host(self) -> str:
        """The host as it goes into a URL (an IPv6 address in brackets; 0.0.0.0 and :: as loopback)."""
        if self.host in ("0.0.0.0", ""):
            return "127.0.0.1"
        if self.host == "::":
            return "[::1]"
        return f"[{self.host}]" if ":" in self.host else self.host


def check_host(host: str) -> None:
    """ConfigError unless ``host`` is an IP address or ``localhost`` (a name could resolve anywhere)."""
    if host == "localhost":
        return
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(
            f"--host must be an IP address such as 127.0.0.1 (the default: loopback only) or 0.0.0.0, got {host!r}"
        ) from None


def check_template_name(name: str, where: str) -> str:
    if not isinstance(name, str) or not _TEMPLATE_NAME.fullmatch(name):
        raise ConfigError(
            f"{where}: {name!r} is not a template name (letters, digits, '.', '_', '-', '/'; at most 128)"
        )
    return name


def parse_template_options(values: Sequence[str]) -> dict[str, str]:
    """``--template NAME=REF`` options as a mapping; ConfigError naming a malformed one."""
    mapping: dict[str, str] = {}
    for value in values:
        name, sep, reference = value.partition("=")
        if not sep or not name or not reference:
            raise ConfigError(
                f"--template {value!r}: expected NAME=REF, e.g. --template tools=tools (a forkd.yaml snapshot) "
                "or --template py=docker://python:3.12-slim"
            )
        check_template_name(name, f"--template {value!r}")
        if name in mapping:
            raise ConfigError(f"--template {name}=...: given twice")
        mapping[name] = reference
    return mapping
