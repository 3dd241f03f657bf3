"""One sandbox: its forkd VM (or, paused, its snapshot), tokens, timeout, lifecycle, and how the API shows it.

A running sandbox is a copy-on-write child of its template's snapshot (an
:class:`~pytest_forkd.aio.AsyncVM`, whose synchronous VM the ``forkd_e2b``
fixture hands to tests); a paused one has no VM at all, only the snapshot
its state was written to. Everything that changes a sandbox's state (pause,
resume, fork, kill) holds its :attr:`Sandbox.lock`, so two calls never race
on one VM. The JSON shapes are those of E2B's API models
(``e2b/api/client/models``: ``Sandbox``, ``SandboxDetail``, ``ListedSandbox``).
"""

from __future__ import annotations

import asyncio
import datetime
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pytest_forkd.e2b.config import ENVD_VERSION
from pytest_forkd.e2b.processes import ProcessTable

if TYPE_CHECKING:
    from pytest_forkd.aio import AsyncVM
    from pytest_forkd.core.vm import VM
    from pytest_forkd.e2b.guest_helper import FilesHelper
    from pytest_forkd.e2b.templates import Template
    from pytest_forkd.storage.snapshot import Snapshot

CLIENT_ID = "forkd"


class State(str, enum.Enum):
    RUNNING = "running"
    PAUSED = "paused"
    KILLED = "killed"


@dataclass(frozen=True)
class Lifecycle:
    """What happens when the timeout runs out, and whether a call resumes a paused sandbox."""

    on_timeout: str = "kill"
    auto_resume: bool = False


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def iso(moment: datetime.datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


@dataclass(eq=False)
class Sandbox:
    """One sandbox of the server."""

    id: str
    template: Template
    envd_token: str
    traffic_token: str
    timeout_s: int
    lifecycle: Lifecycle
    metadata: dict[str, str] = field(default_factory=dict)
    envs: dict[str, str] = field(default_factory=dict)
    started_at: datetime.datetime = field(default_factory=utc_now)
    end_at: datetime.datetime = field(default_factory=utc_now)
    state: State = State.RUNNING
    vm: AsyncVM | None = None
    paused: Snapshot | None = None
    """The snapshot a paused sandbox's state was written to (kept after a resume, until the next pause or kill)."""
    processes: ProcessTable = field(default_factory=ProcessTable)
    files: FilesHelper | None = None
    helper_pid: int | None = None
    interpreter: Any = None
    """The code interpreter's host side (pytest_forkd.e2b.interpreter.CodeInterpreter), made on first use."""
    held: set[str] = field(default_factory=set)
    """Paths of the server's snapshots this sandbox uses (see registry.Leases)."""
    memory_mib: int = 0
    vcpus: int = 1
    internet: bool = False
    watchers: int = 0
    """Directory watchers of envd made in this sandbox and not removed (bounded by Limits.max_watchers)."""
    timer: asyncio.TimerHandle | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    starting: asyncio.Future[None] | None = None
    """Set while the sandbox (a fork's child) is being restored; its calls wait for it (see e2b.forks)."""
    created_by: str | None = None
    """Which test made it (the fixture's bookkeeping), else None."""

    @property
    def sync_vm(self) -> VM | None:
        return self.vm.sync if self.vm is not None else None

    def extend(self, timeout_s: int) -> None:
        """Set the end to ``timeout_s`` from now (the caller re-arms the timer)."""
        self.timeout_s = timeout_s
        self.end_at = utc_now() + datetime.timedelta(seconds=timeout_s)

    # -- JSON as E2B's API answers ---------------------------------------------------------------------
    def created(self) -> dict[str, Any]:
        """``Sandbox``: the answer to create, connect, resume and each fork."""
        return {
            "templateID": self.template.name,
            "sandboxID": self.id,
            "clientID": CLIENT_ID,
            "alias": self.template.name,
            "envdVersion": ENVD_VERSION,
            "envdAccessToken": self.envd_token,
            "trafficAccessToken": self.traffic_token,
        }

    def _common(self) -> dict[str, Any]:
        return {
            "templateID": self.template.name,
            "sandboxID": self.id,
            "clientID": CLIENT_ID,
            "alias": self.template.name,
            "startedAt": iso(self.started_at),
            "endAt": iso(self.end_at),
            "cpuCount": self.vcpus,
            "memoryMB": self.memory_mib,
            "diskSizeMB": 0,
            "state": State.PAUSED.value if self.state == State.PAUSED else State.RUNNING.value,
            "envdVersion": ENVD_VERSION,
            "metadata": dict(self.metadata),
        }

    def listed(self) -> dict[str, Any]:
        """``ListedSandbox``: one item of a list."""
        return self._common()

    def detail(self) -> dict[str, Any]:
        """``SandboxDetail``: the answer to get_info."""
        return {
            **self._common(),
            "envdAccessToken": self.envd_token,
            "allowInternetAccess": self.internet,
            "lifecycle": {"onTimeout": self.lifecycle.on_timeout, "autoResume": self.lifecycle.auto_resume},
        }
