"""The examples' ini files warn about nothing in a venv with pytest-forkd alone (no optional plugins).

Every pytest plugin installed here but pytest-forkd's is blocked (``-p no:NAME``), as in a venv made with
``pip install pytest-forkd``; collecting each example folder must then give no "Unknown config option".
"""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def optional_plugins() -> list[str]:
    """The pytest plugins installed here that a venv with pytest-forkd alone would not have."""
    return sorted(ep.name for ep in entry_points(group="pytest11") if ep.dist is None or ep.dist.name != "pytest-forkd")


def example_folders() -> list[Path]:
    """Each folder of the examples a user runs pytest in: those with a pytest.ini, and the frameworks' ones."""
    folders = {path.parent for path in EXAMPLES.rglob("pytest.ini")}
    folders |= {path for path in (EXAMPLES / "frameworks").iterdir() if path.is_dir()}
    return sorted(folders)


@pytest.mark.slow  # a pytest in a subprocess per folder, collecting (and so importing) the examples
@pytest.mark.parametrize("folder", example_folders(), ids=lambda path: str(path.relative_to(EXAMPLES)) or ".")
def test_collecting_an_example_without_optional_plugins_warns_about_no_config_option(
    folder: Path, tmp_path: Path
) -> None:
    blocked = [word for name in optional_plugins() for word in ("-p", f"no:{name}")]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", *blocked],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "cache")},
    )
    output = result.stdout + result.stderr
    assert result.returncode in (0, pytest.ExitCode.NO_TESTS_COLLECTED), output
    assert "Unknown config option" not in output, output
    assert "PytestConfigWarning" not in output, output
