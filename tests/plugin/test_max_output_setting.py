"""The max_output setting: forkd.yaml, ini, env and option, down to every VM of a factory (no VM)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_forkd.core.factory import VMFactory
from pytest_forkd.errors import ConfigError
from pytest_forkd.guest.client import DEFAULT_MAX_OUTPUT
from pytest_forkd.project.config import load_project
from pytest_forkd.project.settings import resolve
from pytest_forkd.sizes import parse_byte_size


def settings(**layers):
    return resolve(
        cli=layers.get("cli", {}),
        env=layers.get("env", {}),
        ini=layers.get("ini", {}),
        project_settings=layers.get("project", {}),
        backends=lambda: ["diff"],
        rootdir=Path("/p"),
    )


def test_default_fits_ordinary_output() -> None:
    assert settings().max_output == DEFAULT_MAX_OUTPUT == 4 << 20


def test_forkd_yaml_accepts_bytes_or_units(tmp_path: Path) -> None:
    config = tmp_path / "forkd.yaml"
    config.write_text("settings:\n  max_output: 512KiB\n")

    project = load_project(config)

    assert settings(project=project.settings).max_output == 512 << 10
    assert settings(project=project.settings).sources["max_output"] == "forkd.yaml settings.max_output"


def test_option_env_and_ini_take_precedence_in_order() -> None:
    layers = {"cli": {"max_output": "1MiB"}, "env": {"PYTEST_FORKD_MAX_OUTPUT": "2048"}, "ini": {"max_output": "3k"}}

    assert settings(**layers).max_output == 1 << 20
    assert settings(env=layers["env"], ini=layers["ini"]).max_output == 2048
    assert settings(ini=layers["ini"]).max_output == 3072


@pytest.mark.parametrize("bad", ["-1", "lots", "4 parsecs", "1.5MiB"])
def test_bad_sizes_name_their_source(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"PYTEST_FORKD_MAX_OUTPUT: expected a size in bytes"):
        settings(env={"PYTEST_FORKD_MAX_OUTPUT": bad})


def test_bad_size_in_forkd_yaml_names_the_field(tmp_path: Path) -> None:
    config = tmp_path / "forkd.yaml"
    config.write_text("settings:\n  max_output: -5\n")

    with pytest.raises(ConfigError, match=r"settings\.max_output: expected a size in bytes"):
        load_project(config)


def test_sizes_parse() -> None:
    assert [parse_byte_size(v, "x") for v in (0, "10", "1 MiB", "2G", "3kib")] == [0, 10, 1 << 20, 2 << 30, 3072]


def test_a_factory_hands_its_max_output_to_its_vms() -> None:
    factory = VMFactory(max_output=1234)
    try:
        assert factory.max_output == 1234
    finally:
        factory.close()
