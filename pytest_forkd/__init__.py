"""pytest-forkd: real microVMs as cheap as fork() inside pytest.

The public API is imported lazily: ``import pytest_forkd`` loads the errors
and nothing else, and ``pytest_forkd.VM`` (say) imports the VM module the
first time it is named. pytest loads this package in every project that has
the plugin installed, so a suite that never uses a VM must not pay for the
engine, the store or asyncio.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    AgentError,
    ArchiveError,
    BackendError,
    BisectError,
    ChangesError,
    CommandNotFound,
    ConfigError,
    CopyError,
    DamagedSnapshot,
    ExecError,
    ExecTimeout,
    ForkdError,
    GuestCrashed,
    GuestProtocolError,
    HostNotReady,
    ImageError,
    IncomparableRuns,
    IncompatibleSnapshot,
    InvalidArgument,
    InvalidTagError,
    NetworkError,
    NoSuchProcess,
    ProcessError,
    ProcessTimeout,
    SnapshotError,
    TranscriptError,
    UnknownImage,
    UnknownSnapshot,
    UnsafeArchive,
    VMError,
    VMStartError,
    WrongEventLoop,
)
from .version import __version__

if TYPE_CHECKING:
    from .aio import AsyncCheckpoint, AsyncGuestProcess, AsyncSnapshot, AsyncVM, aboot
    from .analysis.changes import Change, Changes
    from .analysis.trajectory import BisectResult, Trajectory
    from .analysis.transcript import Transcript
    from .archives.archive import export_snapshot
    from .core.checkpoint import Checkpoint
    from .core.copy import CopyResult
    from .core.factory import VMFactory, boot, import_snapshot
    from .core.process import GuestProcess, ProcessOutput, ProcessSink
    from .core.runtime import Runtime
    from .core.vm import VM
    from .guest.exec_result import ExecResult
    from .storage.snapshot import Snapshot

#: Public name -> the module that defines it, imported on first use.
_LAZY: dict[str, str] = {
    "AsyncCheckpoint": "pytest_forkd.aio",
    "AsyncGuestProcess": "pytest_forkd.aio",
    "GuestProcess": "pytest_forkd.core.process",
    "ProcessOutput": "pytest_forkd.core.process",
    "ProcessSink": "pytest_forkd.core.process",
    "AsyncSnapshot": "pytest_forkd.aio",
    "AsyncVM": "pytest_forkd.aio",
    "aboot": "pytest_forkd.aio",
    "import_snapshot": "pytest_forkd.core.factory",
    "Change": "pytest_forkd.analysis.changes",
    "Changes": "pytest_forkd.analysis.changes",
    "Checkpoint": "pytest_forkd.core.checkpoint",
    "CopyResult": "pytest_forkd.core.copy",
    "VMFactory": "pytest_forkd.core.factory",
    "boot": "pytest_forkd.core.factory",
    "Runtime": "pytest_forkd.core.runtime",
    "BisectResult": "pytest_forkd.analysis.trajectory",
    "Trajectory": "pytest_forkd.analysis.trajectory",
    "Transcript": "pytest_forkd.analysis.transcript",
    "VM": "pytest_forkd.core.vm",
    "ExecResult": "pytest_forkd.guest.exec_result",
    "export_snapshot": "pytest_forkd.archives.archive",
    "Snapshot": "pytest_forkd.storage.snapshot",
}

__all__ = [
    "__version__",
    "VM",
    "AsyncCheckpoint",
    "AsyncGuestProcess",
    "AsyncSnapshot",
    "AsyncVM",
    "AgentError",
    "ArchiveError",
    "BackendError",
    "BisectError",
    "BisectResult",
    "Change",
    "Changes",
    "ChangesError",
    "CommandNotFound",
    "Checkpoint",
    "ConfigError",
    "CopyError",
    "CopyResult",
    "DamagedSnapshot",
    "ExecError",
    "ExecResult",
    "ExecTimeout",
    "GuestProcess",
    "ForkdError",
    "GuestCrashed",
    "GuestProtocolError",
    "HostNotReady",
    "ImageError",
    "IncomparableRuns",
    "IncompatibleSnapshot",
    "InvalidArgument",
    "InvalidTagError",
    "NetworkError",
    "NoSuchProcess",
    "ProcessError",
    "ProcessOutput",
    "ProcessSink",
    "ProcessTimeout",
    "Runtime",
    "Snapshot",
    "UnsafeArchive",
    "SnapshotError",
    "Trajectory",
    "Transcript",
    "TranscriptError",
    "UnknownImage",
    "UnknownSnapshot",
    "VMError",
    "VMFactory",
    "VMStartError",
    "WrongEventLoop",
    "aboot",
    "boot",
    "export_snapshot",
    "import_snapshot",
]


def __getattr__(name: str) -> Any:
    """Import the module behind a public name on first use, and keep the name here for the next time."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
