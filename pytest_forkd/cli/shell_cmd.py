"""``forkd shell TAG``: an interactive shell in a child of a stored snapshot.

Made for looking inside a kept failed test's VM (``--forkd-keep-failed``).
On a terminal it is a real one (:class:`TerminalSession`): the guest's shell
runs on a pseudo-terminal of its own, our terminal is put in raw mode and
every key goes to it, so job control, editors, Ctrl-C (which interrupts the
guest's foreground command, not forkd) and Ctrl-Z work; the window size
follows ours (SIGWINCH); forkd exits with the shell's exit status.

Without a terminal (``printf 'ls /srv\\n' | forkd shell failed-test_x``),
or with ``--no-pty``, each line read from stdin runs under ``/bin/sh`` in
the child (:class:`ShellSession`), its output is copied to ours and a
non-zero exit status is shown; ``cd`` carries over to the next line.
Either way ``exit`` or end of input ends the session and kills the child;
the snapshot itself is never changed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import struct
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, TextIO

from pytest_forkd.cli.exec_cmd import exit_status
from pytest_forkd.core.factory import VMFactory
from pytest_forkd.core.vm import VM
from pytest_forkd.engine.host import ACCELS
from pytest_forkd.project.lifecycle import find_snapshot
from pytest_forkd.storage.store import SnapshotStore

if TYPE_CHECKING:
    from pytest_forkd.core.process import GuestProcess, ProcessOutput

#: Printed by the wrapped command after the user's: the shell's working directory when the line ended.
_CWD_MARKER = "__forkd_shell_cwd__="


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "shell",
        help="interactive shell in a child of a stored snapshot",
        description="Start a copy-on-write child of snapshot TAG and run the lines you type in it under /bin/sh "
        "(cd carries over). `exit` or end of input kills the child; the snapshot is not changed. "
        "Example: forkd shell failed-test_upload",
    )
    p.add_argument("tag", metavar="TAG", help="snapshot to start from (see `forkd snapshots ls`)")
    p.add_argument("--store", metavar="DIR", help="snapshot store (default: $FORKD_STORE or the user cache)")
    p.add_argument("--accel", choices=ACCELS, default="auto", help="accelerator (default: %(default)s)")
    p.add_argument(
        "--cwd", default=None, help="starting directory in the guest (default: the snapshot's workdir, else /root)"
    )
    p.add_argument(
        "--pty",
        dest="pty",
        action="store_true",
        default=None,
        help="run the shell on a terminal in the guest (the default when stdin is a terminal)",
    )
    p.add_argument(
        "--no-pty",
        dest="pty",
        action="store_false",
        help="run the lines read from stdin one by one, without a terminal",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    store = SnapshotStore(args.store) if args.store else SnapshotStore.persistent()
    snapshot = find_snapshot(store, args.tag)  # the current project's own first, then the shared one
    factory = VMFactory(accel=args.accel, progress=lambda line: print(line, file=sys.stderr))
    try:
        vm = factory.fork_snapshot(snapshot, 1)[0]
        interactive = sys.stdin.isatty()
        cwd = args.cwd or vm.cwd or "/root"
        if interactive:
            print(
                f"forkd: shell in a child of snapshot {args.tag!r} ({vm.name}); `exit` or Ctrl-D ends it",
                file=sys.stderr,
            )
        if args.pty if args.pty is not None else interactive:
            return exit_status(TerminalSession(vm, cwd=cwd).run(sys.stdin.fileno(), sys.stdout.fileno()))
        return exit_status(ShellSession(vm, cwd=cwd).loop(sys.stdin, prompt=interactive))
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
            self.cwd = stdout[marker + len(_CWD_MARKER) + 1 :].decode(errors="replace").strip() or self.cwd
            stdout = stdout[:marker]
        sys.stdout.buffer.write(stdout)
        sys.stdout.flush()
        sys.stderr.buffer.write(result.stderr_bytes)
        if result.exit_code != 0:
            sys.stderr.write(f"[exit {result.exit_code}]\n")
        sys.stderr.flush()
        return result.exit_code


#: The guest's interactive shell: bash where the image has it, else busybox's.
GUEST_SHELL = "if command -v bash >/dev/null 2>&1; then exec bash -i; fi; exec sh -i"


class TerminalSession:
    """A shell on a pseudo-terminal in ``vm``, wired to our terminal in raw mode.

    Keys travel as bytes (Ctrl-C is ``\\x03``, which the guest's terminal turns
    into SIGINT for its foreground job), output is copied as it comes, and a
    change of our window size (SIGWINCH) is passed on. Without a terminal on
    our side (tests, pipes) the same relay works, with a 24x80 window.
    """

    def __init__(self, vm: VM, *, cwd: str = "/root", command: str = GUEST_SHELL) -> None:
        self.vm = vm
        self.cwd = cwd
        self.command = command

    def run(self, in_fd: int, out_fd: int) -> int:
        """Relay until the guest's shell exits; return its exit code."""
        size = window_size(in_fd) or window_size(out_fd) or (24, 80)
        process = self.vm.spawn(self.command, pty=size, cwd=self.cwd, env={"TERM": os.environ.get("TERM") or "xterm"})
        copier = threading.Thread(
            target=_copy_output, args=(process.stdout, out_fd), name="forkd-shell-output", daemon=True
        )
        copier.start()
        wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        resized = threading.Event()

        def on_resize(signum: int, frame: object) -> None:
            resized.set()
            with contextlib.suppress(OSError):
                os.write(wake_write, b"r")

        previous = (
            signal.signal(signal.SIGWINCH, on_resize) if threading.current_thread() is threading.main_thread() else None
        )
        try:
            with raw_terminal(in_fd):
                self._relay_input(process, in_fd, wake_read, resized, out_fd)
        finally:
            if previous is not None:
                signal.signal(signal.SIGWINCH, previous)
            os.close(wake_read)
            os.close(wake_write)
        status = process.wait()
        copier.join(timeout=10)
        return status

    def _relay_input(
        self, process: GuestProcess, in_fd: int, wake_fd: int, resized: threading.Event, out_fd: int
    ) -> None:
        reading = True
        while process.returncode is None:
            ready, _, _ = select.select([in_fd, wake_fd] if reading else [wake_fd], [], [], 0.1)
            if resized.is_set():
                resized.clear()
                with contextlib.suppress(OSError):
                    os.read(wake_fd, 4096)
                size = window_size(in_fd) or window_size(out_fd)
                if size is not None:
                    process.resize(*size)
            if in_fd in ready:
                data = os.read(in_fd, 4096)
                if data:
                    process.write_stdin(data)
                else:  # our input ended: end the shell's, as Ctrl-D does
                    reading = False
                    process.close_stdin()


def _copy_output(stream: ProcessOutput, out_fd: int) -> None:
    from pytest_forkd.errors import ForkdError

    try:
        while True:
            chunk = stream.read_chunk()
            if not chunk:
                return
            view = memoryview(chunk)
            while view:
                view = view[os.write(out_fd, view) :]
    except (ForkdError, OSError):
        return


def window_size(fd: int) -> tuple[int, int] | None:
    """(rows, columns) of the terminal on ``fd``, or None if it is none."""
    import fcntl
    import termios

    try:
        rows, columns, _, _ = struct.unpack("HHHH", fcntl.ioctl(fd, termios.TIOCGWINSZ, b"\0" * 8))
    except OSError:
        return None
    return (rows, columns) if rows and columns else None


@contextlib.contextmanager
def raw_terminal(fd: int) -> Iterator[None]:
    """Our terminal in raw mode for the block (keys are bytes, no echo, no signals); nothing if not a terminal."""
    import termios
    import tty

    if not os.isatty(fd):
        yield
        return
    saved = termios.tcgetattr(fd)
    tty.setraw(fd, termios.TCSANOW)  # keeps what was typed ahead while the VM started
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
