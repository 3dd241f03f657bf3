"""``forkd shell TAG``: an interactive shell in a child of a stored snapshot.

Made for looking inside a kept failed test's VM (``--forkd-keep-failed``):
each line read from stdin runs under ``/bin/sh`` in the child, its output is
copied to ours and a non-zero exit status is shown. ``cd`` carries over to the
next line, as in a shell. ``exit`` or end of input ends the session and kills
the child; the snapshot itself is never changed. Reading lines from a pipe
works too: ``printf 'ls /srv\\n' | forkd shell failed-test_x``.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from ..engine.accel import ACCELS
from ..factory import VMFactory
from ..store import SnapshotStore
from ..vm import VM
from .exec_cmd import exit_status

#: Printed by the wrapped command after the user's: the shell's working directory when the line ended.
_CWD_MARKER = "__forkd_shell_cwd__="


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "shell", help="interactive shell in a child of a stored snapshot",
        description="Start a copy-on-write child of snapshot TAG and run the lines you type in it under /bin/sh "
                    "(cd carries over). `exit` or end of input kills the child; the snapshot is not changed. "
                    "Example: forkd shell failed-test_upload",
    )
    p.add_argument("tag", metavar="TAG", help="snapshot to start from (see `forkd snapshots ls`)")
    p.add_argument("--store", metavar="DIR", help="snapshot store (default: $FORKD_STORE or the user cache)")
    p.add_argument("--accel", choices=ACCELS, default="auto", help="accelerator (default: %(default)s)")
    p.add_argument("--cwd", default="/root", help="starting directory in the guest (default: %(default)s)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    store = SnapshotStore(args.store) if args.store else SnapshotStore.persistent()
    snapshot = store.get(args.tag)
    factory = VMFactory(accel=args.accel, progress=lambda line: print(line, file=sys.stderr))
    try:
        vm = factory.fork_snapshot(snapshot, 1)[0]
        interactive = sys.stdin.isatty()
        if interactive:
            print(f"forkd: shell in a child of snapshot {args.tag!r} ({vm.name}); `exit` or Ctrl-D ends it",
                  file=sys.stderr)
        return exit_status(ShellSession(vm, cwd=args.cwd).loop(sys.stdin, prompt=interactive))
    finally:
        factory.close()


class ShellSession:
    """Runs lines in ``vm`` one by one, keeping the working directory between them."""

    def __init__(self, vm: VM, *, cwd: str = "/root") -> None:
        self.vm = vm
        self.cwd = cwd
        self.last_status = 0

    def loop(self, lines: TextIO, *, prompt: bool) -> int:
        """Run lines until ``exit`` or end of input; returns the last command's exit status."""
        while True:
            if prompt:
                sys.stderr.write(f"forkd:{self.cwd}# ")
                sys.stderr.flush()
            line = lines.readline()
            if not line:
                return self.last_status
            words = line.split()
            if words[:1] == ["exit"]:
                return int(words[1]) if len(words) > 1 and words[1].isdigit() else self.last_status
            if words:
                self.last_status = self.run_line(line.rstrip("\n"))

    def run_line(self, line: str) -> int:
        """Run one line in the guest, copy its output to ours and return its exit status."""
        wrapped = f'{line}\n__forkd_status=$?\nprintf "\\n{_CWD_MARKER}%s\\n" "$PWD"\nexit $__forkd_status'
        result = self.vm.exec(["/bin/sh", "-c", wrapped], cwd=self.cwd)
        stdout = result.stdout_bytes
        marker = stdout.rfind(f"\n{_CWD_MARKER}".encode())
        if marker >= 0:
            self.cwd = stdout[marker + len(_CWD_MARKER) + 1:].decode(errors="replace").strip() or self.cwd
            stdout = stdout[:marker]
        sys.stdout.buffer.write(stdout)
        sys.stdout.flush()
        sys.stderr.buffer.write(result.stderr_bytes)
        if result.exit_code != 0:
            sys.stderr.write(f"[exit {result.exit_code}]\n")
        sys.stderr.flush()
        return result.exit_code

