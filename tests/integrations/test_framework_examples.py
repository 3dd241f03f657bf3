"""The image examples of examples/frameworks/, run as their docs say, offline: their own images, real VMs.

``images/make_images.py`` writes the base and task images (OCI archives from
Debian packages); the Inspect task builds its compose file's image FROM the
base with podman, and the mini-swe-agent run fixes the task image's failing
test with its DeterministicModel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vm

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "frameworks"


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The examples' images, made as the docs say (into a folder of the test's own)."""
    folder = tmp_path_factory.mktemp("example-images")
    made = run([str(EXAMPLES / "images" / "make_images.py"), "--output", str(folder)])
    exported = dict(
        line.removeprefix("export ").split("=", 1) for line in made.splitlines() if line.startswith("export")
    )
    assert exported == {
        "FORKD_EXAMPLE_BASE": f"oci-archive:{folder / 'base.tar'}",
        "FORKD_EXAMPLE_TASK_IMAGE": f"oci-archive:{folder / 'calc-task.tar'}",
    }
    return exported


def run(argv: list[str], **environment: str) -> str:
    offline = {name: value for name, value in os.environ.items() if name != "OPENAI_API_KEY"}
    completed = subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        env={**offline, "MSWEA_SILENT_STARTUP": "1", **environment},
        timeout=900,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return completed.stdout


def test_the_inspect_task_builds_its_compose_image_and_answers_every_sample(
    images: dict[str, str], tmp_path: Path
) -> None:
    if shutil.which("podman") is None and shutil.which("buildah") is None:
        pytest.skip("the compose file's build: needs podman or buildah here (docker does not run on this host)")
    output = run(
        [str(EXAMPLES / "inspect_compose" / "task.py"), "--log-dir", str(tmp_path / "logs")],
        FORKD_EXAMPLE_BASE=images["FORKD_EXAMPLE_BASE"],
    )
    assert "accuracy 1.00 over 4 samples, each in a forkd VM of the compose file's image" in output


def test_mini_swe_agent_fixes_the_failing_test_of_the_task_image(images: dict[str, str], tmp_path: Path) -> None:
    trajectory = tmp_path / "trajectory.json"
    output = run(
        [str(EXAMPLES / "mini_swe_agent" / "run.py"), "--trajectory", str(trajectory)],
        FORKD_EXAMPLE_TASK_IMAGE=images["FORKD_EXAMPLE_TASK_IMAGE"],
    )
    assert "exit status: Submitted" in output
    assert "tests in the agent's VM: OK; in a sibling VM of the same image: FAILED (failures=2)" in output
    assert '"exit_status": "Submitted"' in trajectory.read_text()
