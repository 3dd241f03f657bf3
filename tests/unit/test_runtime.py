"""The runtime holds a session's storage backends and timing recorder; nothing of it is process-wide.

No QEMU: the registry is built from plugins (where entry points matter, the
installed distributions are replaced by fakes), and the VMs run on the fake
engine.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_forkd.core.factory import VMFactory
from pytest_forkd.core.runtime import Runtime
from pytest_forkd.errors import BackendError
from pytest_forkd.latency import timings
from pytest_forkd.latency.timings import Recorder
from pytest_forkd.storage import backend as backend_module
from pytest_forkd.storage.backend import ENTRY_POINT_GROUP, BackendRegistry, Capture, StorageBackend, hookimpl

BUILTIN = {"full", "diff", "uffd"}


class Mine(StorageBackend):
    id = "mine"
    description = "a third party's backend"

    def capture(self, source: object, target: Path) -> Capture:  # type: ignore[override]
        raise NotImplementedError


class MyPlugin:
    """A backend plugin object, as a third party writes one."""

    @hookimpl
    def forkd_register_backends(self, registry: BackendRegistry) -> None:
        registry.add(Mine())


class FakeDistribution:
    """An installed distribution as pluggy reads one: its entry points."""

    def __init__(self, *entry_points: importlib.metadata.EntryPoint) -> None:
        self.entry_points = list(entry_points)
        self.metadata = {"name": "third-party"}


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[FakeDistribution]]:
    """The distributions pluggy sees (none unless a test adds one), instead of the environment's."""
    distributions: list[FakeDistribution] = []
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: list(distributions))
    yield distributions


@pytest.fixture
def no_default_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh list behind register_plugin, so a test's registration does not reach later tests."""
    monkeypatch.setattr(backend_module, "_default_plugins", [])


