"""Terminals against real QEMU: ``exec(pty=True)``, ``spawn(pty=...)`` and ``forkd shell`` on a host pseudo-terminal."""

from __future__ import annotations

import fcntl
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from pytest_forkd.core.factory import VMFactory
from pytest_forkd.core.process import GuestProcess
from pytest_forkd.core.vm import VM
from pytest_forkd.errors import InvalidArgument, ProcessTimeout
from pytest_forkd.storage.snapshot import Snapshot


def test_exec_with_pty_names_a_terminal(vm: VM) -> None:
    result = vm.exec("tty", pty=True)
    assert result.exit_code == 0
    assert re.fullmatch(r"/dev/pts/\d+", result.stdout.strip()), result.stdout
    assert result.stderr == ""
    plain = vm.exec("tty")
    assert plain.exit_code != 0 and "not a tty" in plain.stdout


def test_exec_with_pty_has_the_window_size_and_a_controlling_terminal(vm: VM) -> None:
    assert vm.exec("stty size", pty=(40, 132)).stdout.strip() == "40 132"
    assert vm.exec("stty size", pty=True).stdout.strip() == "24 80"
    # The terminal is the command's controlling terminal: /dev/tty opens.
    assert vm.exec("echo via-tty > /dev/tty", pty=True).stdout == "via-tty\r\n"
    typed = vm.exec('read line; echo "got $line"', pty=True, stdin="hello\n")
    assert "got hello" in typed.stdout
    with pytest.raises(InvalidArgument, match="pty must be True, False or"):
        vm.exec("true", pty=(0, 80))


def test_spawned_terminal_resizes_and_ctrl_c_interrupts_the_foreground_job(vm: VM) -> None:
    shell = vm.spawn("exec sh -i", pty=(30, 100))
    shell.write_stdin("stty size\n")
    assert _read_until(shell, b"30 100")
    shell.resize(50, 160)
    shell.write_stdin("stty size\n")
    assert _read_until(shell, b"50 160")
    shell.write_stdin("sleep 100\n")
    time.sleep(1)
    shell.write_stdin(b"\x03")  # Ctrl-C, typed: SIGINT for the foreground job, the shell goes on
    _read_until(shell, b"^C")
    shell.write_stdin("echo after-sleep $?\n")
    assert _read_until(shell, b"after-sleep 130")
    shell.write_stdin("exit 4\n")
    assert shell.wait(timeout=60) == 4


def _read_until(process: GuestProcess, marker: bytes, timeout: float = 60) -> bytes:
    seen = b""
    deadline = time.monotonic() + timeout
    while marker not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"no {marker!r} on the terminal; it shows {seen!r}"
        try:
            seen += process.stdout.read_chunk(timeout=left)
        except ProcessTimeout:
            continue
    return seen


# -- forkd shell, driven through a pseudo-terminal on the host -------------------------------------


class HostTerminal:
    """``forkd shell`` running on a host pseudo-terminal, as in a terminal emulator."""

    def __init__(self, args: list[str], cwd: Path, rows: int = 33, columns: int = 111) -> None:
        self.master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pytest_forkd.cli", "shell", *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
        )
        os.close(slave)
        self.seen = b""

    def type(self, data: bytes) -> None:
        os.write(self.master, data)

    def expect(self, pattern: bytes, timeout: float = 120) -> bytes:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.seen):
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} in the terminal; it shows:\n{self.seen.decode(errors='replace')}"
            ready, _, _ = select.select([self.master], [], [], left)
            if ready:
                try:
                    chunk = os.read(self.master, 65536)
                except OSError:
                    chunk = b""
                if not chunk:
                    assert re.search(pattern, self.seen), f"terminal closed; it shows:\n{self.seen.decode()}"
                self.seen += chunk
        return self.seen

    def resize(self, rows: int, columns: int) -> None:
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        os.killpg(self.process.pid, 28)  # SIGWINCH, as the terminal emulator's kernel would send

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
        os.close(self.master)


def test_forkd_shell_is_a_real_terminal(factory: VMFactory, base_snapshot: Snapshot, tmp_path: Path) -> None:
    terminal = HostTerminal([base_snapshot.tag, "--store", str(factory.session_store.root)], cwd=tmp_path)
    try:
        terminal.expect(rb"# ")  # the guest shell's prompt
        terminal.type(b"tty; stty size\n")
        terminal.expect(rb"/dev/pts/\d+\r\n33 111\r\n")
        terminal.resize(44, 122)
        # The resize travels to the guest's terminal; under emulation on a busy host that can take
        # more than a second, so ask again until it shows (a resize that never arrives still fails).
        deadline = time.monotonic() + 60
        while True:
            terminal.type(b"stty size\n")
            try:
                terminal.expect(rb"44 122\r\n", timeout=3)
                break
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
        terminal.type(b"sleep 100\n")
        time.sleep(2)
        terminal.type(b"\x03")  # Ctrl-C reaches the guest's foreground job, not forkd
        terminal.expect(rb"\^C")
        terminal.type(b"echo interrupted $?\n")
        terminal.expect(rb"interrupted 130")
        assert terminal.process.poll() is None
        terminal.type(b"cat /root/marker\n")
        terminal.expect(rb"from-base")
        terminal.type(b"exit 3\n")
        assert terminal.process.wait(timeout=120) == 3
    finally:
        terminal.close()
