"""scripts/setup.sh and README.md name the same system packages, and container image tools are optional.

An administrator prepares a host for normal users with README.md's line for a
clone; set-up then must not ask for root again. So every package set-up
insists on is on that line, and the container image tools (skopeo,
e2fsprogs), which only container images need, are never among them: set-up
installs those when it can without a password and otherwise says so once.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SETUP = REPO / "scripts" / "setup.sh"
README = REPO / "README.md"
IMAGE_TOOLS = {"skopeo", "e2fsprogs"}


def added(variable: str) -> set[str]:
    """Every package setup.sh adds to the bash array ``variable`` (``variable+=(name)``)."""
    return set(re.findall(rf"\b{variable}\+=\(([\w.+-]+)\)", SETUP.read_text()))


def readme_clone_line() -> set[str]:
    """The packages of README.md's ``sudo apt-get install`` line for a clone (in its "From a clone" section)."""
    section = README.read_text().split("## From a clone", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"`sudo apt-get install ([^`]+)`", section)
    assert match, "README.md's 'From a clone' section names no `sudo apt-get install ...` line"
    return set(match.group(1).split())


def test_every_package_setup_insists_on_is_on_readmes_line() -> None:
    required = added("need_pkgs")
    assert required, "no need_pkgs+=(...) found in scripts/setup.sh"
    assert required <= readme_clone_line(), required - readme_clone_line()
    # and the line names nothing more than set-up needs, plus make to run it
    assert readme_clone_line() - required <= {"make"}


def test_container_image_tools_are_optional_and_named_in_the_readme() -> None:
    assert added("image_pkgs") == IMAGE_TOOLS
    assert not IMAGE_TOOLS & added("need_pkgs")
    text = README.read_text()
    assert "skopeo e2fsprogs" in text


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_without_root_or_sudo_the_missing_image_tools_are_named_once_and_setup_goes_on(tmp_path: Path) -> None:
    """The package checks of setup.sh, run as a normal user with a PATH that has no skopeo, no mke2fs and no sudo."""
    script = SETUP.read_text()
    checks = script[script.index("# What `make example`") : script.index("if [ ${#need_pkgs[@]} -gt 0 ]; then")]
    tools = tmp_path / "bin"
    tools.mkdir()
    for name in ("qemu-system-x86_64", "git", "gpgv", "cat", "id"):
        found = shutil.which(name)
        if found:
            (tools / name).symlink_to(found)
    probe = tmp_path / "probe.sh"
    probe.write_text("IS_ROOT=0\nPYTHON=python3\n" + checks + 'echo "required: ${need_pkgs[*]}"\n')
    env = {"PATH": str(tools), "HOME": str(tmp_path)}
    result = subprocess.run(
        [shutil.which("bash") or "bash", str(probe)], capture_output=True, text=True, env=env, timeout=60
    )
    lines = [line for line in result.stderr.splitlines() if "container images" in line]
    missing = "skopeo" if Path("/sbin/mke2fs").exists() else "skopeo e2fsprogs"  # setup also looks there
    assert len(lines) == 1 and f"need {missing}, which only root can install" in lines[0], result.stderr
    assert result.stdout.startswith("required: ") and "skopeo" not in result.stdout and "e2fsprogs" not in result.stdout