@pytest.fixture
def third_party_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An importable module implementing the hook, as a package listed under the entry-point group would."""
    (tmp_path / "third_party_backend.py").write_text(
        "from pytest_forkd.storage.backend import StorageBackend, hookimpl\n"
        "class Theirs(StorageBackend):\n"
        "    id = 'theirs'\n"
        "    description = 'installed through an entry point'\n"
        "@hookimpl\n"
        "def forkd_register_backends(registry):\n"
        "    registry.add(Theirs())\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "third_party_backend", raising=False)
    return "third_party_backend"


def entry_point(name: str, value: str) -> importlib.metadata.EntryPoint:
    return importlib.metadata.EntryPoint(name=name, value=value, group=ENTRY_POINT_GROUP)


# -- the registry -----------------------------------------------------------------------------------------------
def test_the_built_in_backends_are_there_without_any_entry_point(installed: list[FakeDistribution]) -> None:
    assert set(Runtime().backends.ids()) == BUILTIN


def test_two_runtimes_have_their_own_registries_and_recorders() -> None:
    first, second = Runtime(), Runtime()
    assert first.backends is not second.backends
    assert first.backends.get("diff") is not second.backends.get("diff")  # a setting changed on one stays there
    assert first.recorder is not second.recorder
    first.register(MyPlugin())
    assert "mine" in first.backends and "mine" not in second.backends
    first.recorder.record("fork", 1.0)
    assert second.recorder.samples() == []


def test_a_plugin_given_to_the_runtime_adds_its_backend_through_the_hook(installed: list[FakeDistribution]) -> None:
    runtime = Runtime(plugins=[MyPlugin()])
    assert set(runtime.backends.ids()) == BUILTIN | {"mine"}
    assert isinstance(runtime.backends.get("mine"), Mine)


def test_a_plugin_registered_later_joins_the_registry_at_once() -> None:
    runtime = Runtime()
    assert "mine" not in runtime.backends
    plugin = MyPlugin()
    runtime.register(plugin)
    runtime.register(plugin)  # once is enough: no second "mine"
    assert runtime.backends.get("mine").id == "mine"


def test_an_installed_entry_point_adds_a_third_party_backend(
    installed: list[FakeDistribution], third_party_module: str
) -> None:
    installed.append(FakeDistribution(entry_point("theirs", third_party_module)))
    assert set(Runtime().backends.ids()) == BUILTIN | {"theirs"}


def test_an_entry_point_under_a_built_in_name_is_skipped(
    installed: list[FakeDistribution], third_party_module: str
) -> None:
    """As pluggy does for a name already registered: the built-in registered in code is the one used."""
    installed.append(FakeDistribution(entry_point("diff", third_party_module)))
    runtime = Runtime()
    assert set(runtime.backends.ids()) == BUILTIN
    assert type(runtime.backends.get("diff")).__module__ == "forkd_backends.diff"


def test_two_backends_with_one_id_are_refused() -> None:
    with pytest.raises(BackendError, match="two storage backends claim the id 'mine'"):
        Runtime(plugins=[MyPlugin(), MyPlugin()])


def test_register_plugin_reaches_the_runtimes_made_afterwards(no_default_plugins: None) -> None:
    before = Runtime()
    backend_module.register_plugin(MyPlugin())
    after = Runtime()
    assert "mine" in after.backends
    assert "mine" not in before.backends


def test_a_runtime_says_what_it_holds(installed: list[FakeDistribution]) -> None:
    runtime = Runtime()
    runtime.recorder.record("fork", 1.0)
    assert repr(runtime) == "<Runtime backends diff, full, uffd, 1 samples>"


def test_no_registry_or_recorder_is_kept_by_a_module() -> None:
    """The state lives in runtimes: the old process-wide entry points are gone."""
    for name in ("record", "active_recorder", "set_active_recorder", "_active_recorder"):
        assert not hasattr(timings, name), name
    for name in ("registry", "_registry"):
        assert not hasattr(backend_module, name), name


# -- factories --------------------------------------------------------------------------------------------------
@pytest.fixture
def two_factories() -> Iterator[tuple[VMFactory, VMFactory]]:
    first = VMFactory(engine="fake", runtime=Runtime(recorder=Recorder()))
    second = VMFactory(engine="fake")
    yield first, second
    first.close()
    second.close()


def test_a_factory_makes_its_own_runtime_or_takes_the_one_given() -> None:
    runtime = Runtime()
    given, made, other = (
        VMFactory(engine="fake", runtime=runtime),
        VMFactory(engine="fake"),
        VMFactory(engine="fake"),
    )
    try:
        assert given.runtime is runtime
        assert made.runtime is not other.runtime
    finally:
        for factory in (given, made, other):
            factory.close()


def test_the_timings_of_one_factorys_vms_stay_in_its_runtime(two_factories: tuple[VMFactory, VMFactory]) -> None:
    first, second = two_factories
    with first.boot(memory_mib=64) as root:
        root.exec("true")
        snapshot = root.branch(backend="full")
        (child,) = snapshot.fork()
        with child:
            child.exec("true")
    ops = [sample.op for sample in first.runtime.recorder.samples()]
    assert {"boot", "exec", "branch_pause", "branch_total", "fork"} <= set(ops)
    assert second.runtime.recorder.samples() == []


def test_a_vm_branches_with_the_backend_object_of_its_factorys_runtime(
    two_factories: tuple[VMFactory, VMFactory], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A change to a backend of one runtime (as a test's monkeypatch makes) reaches that factory's VMs only."""
    first, second = two_factories
    captured: list[str] = []
    full = first.runtime.backends.get("full")
    original = full.capture

    def spy(source: object, target: Path) -> Capture:
        captured.append("first")
        return original(source, target)  # type: ignore[arg-type]

    monkeypatch.setattr(full, "capture", spy)
    with first.boot(memory_mib=64) as one, second.boot(memory_mib=64) as two:
        one.branch(backend="full")
        two.branch(backend="full")
    assert captured == ["first"]


def test_a_session_hands_its_runtime_to_its_factory_and_reads_timings_from_its_recorder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pytest_forkd.project.session import ForkdSession

    monkeypatch.setenv("PYTEST_FORKD_STORE", str(tmp_path / "store"))
    with ForkdSession.open() as first, ForkdSession.open() as second:
        assert first.factory.runtime is first.runtime
        assert first.timings is first.runtime.recorder
        assert first.runtime is not second.runtime and first.timings is not second.timings


def test_a_session_given_only_a_recorder_records_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The constructor's earlier form, ``ForkdSession(settings, project, recorder=...)``, still works."""
    from pytest_forkd.latency.timings import Recorder
    from pytest_forkd.project.session import ForkdSession

    monkeypatch.setenv("PYTEST_FORKD_STORE", str(tmp_path / "store"))
    with ForkdSession.open() as opened:
        recorder = Recorder()
        with ForkdSession(opened.settings, opened.project, recorder=recorder) as session:
            assert session.timings is recorder and session.runtime.recorder is recorder
            assert session.factory.runtime is session.runtime
        with pytest.raises(ValueError, match="not both"):
            ForkdSession(opened.settings, opened.project, runtime=opened.runtime, recorder=Recorder())
