"""A small deterministic coding agent, the kind of code pytest-forkd is for.

A real agent asks a language model which tool to call next; this one maps a
task sentence to tool calls with regular expressions, so its test suite is
reproducible. What matters is the shape: an agent holding a VM handle and
running tool calls in it, some of them destructive.

Tasks it understands::

    write file /srv/notes.txt with hello
    run python print(6 * 7)
    delete directory /srv/project
    install config web
    run ls -l /srv
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pytest_forkd.core.vm import VM
    from pytest_forkd.guest.exec_result import ExecResult

#: Configuration files the agent knows how to install (``install config NAME``).
CONFIG_TEMPLATES = {
    "web": "listen = 8080\nworkers = 2\n",
    "db": "path = /var/lib/agent/db.sqlite\njournal = wal\n",
}
CONFIG_DIR = "/etc/agent"


@dataclass(frozen=True)
class ToolCall:
    """One step of a plan: a tool name and its arguments."""

    tool: str
    args: dict[str, str] = field(default_factory=dict)


class UnknownTask(ValueError):
    """The agent has no plan for this task sentence."""


_TASKS = (
    (re.compile(r"^write file (?P<path>/\S+) with (?P<content>.*)$", re.S), "write_file"),
    (re.compile(r"^run python (?P<code>.+)$", re.S), "run_python"),
    (re.compile(r"^delete directory (?P<path>/\S+)$"), "delete_directory"),
    (re.compile(r"^install config (?P<name>[a-z]+)$"), "install_config"),
    (re.compile(r"^run (?P<command>.+)$", re.S), "shell"),
)


def plan(task: str) -> list[ToolCall]:
    """The tool calls that carry out ``task`` (the part a language model would do)."""
    for pattern, tool in _TASKS:
        match = pattern.match(task.strip())
        if match:
            if tool == "install_config" and match["name"] not in CONFIG_TEMPLATES:
                raise UnknownTask(f"no config template {match['name']!r}; known: {', '.join(CONFIG_TEMPLATES)}")
            return [ToolCall(tool, match.groupdict())]
    raise UnknownTask(f"no plan for task {task!r}")


class Agent:
    """Runs tasks as tool calls inside ``vm`` and keeps a transcript of what it did."""

    def __init__(self, vm: VM) -> None:
        self.vm = vm
        self.transcript: list[tuple[ToolCall, ExecResult]] = []

    def run(self, task: str) -> ExecResult:
        """Carry out ``task``; returns the result of its last tool call."""
        result = None
        for call in plan(task):
            result = getattr(self, f"_tool_{call.tool}")(**call.args)
            self.transcript.append((call, result))
        assert result is not None
        return result

    def _tool_write_file(self, path: str, content: str) -> ExecResult:
        self.vm.exec(["mkdir", "-p", path.rsplit("/", 1)[0] or "/"], check=True)
        self.vm.write_file(path, content + "\n")
        return self.vm.exec(["wc", "-c", path], check=True)

    def _tool_run_python(self, code: str) -> ExecResult:
        return self.vm.exec(["python3", "-c", code])

    def _tool_delete_directory(self, path: str) -> ExecResult:
        return self.vm.exec(f"rm -rf {shlex.quote(path)}")

    def _tool_install_config(self, name: str) -> ExecResult:
        self.vm.exec(["mkdir", "-p", CONFIG_DIR], check=True)
        self.vm.write_file(f"{CONFIG_DIR}/{name}.conf", CONFIG_TEMPLATES[name])
        return self.vm.exec(["cat", f"{CONFIG_DIR}/{name}.conf"], check=True)

    def _tool_shell(self, command: str) -> ExecResult:
        return self.vm.exec(command)
