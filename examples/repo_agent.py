"""A scripted coding agent that edits a small repository in the guest over 200 steps.

No language model: :func:`plan` returns the same 200 shell commands every time,
the kind of tool calls a coding agent makes (append a function, edit notes,
add and archive documents, chmod a script, bump a version). Step
:data:`BAD_STEP` quietly breaks ``add``, and with it the repository's tests;
the example suite finds that step by bisecting the agent's trajectory.
"""

from __future__ import annotations

import shlex

REPO = "/srv/repo"
STEPS = 200
BAD_STEP = 136

#: The repository the agent works on, put into the parent VM once (see conftest.py).
FILES = {
    "calc.py": "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n",
    "test_calc.py": (
        "import calc\n"
        "assert calc.add(2, 3) == 5, 'add is broken'\n"
        "assert calc.mul(2, 3) == 6, 'mul is broken'\n"
        "print('ok')\n"
    ),
    "NOTES.md": "# Notes\n",
    "VERSION": "0.1.0\n",
    "run.sh": '#!/bin/sh\ncd "$(dirname "$0")" && exec python3 -B test_calc.py\n',
}
#: The repository's own test command: exit status 0 when it is healthy.
TEST_COMMAND = f"cd {REPO} && python3 -B test_calc.py"  # -B: a check must not leave .pyc files behind


def _step(index: int) -> str:
    """Step ``index`` (1-based) of the agent's plan, as one shell command run in the repository."""
    if index == BAD_STEP:  # the mistake: an over-eager "simplification" of add()
        return "sed -i 's/return a + b/return a - b/' calc.py"
    kind = index % 5
    if kind == 0:
        return f"printf '\\n\\ndef helper_{index}(x):\\n    return x + {index}\\n' >> calc.py"
    if kind == 1:
        return f"echo {shlex.quote(f'- step {index}: reviewed the code')} >> NOTES.md"
    if kind == 2:
        return f"mkdir -p docs && echo 'design note {index}' > docs/note_{index}.md"
    if kind == 3:
        return f"mv docs/note_{index - 1}.md docs/archived_{index - 1}.md"
    if index % 20 == 4:
        return f"echo 0.1.{index} > VERSION && chmod {'755' if index % 40 == 4 else '644'} run.sh"
    return f"rm docs/archived_{index - 2}.md"


def plan(steps: int = STEPS) -> list[str]:
    """The agent's tool calls: shell commands, each to be run with ``cwd=REPO``."""
    return [_step(index) for index in range(1, steps + 1)]


def step_actions(steps: int = STEPS):
    """The plan as trajectory steps: callables that run one command in the repository."""

    def action(command: str):
        def run(vm):
            return vm.exec(command, cwd=REPO, check=True)

        run.label = command
        return run

    return [action(command) for command in plan(steps)]
