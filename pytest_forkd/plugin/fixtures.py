"""The plugin's fixtures: the forkd session, the warm parent, a child VM per test, checkpoints, budgets.

Each fixture opens the run's forkd session on first use
(:meth:`~pytest_forkd.plugin.state.RunState.open_session`), so nothing
boots and nothing heavy is imported until a test asks for a VM. The fixture
list with what each one gives is in :mod:`pytest_forkd.plugin`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Final

import pytest

from pytest_forkd.errors import ImageError
from pytest_forkd.plugin.progress import progress_printer
from pytest_forkd.plugin.state import run_state, worker_id

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_forkd.aio import AsyncVM
    from pytest_forkd.analysis.trajectory import Trajectory
    from pytest_forkd.core.checkpoint import Checkpoint
    from pytest_forkd.core.vm import VM
    from pytest_forkd.engine.network import NetworkChoice
    from pytest_forkd.latency.budgets import Budget
    from pytest_forkd.project.session import ForkdSession
    from pytest_forkd.project.settings import Settings, VMChoice
    from pytest_forkd.storage.snapshot import Snapshot

#: Operation name of the per-test cost of the ``forkd_vm`` fixture (setup + teardown).
OP_FIXTURE_OVERHEAD: Final = "fixture_overhead"
#: Where a ``forkd_dangerous`` test's checkpoint is kept: ``request.node.stash[DANGEROUS_CHECKPOINT]``.
DANGEROUS_CHECKPOINT: Final = pytest.StashKey["Checkpoint[VM]"]()
CHOICE: Final = pytest.StashKey["VMChoice"]()
TEST_VM: Final = pytest.StashKey["VM"]()
TEST_VMS: Final = pytest.StashKey["TestVMs"]()
TEST_BUDGETS: Final = pytest.StashKey[list["Budget"]]()
"""Per-test budgets of an item: its marker's, then those its ``forkd_budget`` fixture set."""


class TestVMs:
    """The VMs a test started besides its forkd_vm (children of checkpoints); killed after the test.

    Acts as the owner of the checkpoint snapshots handed to the test, so
    ``checkpoint.fork(n)`` starts children through it.
    """

    __test__ = False  # not a test class, whatever its name says

    def __init__(self, session: ForkdSession) -> None:
        self._session = session
        self._vms: list[VM] = []
        self.backend: str | None = None
        """The test's storage backend: the default of the VMs started here, as of the test's VM."""

    def fork_snapshot(self, snapshot: Snapshot, n: int = 1, *, network: NetworkChoice = None) -> list[VM]:
        children = self._session.factory.fork_snapshot(snapshot, n, network=network)
        for child in children:
            child.default_backend = self.backend
        self._vms += children
        return children

    def export_snapshot(self, snapshot: Snapshot, destination: Path | str) -> Path:
        return self._session.factory.export_snapshot(snapshot, destination)

    def checkpoint(self, vm: VM, tag: str | None = None, *, backend: str | None = None) -> Checkpoint[VM]:
        """``vm.checkpoint()``, with the children forked from it started (and later killed) here."""
        checkpoint = vm.checkpoint(tag, backend=backend)
        checkpoint.snapshot = checkpoint.snapshot.with_owner(self)
        return checkpoint

    def close(self) -> None:
        for vm in self._vms:
            vm.close()

    def vms(self) -> list[VM]:
        return list(self._vms)


#: The titles that lead the one line of a test whose image cannot be had, most specific error first.
IMAGE_FAILURE_TITLES: Final = (
    ("ImageNotPulled", "image not pulled"),
    ("ImageToolMissing", "a tool images need is missing"),
    ("UnknownImage", "unknown image"),
    ("ImageNotFound", "image not found"),
    ("RegistryAuthRequired", "registry login needed"),
    ("RegistryUnreachable", "registry unreachable"),
    ("NoMatchingPlatform", "no linux/amd64 image"),
    ("DigestMismatch", "image damaged"),
    ("ImageStoreFull", "no room for the image"),
    ("HostileLayer", "image refused"),
    ("LayerError", "unreadable image layer"),
    ("ImageBuildError", "image build failed"),
)
#: Longest a test's line about an image that cannot be had gets (the first test's report has all of it).
IMAGE_FAILURE_WIDTH: Final = 400
_REPORTED_IMAGE_FAILURES: Final = pytest.StashKey[set[int]]()


