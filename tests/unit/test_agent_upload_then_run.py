"""A file the agent has just written can be run at once: the upload is closed before it is moved into place.

Tests upload a tool and run it in the next request. The agent used to rename the
upload into place while its descriptor was still open and close it only after
replying, so a quick enough exec failed with ETXTBSY (exit 126, "Text file busy").
"""

from __future__ import annotations

from pathlib import Path

from agent_pair import AgentPair

from pytest_forkd.guest.client import AgentClient


def test_an_uploaded_program_runs_in_the_very_next_request(tmp_path: Path) -> None:
    with AgentPair() as pair, AgentClient(pair.host_end) as client:
        for round_ in range(40):
            tool = tmp_path / f"tool{round_ % 2}"
            client.write_file(str(tool), f"#!/bin/sh\necho round {round_}\n", mode=0o755)
            result = client.exec([str(tool)])
            assert (result.exit_code, result.stdout) == (0, f"round {round_}\n"), result.stderr
