"""pytest-forkd: real microVMs as cheap as fork() inside pytest."""

from __future__ import annotations

from .checkpoint import Checkpoint
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
from .exec_result import ExecResult
from .factory import VMFactory, boot
from .snapshot import Snapshot
from .vm import VM

__version__ = "0.1.0.dev0"

__all__ = [
    "VM",
    "AgentError",
    "BackendError",
    "Checkpoint",
    "ConfigError",
    "ExecError",
    "ExecResult",
    "ExecTimeout",
    "ForkdError",
    "GuestCrashed",
    "HostNotReady",
    "ImageError",
    "IncompatibleSnapshot",
    "InvalidTagError",
    "Snapshot",
    "SnapshotError",
    "UnknownImage",
    "UnknownSnapshot",
    "VMError",
    "VMFactory",
    "VMStartError",
    "boot",
]
