"""Test layers.

``vm``
    Needs QEMU (and the default guest image); skipped, saying why, on a host
    without QEMU.
``slow``
    No QEMU, but seconds each: whole pytest sessions run in subprocesses
    (every test using ``pytester`` is marked so) and statistics at scale.
``oci_tools``
    Starts real container tooling: the ``docker-registry`` server, skopeo,
    podman, buildah or umoci. Every test that uses a registry fixture
    (tests/registry.py, tests/integrations/project_images.py) and every test
    under tests/oci/ is marked so here; a test that calls such a tool itself
    says so with the marker. Those that also boot a VM carry ``vm`` too.
``alone``
    Compares the timings of two runs it makes, so a change of load between
    them is a real regression to the gate: under pytest-xdist it runs while
    no other worker runs a test (``run_alone`` below).

``pytest -m "not vm"`` is the fast layer: no QEMU, no real container
tooling, the fake engine where a VM is needed (tests/contract), and no
``slow`` test, in under 30 s. ``slow`` and ``oci_tools`` tests come back
when the expression names the marker (``-m "not vm and slow"``, ``-m
oci_tools``) or ``FORKD_TESTS_SLOW=1`` is set. Without ``-m`` every test runs.
The fast layer does not even import the test modules it would deselect whole
(``fast_layer_skips``): importing them is most of what they would cost it.
Run over whole folders, it spreads over the usable cores with pytest-xdist
(``fast_layer_workers``): about half its time is waiting for the processes
its tests start, which the other core fills. ``-n 0`` keeps it in one process
(for ``--pdb``, or to time one test).
"""

from __future__ import annotations

import ast
import fcntl
import functools
import gc
import os
import re
import signal
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest


def _restore_default_signal_dispositions() -> None:
    """Give back the signals a runner's shell set to be ignored: SIGINT and SIGQUIT (a background job), SIGHUP (nohup).

    An ignored disposition is inherited across fork and exec, so every
    process the tests start to interrupt (an inner pytest, a guest agent, the
    E2B server) would ignore the signal too, and the tests of Ctrl-C would
    fail only because of how the suite was started.
    """
    for signum, default in (
        (signal.SIGINT, signal.default_int_handler),
        (signal.SIGQUIT, signal.SIG_DFL),
        (signal.SIGHUP, signal.SIG_DFL),
    ):
        if signal.getsignal(signum) == signal.SIG_IGN:
            signal.signal(signum, default)


_restore_default_signal_dispositions()


@functools.lru_cache(maxsize=1)
def qemu_problem() -> str | None:
    from pytest_forkd.engine.base import make_engine

    return make_engine("qemu").unavailable_reason()


TESTS = Path(__file__).parent
#: The markers the fast layer leaves out besides ``vm``, unless its expression names them.
HEAVY = ("slow", "oci_tools")
#: The fixtures that start a real registry and push images to it with skopeo (tests/registry.py,
#: tests/integrations/project_images.py).
REGISTRY_FIXTURES = frozenset(
    {
        "registry",
        "private_registry",
        "auth_registry",
        "busybox_image",
        "busybox_user_image",
        "debian_image",
        "project_image",
        "agent_image",
    }
)
#: Folders whose every test is marked: tests/integration/ ``vm`` (its conftest.py does it), tests/oci/
#: ``oci_tools`` (pulls with skopeo from a real registry, builds with podman or buildah).
FOLDER_MARKS = {TESTS / "integration": "vm", TESTS / "oci": "oci_tools"}


def _uses_registry(item: pytest.Item) -> bool:
    """Whether the test uses a registry fixture, directly or through another fixture (not a parameter so named)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return bool(REGISTRY_FIXTURES.intersection(getattr(item, "fixturenames", ())) - set(params))


def pytest_itemcollected(item: pytest.Item) -> None:
    if "pytester" in getattr(item, "fixturenames", ()):
        item.add_marker(pytest.mark.slow)
    path = Path(item.path)
    for folder, mark in FOLDER_MARKS.items():
        if folder in path.parents and item.get_closest_marker(mark) is None:
            item.add_marker(mark)
    if item.get_closest_marker("oci_tools") is None and _uses_registry(item):
        item.add_marker(pytest.mark.oci_tools)


def _left_out(config: pytest.Config) -> tuple[str, ...]:
    """The markers whose tests this run leaves out: the fast layer's, less those its expression names."""
    expression = config.option.markexpr or ""
    if "not vm" not in expression or os.environ.get("FORKD_TESTS_SLOW"):
        return ()
    return tuple(mark for mark in HEAVY if not re.search(rf"\b{mark}\b", expression))


_MODULE_MARK = re.compile(r"^pytestmark\s*=.*?\bpytest\.mark\.(vm|slow|oci_tools)\b", re.MULTILINE | re.DOTALL)


def _marks_whole_module(value: ast.expr) -> set[str]:
    """The marker names a module-level ``pytestmark = ...`` gives every test of the module."""
    marks = value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]
    return {
        mark.attr
        for mark in marks
        if isinstance(mark, ast.Attribute)
        and isinstance(mark.value, ast.Attribute)
        and mark.value.attr == "mark"
        and isinstance(mark.value.value, ast.Name)
        and mark.value.value.id == "pytest"
    }


