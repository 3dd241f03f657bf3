"""The second example suite (examples/port_project: toolz's own tests in forked VMs) runs and passes.

A subset of the project's test modules keeps this within a few minutes on a
2-core TCG host; ``make example-port`` runs them all.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import assert_nothing_left

EXAMPLE = Path(__file__).parents[2] / "examples" / "port_project"
SUBSET = "test_tlz or test_utils or test_signatures or test_the_tests_import_the_copied_source"


@pytest.mark.vm
def test_the_ported_projects_tests_pass_in_forked_vms(shm_dir: Path, shared_store: Path, tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            "-k",
            SUBSET,
            f"--forkd-store={shared_store}",
            f"--basetemp={tmp_path / 'basetemp'}",
            "-rA",
        ],
        cwd=EXAMPLE,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=1500,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "4 passed" in result.stdout, output[-6000:]
    assert "copied " in result.stdout or "PASSED test_toolz.py" in result.stdout
    assert_nothing_left(shm_dir)
