"""The pytest process inside the guest that runs a suite's tests for ``pytest --forkd-isolate``.

The host copies this file and its three siblings (``isolate_plugin.py``,
the pytest plugin that serves the host's commands; ``isolate_pytest.py``,
the one door to pytest's private internals; ``isolate_imports.py``, the
project first in the imports) into the parent VM and starts it with the path
of a spec (JSON): the pytest arguments, the options to set by name, the
host's ``sys.path`` entries and editable installs that lie in the project,
and the project's top-level packages with where the host took them from.

Before pytest is imported, the project's entries go first on ``sys.path``
(pytest itself may then take a dependency from the project, as on the host:
pluggy's own suite tests the pluggy it brings). Then it checks that the
plugins the host names with ``-p`` are here, and runs ``pytest.main`` with
:class:`isolate_plugin.Runner` as a plugin that replaces pytest's test
loop and answers the host's commands, one JSON object per line, on the
process's original stdin and stdout; the tests' own output goes to stderr.
What stops the run before any test is an ``error`` message with a
``kind`` the host turns into one line: ``options`` (an option the guest's
plugins do not know), ``plugins`` (a ``-p`` plugin missing), ``imports``
and ``internals`` (see the plugin).

It imports nothing of pytest-forkd: it runs with the guest's Python and
the guest's pytest (Debian bookworm's 7.2 in the default image).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import traceback
from collections.abc import Sequence
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import isolate_imports
else:
    try:
        from . import isolate_imports
    except ImportError:  # in the guest: run as a script, the modules lie beside it
        import isolate_imports


class Channel:
    """The host's commands in and the replies out: JSON, one object per line, on private descriptors."""

    def __init__(self, commands: IO[bytes], replies: IO[bytes]) -> None:
        self._commands = commands
        self._replies = replies

    @classmethod
    def from_stdio(cls) -> Channel:
        """Take stdin and stdout for the protocol; the tests get /dev/null as stdin and stderr as stdout.

        The protocol's descriptors are duplicates that subprocesses do not
        inherit, so nothing a test runs can write into the channel.
        """
        commands = os.dup(0)
        replies = os.dup(1)
        os.dup2(2, 1)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for stream in (sys.stdout, sys.stderr):  # what a test prints uncaptured (-s) reaches the host as it goes
            reconfigure = getattr(stream, "reconfigure", None)
            if reconfigure is not None:
                reconfigure(line_buffering=True)
        return cls(os.fdopen(commands, "rb"), os.fdopen(replies, "wb"))

    def receive(self) -> dict[str, Any] | None:
        """The next command, or None when the host closed the channel."""
        line = self._commands.readline()
        if not line:
            return None
        command = json.loads(line)
        if not isinstance(command, dict):
            raise ValueError(f"a command must be a JSON object, got {line[:200]!r}")
        return command

    def send(self, message: dict[str, Any]) -> None:
        self._replies.write(json.dumps(message, default=str).encode() + b"\n")
        self._replies.flush()


def requested_plugins(args: Sequence[str]) -> list[str]:
    """The plugins ``-p NAME`` asks pytest to load (not the ``-p no:NAME`` that block one)."""
    names = []
    for index, arg in enumerate(args):
        if arg == "-p" and index + 1 < len(args):
            name = args[index + 1]
        elif arg.startswith("-p") and len(arg) > 2:
            name = arg[2:]
        else:
            continue
        if not name.startswith("no:"):
            names.append(name)
    return names


def missing_plugins(names: Sequence[str]) -> list[str]:
    """Those of ``names`` this Python cannot load: no module of the name, no pytest11 entry point, no builtin."""
    from importlib.metadata import entry_points

    entry_names = {entry.name for entry in entry_points(group="pytest11")}
    missing = []
    for name in names:
        if name in entry_names:
            continue
        try:
            found = importlib.util.find_spec(name) or importlib.util.find_spec(f"_pytest.{name}")
        except (ImportError, ValueError):
            found = None
        if found is None:
            missing.append(name)
    return missing


def main(argv: list[str] | None = None) -> int:
    """``python3 isolate_runner.py SPEC``: collect the suite, then serve the host's commands."""
    arguments = sys.argv[1:] if argv is None else argv
    if len(arguments) != 1:
        print("usage: python3 isolate_runner.py SPEC.json", file=sys.stderr)
        return 4
    channel = Channel.from_stdio()
    try:
        with open(arguments[0], encoding="utf-8") as spec_file:
            spec = json.load(spec_file)
        here = os.path.dirname(os.path.abspath(__file__))
        isolate_imports.put_first(spec.get("sys_path", []), spec.get("editable", {}), here)
        args = list(spec["args"])
        missing = missing_plugins(requested_plugins(args))
        if missing:
            channel.send(
                {
                    "op": "error",
                    "kind": "plugins",
                    "plugins": missing,
                    "message": f"the guest's Python has no plugin {', '.join(missing)} (-p on the host)",
                }
            )
            return 4
        import pytest

        if TYPE_CHECKING:
            from . import isolate_plugin
        else:
            try:
                from . import isolate_plugin
            except ImportError:
                import isolate_plugin
    except BaseException:
        channel.send({"op": "error", "message": traceback.format_exc()})
        return 3
    runner = isolate_plugin.Runner(channel, spec)
    try:
        status = int(pytest.main(args, plugins=[runner]))
    except BaseException:
        channel.send({"op": "error", "message": traceback.format_exc()})
        return 3
    if runner.refused_options:
        channel.send(
            {
                "op": "error",
                "kind": "options",
                "options": runner.refused_options,
                "message": f"the guest's pytest does not know the option(s) {', '.join(runner.refused_options)}",
            }
        )
    elif not runner.served:
        channel.send(
            {
                "op": "error",
                "message": f"the guest's pytest ended with status {status} before collecting the tests",
                "status": status,
            }
        )
    return status


if __name__ == "__main__":
    sys.exit(main())
