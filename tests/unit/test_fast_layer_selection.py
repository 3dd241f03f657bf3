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