def fast_layer_skips(path: Path, left_out: tuple[str, ...] = HEAVY) -> bool:
    """Whether every test of the module at ``path`` is marked ``vm`` or one of ``left_out``, as its source shows.

    The text is searched first and parsed only when it may say so (a string in
    the module can hold such a line too): most modules cost no parse.
    """
    skipped = {"vm", *left_out}
    if FOLDER_MARKS.get(path.parent) in skipped:
        return True
    text = path.read_text()
    if not _MODULE_MARK.search(text):
        return False
    for node in ast.parse(text, str(path)).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "pytestmark" for target in node.targets
        ):
            return bool(_marks_whole_module(node.value) & skipped)
    return False


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        left_out = _left_out(config)
        if left_out and fast_layer_skips(collection_path, left_out):
            return True
    return None


def fast_layer_workers(config: pytest.Config) -> int:
    """How many xdist workers the fast layer gets: one per usable core (at most 4), when it runs whole folders.

    Only when no ``-n`` was given, pytest-xdist is loaded, and nothing in the
    command line needs one process (``--pdb``, ``-s``, ``--collect-only``); a
    file or a test named on the command line runs in one process, where a
    worker's start would cost more than it saves.
    """
    option = config.option
    if (
        not _left_out(config)
        or not config.pluginmanager.hasplugin("xdist")
        or hasattr(config, "workerinput")
        or getattr(option, "numprocesses", 0) is not None
        or option.usepdb
        or option.capture == "no"
        or option.collectonly
    ):
        return 0
    here = config.invocation_params.dir
    if not all((here / arg).is_dir() for arg in config.args):
        return 0
    cores = len(os.sched_getaffinity(0))
    return min(cores, 4) if cores > 1 else 0


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Give the fast layer its workers before pytest-xdist reads ``-n`` (this hook runs first: registered later)."""
    workers = fast_layer_workers(config)
    if workers:
        config.option.numprocesses = workers


def pytest_report_header(config: pytest.Config) -> str | None:
    if getattr(config.option, "numprocesses", None) and _left_out(config) and not hasattr(config, "workerinput"):
        return f"fast layer: {config.option.numprocesses} workers (-n 0 runs it in one process)"
    return None


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session) -> Iterator[object]:
    """Collection without full garbage collections; what it leaves is then frozen out of later ones.

    Collecting imports the test modules and everything they use (Inspect, the
    Agents SDK, pydantic...): objects that live to the end of the run. Each full
    collection scans all of them, a fifth of a second and more once they are
    loaded, and the interpreter ran one every few hundred milliseconds of
    collecting and testing: seconds per run. So collection runs with the young
    generations only, then one full collection clears what it left, and
    ``gc.freeze`` keeps the survivors out of every later one.
    """
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], 1 << 30)
    try:
        return (yield)
    finally:
        gc.set_threshold(*thresholds)
        gc.collect()
        gc.freeze()
        _frozen_modules[0] = len(sys.modules)


#: How many modules were loaded when the live objects were last frozen out of full collections.
_frozen_modules = [0]


def pytest_runtest_logfinish() -> None:
    """After a test that imported a framework (an SDK on first use, Inspect's first eval), freeze again.

    Those modules live to the end of the run as well, and a full collection
    would walk them every time; a few hundred new modules is a second of
    importing, so freezing after them costs nothing in comparison.
    """
    if len(sys.modules) - _frozen_modules[0] >= 200:
        gc.freeze()
        _frozen_modules[0] = len(sys.modules)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    left_out = _left_out(config)
    if left_out:
        heavy = [item for item in items if any(item.get_closest_marker(mark) for mark in left_out)]
        if heavy:
            config.hook.pytest_deselected(items=heavy)
            kept = set(map(id, items)) - set(map(id, heavy))
            items[:] = [item for item in items if id(item) in kept]
    for item in items:
        if item.get_closest_marker("vm") is not None and qemu_problem():
            item.add_marker(pytest.mark.skip(reason=f"needs QEMU: {qemu_problem()}"))


@pytest.fixture(autouse=True)
def run_alone(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Under pytest-xdist, tests marked ``alone`` exclude every other test of the run.

    A reader-writer lock shared by the workers (in the run's common temporary
    directory): each test holds it shared, an ``alone`` test exclusively. An
    ``alone`` test first takes the ``intent`` lock, which a test about to start
    passes through, so a worker that keeps starting tests cannot starve it.
    """
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    shared = tmp_path_factory.getbasetemp().parent
    alone = request.node.get_closest_marker("alone") is not None
    with ExitStack() as locks:
        intent = locks.enter_context(open(shared / "forkd-tests-intent.lock", "a"))
        held = locks.enter_context(open(shared / "forkd-tests-running.lock", "a"))
        fcntl.flock(intent, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(held, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(intent, fcntl.LOCK_UN)
        yield
