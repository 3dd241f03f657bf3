"""What a PyPI user gets: the version, the metadata, the licence, and what the sdist and wheel carry."""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser as MetadataParser
from pathlib import Path

import pytest

from pytest_forkd import __version__
from pytest_forkd.cli import main

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[2]
REQUIRED_CLASSIFIERS = {
    "Framework :: Pytest",
    "Operating System :: POSIX :: Linux",
    "Programming Language :: Python :: 3.10",
    "Programming Language :: Python :: 3.11",
    "Programming Language :: Python :: 3.12",
    "Programming Language :: Python :: 3.13",
}
PROJECT_URLS = {"Documentation", "Source", "Changelog", "Issues"}


@pytest.fixture(scope="module")
def project() -> dict[str, object]:
    return dict(tomllib.loads((REPO / "pyproject.toml").read_text())["project"])


def test_forkd_version_prints_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"forkd (pytest-forkd) {__version__}"


def test_forkd_version_from_the_installed_script() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pytest_forkd.cli", "--version"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert __version__ in done.stdout


def test_versions_agree(project: dict[str, object]) -> None:
    assert project["version"] == __version__, "set the same version in pyproject.toml and pytest_forkd/version.py"


def test_licence(project: dict[str, object]) -> None:
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_classifiers_and_urls(project: dict[str, object]) -> None:
    classifiers = set(project["classifiers"])  # type: ignore[call-overload]
    assert REQUIRED_CLASSIFIERS <= classifiers
    assert any(c in classifiers for c in ("Development Status :: 3 - Alpha", "Development Status :: 4 - Beta"))
    assert not any(c.startswith("License ::") for c in classifiers), "the SPDX license field replaces them"
    urls = project["urls"]
    assert isinstance(urls, dict) and PROJECT_URLS <= set(urls)
    assert all(str(url).startswith("https://") for url in urls.values())
    assert project["requires-python"] == ">=3.10"


def test_docs_extra(project: dict[str, object]) -> None:
    extras = project["optional-dependencies"]
    assert isinstance(extras, dict)
    names = {re.split(r"[\[<>=]", requirement)[0] for requirement in extras["docs"]}
    assert {"mkdocs", "mkdocs-material", "mkdocstrings"} <= names


def test_every_package_is_listed() -> None:
    """The package list in pyproject.toml is explicit: a new sub-package left out of it is missing from the wheel."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {".".join(path.parent.relative_to(REPO).parts) for path in (REPO / "pytest_forkd").rglob("__init__.py")}
    missing = found - listed
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"


def test_manifest_ships_tests_docs_and_changelog() -> None:
    manifest = (REPO / "MANIFEST.in").read_text()
    for needed in ("CHANGELOG.md", "LICENSE", "graft tests", "graft docs", "graft examples", "mkdocs.yml"):
        assert needed in manifest


@pytest.mark.slow
def test_built_distributions(tmp_path: Path) -> None:
    """``python -m build``: the wheel's metadata and the sdist's contents (fetches setuptools from PyPI)."""
    pytest.importorskip("build", reason="pip install build")
    done = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(tmp_path), str(REPO)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,) = tmp_path.glob("*.whl")
    (sdist,) = tmp_path.glob("*.tar.gz")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (metadata_name,) = [name for name in names if name.endswith(".dist-info/METADATA")]
        metadata = MetadataParser().parsestr(archive.read(metadata_name).decode())
        assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names)
        for package in ("pytest_forkd/guest/agent/__init__.py", "pytest_forkd/cli/bench/__init__.py"):
            assert package in names or not (REPO / package).exists()
    assert metadata["License-Expression"] == "Apache-2.0"
    assert REQUIRED_CLASSIFIERS <= set(metadata.get_all("Classifier"))
    assert {url.split(",")[0] for url in metadata.get_all("Project-URL")} >= PROJECT_URLS
    assert "pip install pytest-forkd" in (metadata.get_payload() or "")
    with tarfile.open(sdist) as archive:
        members = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    for needed in ("LICENSE", "CHANGELOG.md", "mkdocs.yml", "tests/unit/test_packaging.py", "docs/index.md"):
        assert needed in members, f"{needed} missing from the sdist"
    assert any(name.startswith("examples/") for name in members)
