"""pytest-forkd: real microVMs as cheap as fork() inside pytest."""

from __future__ import annotations

from .errors import (
    AgentError,
    BackendError,
    ConfigError,
    ExecError,
    ExecTimeout,
    ForkdError,
    GuestCrashed,
    HostNotReady,
    ImageError,
    IncompatibleSnapshot,
    InvalidTagError,
    SnapshotError,
    UnknownImage,
    UnknownSnapshot,
    VMError,
    VMStartError,
)

__version__ = "0.1.0.dev0"

__all__ = [
    "AgentError",
    "BackendError",
    "ConfigError",
    "ExecError",
    "ExecTimeout",
    "ForkdError",
    "GuestCrashed",
    "HostNotReady",
    "ImageError",
    "IncompatibleSnapshot",
    "InvalidTagError",
    "SnapshotError",
    "UnknownImage",
    "UnknownSnapshot",
    "VMError",
    "VMStartError",
]
