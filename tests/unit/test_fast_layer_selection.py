"""The test layers of tests/conftest.py: which tests ``-m "not vm"`` leaves out, and which modules it never imports."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest


def load_layers() -> ModuleType:
    """tests/conftest.py as a module of its own (pytest holds every conftest.py under the name ``conftest``)."""
    spec = importlib.util.spec_from_file_location("forkd_test_layers", Path(__file__).parents[1] / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


layers = load_layers()


def config(markexpr: str) -> pytest.Config:
    return SimpleNamespace(option=SimpleNamespace(markexpr=markexpr))  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("markexpr", "left_out"),
    [
        ("not vm", ("slow", "oci_tools")),
        ("not vm and slow", ("oci_tools",)),
        ("not vm and (slow or oci_tools)", ()),
        ("not vm and not slowest", ("slow", "oci_tools")),  # a marker merely starting with "slow" names none
        ("oci_tools", ()),
        ("vm", ()),
        ("", ()),
    ],
)
def test_the_fast_layer_leaves_out_heavy_markers_its_expression_does_not_name(
    markexpr: str, left_out: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FORKD_TESTS_SLOW", raising=False)
    assert layers._left_out(config(markexpr)) == left_out


def test_forkd_tests_slow_brings_every_heavy_test_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORKD_TESTS_SLOW", "1")
    assert layers._left_out(config("not vm")) == ()


@pytest.mark.parametrize(
    ("source", "left_out", "skipped"),
    [
        ("import pytest\npytestmark = pytest.mark.vm\n", ("slow",), True),
        ("import pytest\npytestmark = [pytest.mark.slow, needs_registry]\n", ("slow", "oci_tools"), True),
        (  # a skip condition beside the marker, the marker after a line break
            'import pytest\npytestmark = [\n    pytest.mark.skipif(True, reason="x"),\n    pytest.mark.slow,\n]\n',
            ("slow", "oci_tools"),
            True,
        ),
        (
            'import pytest\npytestmark = pytest.mark.skipif(True, reason="x")\n\n@pytest.mark.vm\ndef test_x(): pass\n',
            ("slow", "oci_tools"),
            False,
        ),  # a test marked below is not the module marked
        ("import pytest\npytestmark = [pytest.mark.slow]\n", ("oci_tools",), False),  # slow named: imported
        ("import pytest\npytestmark = pytest.mark.oci_tools\n", ("slow", "oci_tools"), True),
        ("import pytest\npytestmark = pytest.mark.alone\n", ("slow", "oci_tools"), False),
        ('"""pytestmark = pytest.mark.vm (only in a string)"""\n', ("slow", "oci_tools"), False),
        ("def test_x():\n    pass\n", ("slow", "oci_tools"), False),
    ],
)
def test_a_module_whose_every_test_is_left_out_is_not_imported(
    tmp_path: Path, source: str, left_out: tuple[str, ...], skipped: bool
) -> None:
    module = tmp_path / "test_module.py"
    module.write_text(source)
    assert layers.fast_layer_skips(module, left_out) is skipped


def test_every_module_of_a_folder_marked_as_a_whole_is_skipped_without_reading_it() -> None:
    for folder, mark in layers.FOLDER_MARKS.items():
        missing = folder / "test_never_written.py"  # not read: the folder decides
        assert layers.fast_layer_skips(missing, ("slow", "oci_tools")) is True, mark


def item(fixturenames: list[str], params: dict[str, object] | None = None) -> pytest.Item:
    fake = SimpleNamespace(fixturenames=fixturenames)
    if params is not None:
        fake.callspec = SimpleNamespace(params=params)
    return fake  # type: ignore[return-value]


def test_registry_fixtures_mark_a_test_but_a_parameter_of_that_name_does_not() -> None:
    assert layers._uses_registry(item(["tmp_path", "busybox_image", "registry"]))
    assert layers._uses_registry(item(["project_image"]))
    assert not layers._uses_registry(item(["registry", "expected"], params={"registry": "docker.io", "expected": 1}))
    assert not layers._uses_registry(item(["tmp_path"]))


def run_config(tmp_path: Path, args: list[str], markexpr: str = "not vm", **options: object) -> pytest.Config:
    """A parsed command line as fast_layer_workers reads it, run from ``tmp_path`` (which holds ``tests/a.py``)."""
    (tmp_path / "tests").mkdir(exist_ok=True)
    (tmp_path / "tests" / "a.py").touch()
    values = {"markexpr": markexpr, "numprocesses": None, "usepdb": False, "capture": "fd", "collectonly": False}
    values.update(options)
    return SimpleNamespace(  # type: ignore[return-value]
        option=SimpleNamespace(**values),
        args=args,
        invocation_params=SimpleNamespace(dir=tmp_path),
        pluginmanager=SimpleNamespace(hasplugin=lambda name: name == "xdist"),
    )


@pytest.mark.parametrize(
    ("args", "markexpr", "options", "spread"),
    [
        (["tests"], "not vm", {}, True),  # the fast layer over its folder
        (["tests", "tests"], "not vm", {}, True),
        (["tests/a.py"], "not vm", {}, False),  # one file: a worker's start costs more than it saves
        (["tests"], "", {}, False),  # every test: the suite's own -n decides
        (["tests"], "vm", {}, False),
        (["tests"], "not vm", {"numprocesses": 0}, False),  # -n 0: one process, as asked
        (["tests"], "not vm", {"numprocesses": 3}, False),  # -n given: xdist takes it as it is
        (["tests"], "not vm", {"usepdb": True}, False),
        (["tests"], "not vm", {"capture": "no"}, False),
        (["tests"], "not vm", {"collectonly": True}, False),
    ],
)
def test_the_fast_layer_spreads_over_the_cores_only_for_whole_folders(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    markexpr: str,
    options: dict[str, object],
    spread: bool,
) -> None:
    monkeypatch.delenv("FORKD_TESTS_SLOW", raising=False)
    monkeypatch.setattr(layers.os, "sched_getaffinity", lambda pid: {0, 1})
    assert layers.fast_layer_workers(run_config(tmp_path, args, markexpr, **options)) == (2 if spread else 0)


def test_one_core_or_a_worker_gets_no_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FORKD_TESTS_SLOW", raising=False)
    monkeypatch.setattr(layers.os, "sched_getaffinity", lambda pid: {0})
    assert layers.fast_layer_workers(run_config(tmp_path, ["tests"])) == 0
    monkeypatch.setattr(layers.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert layers.fast_layer_workers(run_config(tmp_path, ["tests"])) == 4  # at most four
    worker = run_config(tmp_path, ["tests"])
    worker.workerinput = {}  # type: ignore[attr-defined]
    assert layers.fast_layer_workers(worker) == 0
