"""A consumer program run against a forkd E2B server as its users run it, and a server of a test file's own.

The server is the ``forkd_e2b`` fixture's, or one a test file starts with
templates of its own (``e2b_server``); the consumer is a separate program
(node, or the python of the consumer's own virtualenv) that sees nothing of
forkd but the environment the server prints: ``E2B_API_URL``,
``E2B_SANDBOX_URL``, ``E2B_API_KEY``.

A consumer program that takes a pause prints ``RESULT {json}`` once its work
is done and waits for a line on stdin before it cleans up; meanwhile the test
looks into the sandbox's VM through the server. Then it prints ``CLEANED``.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pytest_forkd.e2b.server import E2BServer

CONSUMER_TIMEOUT_S = 900


@contextmanager
def e2b_server(templates: Mapping[str, str] | None = None) -> Iterator[E2BServer]:
    """A started server over a session of its own; every sandbox and VM of it ends on exit."""
    from pytest_forkd.e2b.config import ServerConfig
    from pytest_forkd.e2b.server import E2BServer
    from pytest_forkd.project.session import ForkdSession

    session = ForkdSession.open()
    try:
        with E2BServer(session, ServerConfig(templates=dict(templates or {}))) as server:
            yield server
    finally:
        session.close()


def consumer_environment(server_environment: Mapping[str, str], **extra: str) -> dict[str, str]:
    """This process's environment without any E2B or OpenAI setting, plus what the server printed."""
    kept = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("E2B_") and name not in ("OPENAI_API_KEY", "PYTHONPATH")
    }
    return {**kept, **server_environment, **extra}


def run_consumer(
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: Path,
    *,
    inspect: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run a consumer program to its end; returns its RESULT. ``inspect`` runs while it waits (if it does)."""
    with tempfile.TemporaryFile(mode="w+") as errors:
        process = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            env=dict(env),
            cwd=cwd,
        )
        watchdog = threading.Timer(CONSUMER_TIMEOUT_S, process.kill)
        watchdog.start()
        try:
            assert process.stdout is not None and process.stdin is not None
            result: dict[str, Any] | None = None
            lines: list[str] = []
            for line in process.stdout:
                lines.append(line)
                if line.startswith("RESULT "):
                    result = json.loads(line.removeprefix("RESULT "))
                    break
            if result is not None and inspect is not None:
                inspect(result)
            try:
                process.stdin.write("\n")
                process.stdin.close()
            except BrokenPipeError:  # a consumer that does not wait has ended already
                pass
            lines += process.stdout.readlines()
            status = process.wait()
        finally:
            watchdog.cancel()
            if process.poll() is None:
                process.kill()
                process.wait()
        errors.seek(0)
        report = "".join(lines)[-3000:] + "\n--- stderr ---\n" + errors.read()[-6000:]
    assert status == 0, f"{argv[0]} exited with {status}:\n{report}"
    assert result is not None, f"no RESULT line:\n{report}"
    if inspect is not None:
        assert lines[-1].strip() == "CLEANED", f"the consumer did not clean up:\n{report}"
    return result