def image_failure(config: pytest.Config, forkd: ForkdSession, error: ImageError) -> str:
    """What a test whose image cannot be had reports: one line, the reason first, then the error's own words.

    pytest's short summary cuts a line at the terminal's width, so it leads
    with the reason (``image not found: docker://...``) rather than the
    exception's name. The session asks for the image once (see
    ``ForkdSession.unavailable``); the first test to fail of it shows the
    whole message (a build's last lines of output), the others its first line.
    """
    names = {type_.__name__ for type_ in type(error).__mro__}
    title = next((title for name, title in IMAGE_FAILURE_TITLES if name in names), "image unavailable")
    text = str(error).strip()
    reference = forkd.settings.image
    if reference and reference not in text:
        text += f" (--forkd-image {reference})"
    reported = config.stash.setdefault(_REPORTED_IMAGE_FAILURES, set())
    first_line, _, rest = text.partition("\n")
    if id(error) not in reported:
        reported.add(id(error))
        return f"{title}: {text}"
    if len(first_line) > IMAGE_FAILURE_WIDTH:
        first_line = first_line[: IMAGE_FAILURE_WIDTH - 3] + "..."
    return f"{title}: {first_line}" + (" (the first test's error shows the rest)" if rest else "")


def choice_of(item: pytest.Item, settings: Settings) -> VMChoice:
    """The test's VM choice: its validated ``forkd`` marker, else the run's settings."""
    from pytest_forkd.project.settings import VMChoice

    return item.stash.get(CHOICE, None) or VMChoice(settings.snapshot, settings.backend)


@pytest.fixture(scope="session")
def forkd(pytestconfig: pytest.Config) -> Iterator[ForkdSession]:
    """The forkd session: factory, store, parent, current snapshot, timings."""
    state = run_state(pytestconfig)
    yield state.open_session(progress_printer(pytestconfig))
    state.close_session(worker_id(pytestconfig))


@pytest.fixture(scope="session")
def forkd_parent(forkd: ForkdSession, pytestconfig: pytest.Config) -> VM:
    """The warm parent VM of this session (of this xdist worker); children fork from its state."""
    try:
        return forkd.parent
    except ImageError as exc:
        message = image_failure(pytestconfig, forkd, exc)
    pytest.fail(message, pytrace=False)


@pytest.fixture
def _forkd_test_vms(forkd: ForkdSession, request: pytest.FixtureRequest) -> Iterator[TestVMs]:
    test_vms = request.node.stash[TEST_VMS] = TestVMs(forkd)
    yield test_vms
    test_vms.close()


@pytest.fixture
def forkd_vm(forkd: ForkdSession, request: pytest.FixtureRequest, _forkd_test_vms: TestVMs) -> Iterator[VM]:
    """A fresh copy-on-write child VM for this test, killed afterwards.

    While the test runs, branches and checkpoints taken without naming a
    backend use the test's backend (its ``forkd`` marker, else the run's).
    """
    item = request.node
    choice = choice_of(item, forkd.settings)
    session_seconds = forkd.build_seconds + forkd.prefill_seconds  # session costs, not this test's
    started = time.perf_counter()
    try:
        vm = forkd.child(choice)
    except ImageError as exc:  # failed outside the except block, so no chained traceback follows the one line
        message: str | None = image_failure(request.config, forkd, exc)
    else:
        message = None
    if message is not None:
        pytest.fail(message, pytrace=False)
    factory = forkd.factory
    vm.default_backend = _forkd_test_vms.backend = choice.backend  # the test's VMs, not the shared factory
    item.stash[TEST_VM] = vm
    setup_ms = (time.perf_counter() - started - (forkd.build_seconds + forkd.prefill_seconds - session_seconds)) * 1000
    try:
        yield vm
    finally:
        teardown_started = time.perf_counter()
        factory.close_soon(vm)  # killed now, reaped in the background
        teardown_ms = (time.perf_counter() - teardown_started) * 1000
        forkd.timings.record(
            OP_FIXTURE_OVERHEAD,
            setup_ms + teardown_ms,
            memory_mib=vm.memory_mib,
            extra={"setup_ms": round(setup_ms, 3), "teardown_ms": round(teardown_ms, 3)},
        )


