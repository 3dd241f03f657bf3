"""mini-swe-agent fixes a failing test inside a container image, in a forkd VM instead of a Docker container.

The task image (``calc-task``: a project in ``/srv/project`` whose ``add``
subtracts) is what ``images/make_images.py`` writes; ``config.yaml`` names
forkd's environment class by its import path, with Docker's keys (``cwd``,
``env``, ``timeout``). The agent is mini-swe-agent's own ``DefaultAgent``
with the prompts of its ``mini.yaml``.

Run it::

    python examples/frameworks/images/make_images.py   # once: prints FORKD_EXAMPLE_TASK_IMAGE=...
    export FORKD_EXAMPLE_TASK_IMAGE=oci-archive:$PWD/examples/frameworks/images/calc-task.tar
    python examples/frameworks/mini_swe_agent/run.py

Offline (no OPENAI_API_KEY) mini-swe-agent's ``DeterministicModel`` plays
the agent: it runs the tests, fixes ``calc.py`` with sed, checks and
submits. With OPENAI_API_KEY set, a real model (``FORKD_EXAMPLE_MODEL``,
default ``openai/gpt-4.1-mini``, through LiteLLM) works on its own. Either
way the script then runs the tests in the agent's VM and in a second
environment of the same image (a sibling fork of the same warm parent,
which still has the bug), and exits 0 when the agent submitted and its
tests pass.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import yaml
from minisweagent.agents.default import DefaultAgent
from minisweagent.config import get_config_from_spec
from minisweagent.environments import get_environment
from minisweagent.models import get_model
from minisweagent.models.test_models import DeterministicModel, make_output
from minisweagent.utils.serialize import recursive_merge

HERE = Path(__file__).resolve().parent
TASK = "test_calc.py fails: add() returns the wrong result. Fix calc.py so that `python3 test_calc.py` passes."
TESTS = "python3 test_calc.py 2>&1 | tail -1"
#: The offline agent's moves: look, fix, check, hand in the fixed file.
MOVES = [
    ("Let me run the tests first.", TESTS),
    ("add() subtracts; it should add.", "sed -i 's/a - b/a + b/' calc.py && cat calc.py"),
    ("Check the fix.", TESTS),
    ("The tests pass; submitting.", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat calc.py"),
]


def task_image() -> str:
    image = os.environ.get("FORKD_EXAMPLE_TASK_IMAGE")
    if image:
        return image
    made = HERE.parent / "images" / "calc-task.tar"
    if made.is_file():
        return f"oci-archive:{made}"
    sys.exit("no task image: run examples/frameworks/images/make_images.py, or set FORKD_EXAMPLE_TASK_IMAGE")


def config() -> dict[str, Any]:
    """mini-swe-agent's own mini.yaml, with this folder's config.yaml over it and the task image."""
    ours = yaml.safe_load((HERE / "config.yaml").read_text())
    merged: dict[str, Any] = recursive_merge(get_config_from_spec("mini.yaml"), ours)
    merged["environment"]["image"] = task_image()
    merged["agent"].pop("mode", None)  # the interactive agent's setting; DefaultAgent runs unattended
    return merged


def model(settings: dict[str, Any]) -> Any:
    """A real model when OPENAI_API_KEY is set, else mini-swe-agent's DeterministicModel with :data:`MOVES`."""
    if os.environ.get("OPENAI_API_KEY"):
        return get_model(os.environ.get("FORKD_EXAMPLE_MODEL", "openai/gpt-4.1-mini"), settings.get("model", {}))
    return DeterministicModel(outputs=[make_output(thought, [{"command": command}]) for thought, command in MOVES])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--trajectory", type=Path, default=None, help="save the agent's trajectory here (JSON)")
    args = parser.parse_args(argv)
    settings = config()
    env = get_environment(settings["environment"])
    sibling = get_environment(settings["environment"])  # a second environment: the same warm parent, forked again
    try:
        agent = DefaultAgent(model(settings), env, **settings["agent"], output_path=args.trajectory)
        result = agent.run(TASK)
        print(f"exit status: {result.get('exit_status')}; submission:\n{result.get('submission', '')}")
        fixed = env.execute({"command": TESTS})["output"].strip()
        untouched = sibling.execute({"command": TESTS})["output"].strip()
        print(f"tests in the agent's VM: {fixed}; in a sibling VM of the same image: {untouched}")
        return 0 if result.get("exit_status") == "Submitted" and fixed == "OK" else 1
    finally:
        env.cleanup()  # type: ignore[attr-defined]
        sibling.cleanup()  # type: ignore[attr-defined]


if __name__ == "__main__":
    sys.exit(main())
