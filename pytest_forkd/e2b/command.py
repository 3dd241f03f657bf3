"""What ``forkd e2b serve`` does: open a forkd session, serve, print the environment, stop on a signal.

The command line (:mod:`pytest_forkd.cli.e2b_cmd`) only parses. Here the
session is opened (forkd.yaml, the snapshot ``base`` stands for), the server
started, the default template and every ``--template`` mapping made ready
(pulled or built, and prepared, with progress on stderr; a mapping that
names nothing usable stops it there), and only then are the ``export`` lines
printed on stdout, so a script that waits for them can use the server at
once, without a first create outlasting the SDK's request timeout. SIGINT, SIGTERM and
SIGHUP stop it (the command line turns them into KeyboardInterrupt, with a
watchdog that kills every VM if stopping hangs); every sandbox and snapshot
of the server is gone when it returns.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from pytest_forkd.e2b.code_interpreter_template import DESCRIPTION as CODE_INTERPRETER_DESCRIPTION
from pytest_forkd.e2b.config import CODE_INTERPRETER_TEMPLATE, DEFAULT_TEMPLATE, ServerConfig, parse_template_options
from pytest_forkd.e2b.server import E2BServer
from pytest_forkd.paths import PROJECT_FILE


def _forkd_yaml(config: str | None) -> str | None:
    return config if config is not None else (PROJECT_FILE if Path(PROJECT_FILE).is_file() else None)


def list_templates(
    *,
    templates: Sequence[str] = (),
    config: str | None = None,
    snapshot: str | None = None,
    stdout: TextIO | None = None,
) -> int:
    """Print the template names a server started with these options serves, and what each stands for."""
    from pytest_forkd.project.session import ForkdSession
    from pytest_forkd.tables import render_table

    mapping = parse_template_options(templates)
    with ForkdSession.open(config=_forkd_yaml(config), snapshot=snapshot) as session:
        selected = session.settings.snapshot
        rows = [
            [DEFAULT_TEMPLATE, f"snapshot {selected}"],
            *([name, f"snapshot {name} ({session.project.origin})"] for name in session.project.snapshots),
        ]
        if CODE_INTERPRETER_TEMPLATE not in session.project.snapshots:
            rows.append([CODE_INTERPRETER_TEMPLATE, CODE_INTERPRETER_DESCRIPTION])
        rows = [row for row in rows if row[0] not in mapping] + [[name, ref] for name, ref in mapping.items()]
    out = stdout or sys.stdout
    print(render_table(sorted(rows), ["template", "is"]), file=out)
    print("other names: a snapshot kept in the store, or an image reference (docker://...)", file=out)
    return 0


def serve_until_stopped(
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    templates: Sequence[str] = (),
    debug_ports: bool = False,
    config: str | None = None,
    snapshot: str | None = None,
    default_timeout_s: int = 300,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Serve until interrupted (or until ``stop`` is set); 0 after a clean stop."""
    from pytest_forkd.project.session import ForkdSession

    out = stdout or sys.stdout
    err = stderr or sys.stderr

    def progress(line: str) -> None:
        print(line, file=err, flush=True)

    server_config = ServerConfig(
        host=host,
        port=port,
        templates=parse_template_options(templates),
        debug_ports=debug_ports,
        default_timeout_s=default_timeout_s,
    )
    if api_key is not None:
        server_config = dataclasses.replace(server_config, api_key=api_key)
    session = ForkdSession.open(config=_forkd_yaml(config), snapshot=snapshot, progress=progress)
    server = E2BServer(session, server_config, progress=progress)
    try:
        session.factory  # noqa: B018 - made here, in the main thread, where it takes over the stop signals
        server.start()
        server.warm_templates()  # the default template and every --template mapping, before clients come
        for line in server.exports():
            print(line, file=out)
        out.flush()
        progress(
            f"forkd e2b: serving on {server.url} (sandbox API and sandboxes; the API key is E2B_API_KEY above)"
            + (", and the E2B_DEBUG ports 3000, 49983 and 49999" if debug_ports else "")
            + "; Ctrl-C stops it and ends its sandboxes"
        )
        waiter = stop or threading.Event()
        while not waiter.wait(3600):
            pass
    except KeyboardInterrupt:
        progress("forkd e2b: stopping: ending the sandboxes")
    finally:
        server.stop()
        session.close()
    progress("forkd e2b: stopped")
    return 0
