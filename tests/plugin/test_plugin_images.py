"""Guest images declared in forkd.yaml, built on demand (cached by content) and booted by snapshots."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from pytest_forkd.image.builder import image_key
from pytest_forkd.project.config import load_project
from pytest_forkd.project.images import ensure_project_image, image_recipe

pytestmark = pytest.mark.vm

FORKD_YAML = """
images:
  jqtools:
    packages: [jq]
    files: {tool.sh: /usr/local/bin/tool}
    setup: ['tool > /etc/image-setup-ran']
snapshots:
  work:
    from: image:jqtools
    memory_mib: 256
    workdir: /srv
    setup: ['echo 41 > n.json']
  tiny:
    from: image:jqtools
    memory_mib: 100
"""

SUITE = """
import pytest

@pytest.mark.forkd(snapshot="work")
def test_the_image_has_the_package_the_file_and_ran_its_setup(forkd_vm):
    result = forkd_vm.exec("jq .+1 n.json")
    assert result.stdout == "42\\n", result.stderr
    assert forkd_vm.exec("tool").stdout == "hello-from-tool\\n"
    assert forkd_vm.read_file("/etc/image-setup-ran") == b"hello-from-tool\\n"
    assert forkd_vm.image.name == "jqtools"

@pytest.mark.forkd(snapshot="tiny")
def test_too_little_memory(forkd_vm):
    pass
"""


def _write_project(folder: Path) -> None:
    tool = folder / "tool.sh"
    tool.write_text("#!/bin/sh\necho hello-from-tool\n")
    tool.chmod(0o755)
    (folder / "forkd.yaml").write_text(FORKD_YAML)


def test_an_image_declared_in_forkd_yaml_is_built_on_demand_and_booted(
    pytester: pytest.Pytester, run_forkd: Callable[..., pytest.RunResult], tmp_path: Path
) -> None:
    _write_project(pytester.path)
    pytester.makepyfile(test_images=SUITE)

    result = run_forkd("-s", store=tmp_path / "store")

    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*forkd: building snapshot 'work' from image 'jqtools' (1 setup command)*"])
    # The guest memory is checked against the image before anything boots, naming the field to fix.
    result.stdout.fnmatch_lines(
        ["*forkd.yaml: snapshots.tiny.memory_mib: memory_mib=100 is too small for image 'jqtools'*use memory_mib >= *"]
    )

    again = run_forkd("-s", "-k", "has_the_package", store=tmp_path / "store")
    again.assert_outcomes(passed=1)
    again.stdout.fnmatch_lines(["*forkd: using cached snapshot 'work'*"])
    again.stdout.no_fnmatch_line("*image 'jqtools': resolving*")


def test_images_are_cached_by_content(tmp_path: Path) -> None:
    _write_project(tmp_path)
    image = load_project(tmp_path / "forkd.yaml").images["jqtools"]
    lines: list[str] = []

    built = ensure_project_image(image, progress=lines.append)
    reused = ensure_project_image(image, progress=lines.append)

    assert reused.key == built.key == image_key(image_recipe(image))
    (tmp_path / "tool.sh").write_text("#!/bin/sh\necho changed\n")  # another file content: another image
    assert image_key(image_recipe(image)) != built.key


def test_an_unknown_package_names_the_image_entry(tmp_path: Path) -> None:
    from pytest_forkd.errors import ImageError

    (tmp_path / "forkd.yaml").write_text("images:\n  broken:\n    packages: [no-such-package-forkd]\n")
    image = load_project(tmp_path / "forkd.yaml").images["broken"]

    with pytest.raises(ImageError, match="forkd.yaml: images.broken: .*no-such-package-forkd"):
        ensure_project_image(image)