@pytest.fixture
def forkd_avm(forkd_vm: VM, _forkd_test_vms: TestVMs) -> AsyncVM:
    """``forkd_vm`` as an AsyncVM, for ``async def`` tests; its forks and checkpoints' children die with the test.

    A plain fixture on purpose: it needs no async plugin to set up (the handle
    binds to the test's event loop when first awaited), so it works under
    pytest-asyncio and anyio alike, and the plugin loads without either.
    """
    from pytest_forkd.aio import AsyncVM

    return AsyncVM(forkd_vm, owner=_forkd_test_vms)


@pytest.fixture(scope="session")
def forkd_aparent(forkd_parent: VM) -> AsyncVM:
    """The session's warm parent VM as an AsyncVM, like ``forkd_parent`` (session-scoped).

    Test event loops come and go (pytest-asyncio gives each test its own by
    default), so this handle follows the loop that uses it, one loop at a time.
    """
    from pytest_forkd.aio import AsyncVM

    return AsyncVM(forkd_parent, follow_loop=True)


@pytest.fixture
def forkd_checkpoint(
    forkd: ForkdSession, _forkd_test_vms: TestVMs, request: pytest.FixtureRequest
) -> Callable[..., Checkpoint[VM]]:
    """``forkd_checkpoint(vm, tag=None)``: ``vm.checkpoint()`` whose forked children die with the test."""
    backend = choice_of(request.node, forkd.settings).backend

    def take(vm: VM, tag: str | None = None) -> Checkpoint[VM]:
        return _forkd_test_vms.checkpoint(vm, tag, backend=backend)

    return take


@pytest.fixture
def forkd_budget(request: pytest.FixtureRequest) -> Callable[..., list[Budget]]:
    """``forkd_budget(exec_ms=50, fork_ms=300, ...)``: latency limits on this test, set from inside it.

    The same keywords as the ``forkd_budget`` marker (a call overrides the
    marker's limit on the same operation); every sample of that operation
    taken during the test, setup to teardown, must fit. A test that exceeds
    one fails in its own report, naming the operation and the figure. An
    unknown keyword raises a ConfigError naming it.
    """
    from pytest_forkd.latency.budgets import budgets_from_marker

    item = request.node
    state = run_state(request.config)

    def limit(*args: object, **limits: object) -> list[Budget]:
        budgets = budgets_from_marker(item.nodeid, args, limits, kind="fixture")
        item.stash.setdefault(TEST_BUDGETS, []).extend(budgets)
        state.marker_budgets += budgets
        return budgets

    return limit


@pytest.fixture
def forkd_trajectory(forkd_vm: VM) -> Iterator[Trajectory]:
    """A Trajectory of ``forkd_vm`` (diff checkpoint every 10 steps), ready for ``bisect``."""
    from pytest_forkd.analysis.trajectory import Trajectory

    with Trajectory(forkd_vm) as trajectory:
        yield trajectory


@pytest.fixture
def forkd_dangerous_checkpoint(
    forkd_checkpoint: Callable[..., Checkpoint[VM]], forkd_vm: VM, request: pytest.FixtureRequest
) -> Checkpoint[VM]:
    """The checkpoint of forkd_vm of a ``forkd_dangerous`` test, taken now."""
    if request.node.get_closest_marker("forkd_dangerous") is None:
        pytest.fail(
            "forkd_dangerous_checkpoint is for tests marked @pytest.mark.forkd_dangerous; "
            "mark the test, or take a checkpoint yourself with forkd_checkpoint(forkd_vm)",
            pytrace=False,
        )
    checkpoint = request.node.stash[DANGEROUS_CHECKPOINT] = forkd_checkpoint(forkd_vm)
    return checkpoint
