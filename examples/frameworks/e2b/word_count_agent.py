"""A small coding agent written only against E2B's SDK: it writes a script into a sandbox, runs it, reads the result.

Nothing here knows about forkd. The agent takes documents, puts them into a
fresh sandbox (``Sandbox.create()``), asks its model for a Python script that
counts their words, runs the script there, and reads back the report the
script wrote. When the script fails, the model gets the error and tries
again, as a coding agent does. It runs on E2B itself (``E2B_API_KEY``) or,
unchanged, on forkd's E2B server::

    forkd e2b serve > e2b.env &                 # E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY, once ready
    until [ -s e2b.env ]; do sleep 1; done; . ./e2b.env
    python examples/frameworks/e2b/word_count_agent.py
    kill %1                                     # the server ends, and its sandboxes with it

and its tests (``pytest examples/frameworks/e2b``, from the examples suite)
use the ``forkd_e2b`` fixture, which sets that environment for each test.
The model is scripted, so the example runs offline: its first script forgets
an import, the second one works.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from e2b import CommandExitException, Sandbox

#: Where the agent works in the sandbox (E2B's user's home).
WORKDIR = "/home/user/agent"
DATA = "/home/user/data"

TASK = (
    f"Write a Python script that counts the words of every file in the folder given as its first argument "
    f"and prints a JSON object: the total, and the three most common words with their counts. "
    f"The files are in {DATA}."
)

EXAMPLE_DOCUMENTS = {
    "fox.txt": "the quick brown fox jumps over the lazy dog\n",
    "dog.txt": "the dog sleeps and the fox runs\n",
    "cat.txt": "a cat watches the dog\n",
}

FIRST_SCRIPT = """\
import json, pathlib, sys

words = []
for path in sorted(pathlib.Path(sys.argv[1]).iterdir()):
    words += path.read_text().split()
counts = Counter(words)
print(json.dumps({"total": len(words), "top": counts.most_common(3)}))
"""


class ScriptedModel:
    """An offline stand-in for an LLM: a first script with a bug, and the fix once it sees the error."""

    def __init__(self) -> None:
        self.prompts: list[str] = []

    def write_script(self, task: str, error: str | None) -> str:
        self.prompts.append(task if error is None else f"{task}\nYour script failed:\n{error}")
        if error is not None and "NameError: name 'Counter'" in error:
            return "from collections import Counter\n" + FIRST_SCRIPT
        return FIRST_SCRIPT


@dataclass
class AgentResult:
    """What the agent found, how many scripts it wrote, and the sandbox it worked in."""

    report: dict[str, Any]
    attempts: int
    sandbox_id: str
    errors: list[str] = field(default_factory=list)


def run_agent(sandbox: Sandbox, model: ScriptedModel, documents: dict[str, str], max_attempts: int = 3) -> AgentResult:
    """The agent's loop in ``sandbox``: upload the data, then write, run and fix a script until it works."""
    sandbox.files.write_files([{"path": f"{DATA}/{name}", "data": text} for name, text in documents.items()])
    errors: list[str] = []
    for attempt in range(1, max_attempts + 1):
        script = model.write_script(TASK, errors[-1] if errors else None)
        sandbox.files.write(f"{WORKDIR}/count_words.py", script)
        try:
            sandbox.commands.run(f"python3 count_words.py {DATA} > report.json", cwd=WORKDIR)
        except CommandExitException as failure:  # a non-zero exit: the error goes back to the model
            errors.append(failure.stderr)
            continue
        report = json.loads(sandbox.files.read(f"{WORKDIR}/report.json"))
        return AgentResult(report, attempt, sandbox.sandbox_id, errors)
    raise RuntimeError(f"no working script after {max_attempts} attempts; last error:\n{errors[-1]}")


def count_words(documents: dict[str, str], model: ScriptedModel | None = None) -> AgentResult:
    """Run the agent in a sandbox of its own, killed when it is done."""
    with Sandbox.create(timeout=300) as sandbox:
        return run_agent(sandbox, model or ScriptedModel(), documents)


if __name__ == "__main__":
    result = count_words(EXAMPLE_DOCUMENTS)
    print(f"after {result.attempts} script(s), in sandbox {result.sandbox_id}: {json.dumps(result.report)}")
