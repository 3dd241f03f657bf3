"""The second example (examples/port_project: toolz's own tests, from its sdist, under ``pytest --forkd-isolate``).

``make example-port`` runs every test of toolz; here a few of its modules keep
this to a minute or two on a 2-core TCG host. What the example adds to the
project is forkd.yaml and the option, nothing else: the unpacked files are
the sdist's own.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from support import assert_nothing_left

EXAMPLE = Path(__file__).parents[2] / "examples" / "port_project"
SUBSET = ["toolz/tests/test_signatures.py", "toolz/tests/test_tlz.py", "toolz/tests/test_utils.py"]


def run_example(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLE / "run.py"), *args],
        env={name: value for name, value in os.environ.items() if not name.startswith("PYTEST_FORKD_")},
        capture_output=True,
        text=True,
        timeout=1500,
    )


def passed(output: str) -> int:
    found = re.search(r"(\d+) passed", output)
    return int(found.group(1)) if found else 0


def test_only_forkd_yaml_is_added_to_the_unpacked_sdist(tmp_path: Path) -> None:
    result = run_example("--into", str(tmp_path), "--unpack-only")
    assert result.returncode == 0, result.stderr
    project = Path(result.stdout.strip())
    with tarfile.open(EXAMPLE / "vendor" / "toolz-0.12.1.tar.gz") as sdist:
        members = {member.name.split("/", 1)[1]: member for member in sdist.getmembers() if "/" in member.name}
        for name, member in members.items():
            if member.isfile():
                extracted = sdist.extractfile(member)
                assert extracted is not None
                assert (project / name).read_bytes() == extracted.read(), name
    on_disk = {str(path.relative_to(project)) for path in project.rglob("*")}
    assert on_disk - set(members) == {"forkd.yaml"}


@pytest.mark.vm
def test_the_ported_projects_tests_pass_in_vms_as_on_the_host(
    shm_dir: Path, shared_store: Path, tmp_path: Path
) -> None:
    into = str(tmp_path / "projects")
    host = run_example("--into", into, "--host", "-p", "no:cacheprovider", *SUBSET)
    assert host.returncode == 0, host.stdout[-4000:]
    isolated = run_example(
        "--into", into, f"--forkd-store={shared_store}", "-p", "no:cacheprovider", "-p", "no:randomly", "-rA", *SUBSET
    )
    output = isolated.stdout + isolated.stderr
    assert isolated.returncode == 0, output[-6000:]
    assert passed(isolated.stdout) == passed(host.stdout) > 0, output[-6000:]
    assert "--forkd-isolate" in isolated.stdout.splitlines()[0]
    assert_nothing_left(shm_dir)
