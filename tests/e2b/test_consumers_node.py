"""The npm ``e2b`` SDK, unchanged, run by node against the ``forkd_e2b`` server: create, run, write, read, kill.

The package is installed from npm on first use and cached (consumers_env);
node sees nothing of forkd but ``E2B_API_URL``, ``E2B_SANDBOX_URL`` and
``E2B_API_KEY``. It speaks Connect with JSON over HTTP/1.1 to envd, uploads
text as multipart/form-data and creates sandboxes through ``/v2/sandboxes``,
all different from the Python SDK's choices.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from consumers_env import node_modules
from consumers_server import consumer_environment, run_consumer

pytestmark = pytest.mark.vm

#: The npm SDK version tested (the registry's current release when this test was written).
NPM_E2B = "e2b@2.51.0"
SCRIPT = Path(__file__).with_name("consumers_node.cjs")


def test_the_npm_sdk_creates_runs_writes_reads_and_kills(forkd_e2b, tmp_path: Path) -> None:
    modules = node_modules("npm-e2b", [NPM_E2B])
    env = consumer_environment(forkd_e2b.env, NODE_PATH=str(modules))
    node = "node"

    out = run_consumer([node, str(SCRIPT)], env, tmp_path)

    assert out["run"] == {"stdout": "hello from /tmp\n", "stderr": "to-stderr\n", "exitCode": 0}
    assert out["failed"] == {"isCommandExitError": True, "exitCode": 3, "stdout": "partial\n"}
    assert out["streamed"] == "line-1\nline-2\nline-3\n"
    assert out["read"] == out["catted"] == "written by node\n"  # the SDK's read, and cat in the sandbox
    assert out["exists"] is True and out["listed"] == ["from-node.txt"]
    assert out["sandboxId"] in out["sandboxes"]
    assert out["connectAfterKill"]["notFound"] is True, out["connectAfterKill"]
    assert forkd_e2b.sandbox_ids() == []  # killed by node: its VM is gone
