"""What the plugin keeps for one pytest run, in ``config.stash``, and when it is worked out.

pytest loads the plugin in every project that has it installed, so
configuring a run must cost next to nothing when no test uses forkd. The
timing recorder is set up at once (cheap: every test is timed against it).
The run's runtime (:class:`~pytest_forkd.core.runtime.Runtime`: the storage
backends, and that recorder), which the forkd session hands to its VM
factory, is made on first use. The settings, forkd.yaml and the budgets are
resolved on first use too: at configure time when the run names forkd at
all (a ``--forkd-*`` option, a ``PYTEST_FORKD_*`` variable, a ``forkd_*``
ini key, a forkd.yaml in the rootdir), else when collection finds a test
with a forkd fixture or marker, or when a fixture asks. A bad setting still
fails the run as a usage error.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import pytest

from pytest_forkd.errors import ForkdError
from pytest_forkd.paths import PROJECT_FILE

if TYPE_CHECKING:
    from pytest_forkd.core.runtime import Runtime
    from pytest_forkd.latency.budgets import Budget, Violation
    from pytest_forkd.latency.compare import Comparison, Threshold
    from pytest_forkd.latency.timings import Recorder
    from pytest_forkd.plugin.cpu_bound import CpuBound
    from pytest_forkd.plugin.options import Resolved
    from pytest_forkd.project.config import Project
    from pytest_forkd.project.session import ForkdSession
    from pytest_forkd.project.settings import Settings

#: Prefixes that name forkd in a run's options and environment.
OPTION_DEST_PREFIX: Final = "forkd_"
ENV_PREFIX: Final = "PYTEST_FORKD_"


@dataclass(frozen=True)
class KeptVM:
    """A failing test's VM saved as a snapshot (``--forkd-keep-failed``)."""

    test: str
    tag: str
    store: str


@dataclass
class RunState:
    """Everything the plugin keeps for one pytest run, in ``config.stash``."""

    config: pytest.Config
    recorder: Recorder
    """Every timing sample of the run (this process's; the controller adds its xdist workers')."""
    marker_budgets: list[Budget] = field(default_factory=list)
    build_events: list[dict[str, Any]] = field(default_factory=list)
    prefills: list[dict[str, Any]] = field(default_factory=list)
    """Pool prefills before the first test (``--forkd-pool-prefill``): snapshot, children, seconds."""
    kept: list[KeptVM] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    comparison: Comparison | None = None
    comparison_refused: str | None = None
    """Why ``--forkd-compare-strict`` refused to compare (the run fails)."""
    saved_run: Path | None = None
    report: Path | None = None
    """Where ``--forkd-report`` wrote the HTML report."""
    report_error: str | None = None
    """Why the HTML report could not be written (the run fails)."""
    test_times: dict[str, tuple[float, str]] = field(default_factory=dict)
    """Each test's setup + call + teardown seconds and outcome (for ``--forkd-report``)."""
    session: ForkdSession | None = None
    children_expected: int | None = None
    """Collected tests that use ``forkd_vm`` (a bound on the children the pool restores ahead of them)."""
    worker_died: bool = False
    """An xdist worker crashed: its QEMUs died with it (PDEATHSIG), its run directory is removed at the end."""
    cpu_bound: CpuBound | None = None
    """The run's CPU against its wall time, measured when the session finished and its VMs were closed."""
    previous_default_runtime: Callable[[], Runtime] | None = None
    """What pytest_forkd.boot()'s factories used before this run gave them its runtime (put back at its end)."""
    _resolved: Resolved | None = None
    _runtime: Runtime | None = None

    @property
    def runtime(self) -> Runtime:
        """The run's storage backends and its recorder, made on first use; the forkd session's factory runs on it."""
        if self._runtime is None:
            from pytest_forkd.core.runtime import Runtime

            self._runtime = Runtime(recorder=self.recorder)
        return self._runtime

    @property
    def resolved(self) -> bool:
        """Whether the settings have been worked out yet (they are on first use)."""
        return self._resolved is not None

    def resolve(self) -> Resolved:
        """The run's settings, worked out the first time they are needed; a bad one is a usage error."""
        if self._resolved is None:
            from pytest_forkd.plugin.options import resolve_run, usage_error

            try:
                self._resolved = resolve_run(self.config, backends=lambda: self.runtime.backends.ids())
            except ForkdError as exc:
                raise usage_error(exc) from None
        return self._resolved

    @property
    def settings(self) -> Settings:
        return self.resolve().settings

    @property
    def project(self) -> Project:
        return self.resolve().project

    @property
    def cli_budgets(self) -> list[Budget]:
        return self.resolve().cli_budgets

    @property
    def thresholds(self) -> list[Threshold]:
        return self.resolve().thresholds

    def open_session(self, progress: Callable[[str], None]) -> ForkdSession:
        if self.session is None:
            from pytest_forkd.project.session import ForkdSession

            self.session = ForkdSession(self.settings, self.project, runtime=self.runtime, progress=progress)
            self.session.children_expected = self.children_expected
        return self.session

    def close_session(self, worker: str) -> None:
        session, self.session = self.session, None
        if session is None:
            return
        self.build_events += [
            {
                "snapshot": event.snapshot,
                "action": event.action,
                "seconds": event.seconds,
                "worker": worker,
                "recipe_hash": event.recipe_hash,
            }
            for event in session.build_events
        ]
        self.prefills += [{**prefill, "worker": worker} for prefill in session.prefills]
        session.close()


STATE: Final = pytest.StashKey[RunState]()


def start_run(config: pytest.Config) -> RunState:
    """Record the run's state, with its timing recorder, in ``config.stash``; resolve nothing yet."""
    from pytest_forkd.latency.timings import Recorder

    state = RunState(config=config, recorder=Recorder())
    config.stash[STATE] = state
    return state


def run_state(config: pytest.Config) -> RunState:
    """The run's state (see :func:`start_run`)."""
    return config.stash[STATE]


def names_forkd(config: pytest.Config) -> bool:
    """Whether the run sets anything of forkd's: then its settings are checked before any test runs."""
    for dest, value in vars(config.option).items():
        if dest.startswith(OPTION_DEST_PREFIX) and value not in (None, False, []):
            return True
    if any(name.startswith(ENV_PREFIX) for name in os.environ):
        return True
    from pytest_forkd.project.settings import OPTIONS, ini_text  # loaded already: it declares the options

    try:
        if any(ini_text(config, option) for option in OPTIONS):
            return True
    except ForkdError:  # a bad ini value names forkd too: resolving it reports the error
        return True
    return (Path(config.rootpath) / PROJECT_FILE).is_file()


def uses_forkd(item: pytest.Item) -> bool:
    """Whether a collected test asks for a forkd fixture or carries a forkd marker."""
    if any(name.startswith("forkd") for name in getattr(item, "fixturenames", ())):
        return True
    return any(marker.name.startswith("forkd") for marker in item.iter_markers())


def worker_id(config: pytest.Config) -> str:
    """The xdist worker id of this process (``main`` without xdist, or on the controller)."""
    workerinput = getattr(config, "workerinput", None)
    return workerinput["workerid"] if workerinput else "main"
