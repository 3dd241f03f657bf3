"""One QEMU ``microvm`` process: command line, lifecycle and the VMM-side operations.

This is the only module that knows QEMU's command line. Everything above it
(VM handle, storage backends) speaks in terms of :class:`MachineSpec` and the
operations of :class:`Machine`: stop, resume, save/load device state and the
location of guest RAM inside the VMM process.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tenacity import RetryError, Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from ..errors import GuestCrashed, VMStartError
from .host import Qemu, tsc_khz
from .qmp import QMPClient, QMPError
from .spawner import spawn

CONSOLE_TAIL_LINES = 40


@dataclass(frozen=True)
class MachineSpec:
    """Everything that must be identical between a parent and its children."""

    qemu: Qemu
    accel: str  # resolved: "kvm" or "tcg"
    memory_mib: int = 256
    vcpus: int = 1
    kernel_args: tuple[str, ...] = ()

    def machine_args(self) -> list[str]:
        cpu = "host" if self.accel == "kvm" else "max"
        return [
            "-M", "microvm,suppress-vmdesc=on",
            "-accel", self.accel,
            "-cpu", cpu,
            "-smp", str(self.vcpus),
            "-m", f"{self.memory_mib}M",
            "-display", "none", "-no-reboot", "-nodefaults", "-no-user-config",
            "-global", "migration.send-configuration=off",
        ]

    def append_line(self) -> str:
        # reboot=t: on microvm the kernel's ACPI and keyboard-controller resets never reach QEMU, so a
        # panic (panic=-1 restarts at once) spun forever; a triple fault makes QEMU (-no-reboot) exit.
        base = ["console=ttyS0", "quiet", "panic=-1", "reboot=t", f"tsc_early_khz={tsc_khz()}", "tsc=reliable"]
        return " ".join(base + list(self.kernel_args))

    def fingerprint(self) -> str:
        """Hash of what a snapshot depends on: QEMU version and machine arguments."""
        text = "\0".join([self.qemu.version, *self.machine_args(), self.append_line()])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class Machine:
    """A running QEMU process with its QMP session and its agent connection."""

    name: str
    spec: MachineSpec
    directory: Path
    ram_path: Path
    owns_ram: bool
    process: subprocess.Popen
    qmp: QMPClient
    agent_sock: socket.socket
    console_path: Path
    stderr_path: Path
    _closed: bool = field(default=False, repr=False)

    # -- launching ----------------------------------------------------------
    @classmethod
    def launch(
        cls,
        spec: MachineSpec,
        directory: Path,
        name: str,
        *,
        kernel: Path,
        initrd: Path,
        ram_path: Path,
        share: bool,
        owns_ram: bool,
        incoming: bool = False,
        paused: bool = False,
        start_timeout: float = 20.0,
    ) -> "Machine":
        """Start QEMU; return once QMP is up and QEMU has connected the agent channel.

        ``share=True`` maps ``ram_path`` shared (a root VM whose RAM file may
        become a snapshot); ``share=False`` maps it copy-on-write (a child of a
        snapshot). ``incoming=True`` waits for a device-state stream.
        """
        agent_path = directory / f"{name}.agent"
        qmp_path = directory / f"{name}.qmp"
        console_path = directory / f"{name}.console"
        stderr_path = directory / f"{name}.stderr"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(agent_path))
        listener.listen(1)
        argv = [
            spec.qemu.binary, *spec.machine_args(),
            "-kernel", str(kernel), "-initrd", str(initrd), "-append", spec.append_line(),
            "-object", f"memory-backend-file,id=mem,size={spec.memory_mib}M,mem-path={ram_path},"
                       f"share={'on' if share else 'off'}",
            "-machine", "memory-backend=mem",
            "-chardev", f"file,id=console,path={console_path}", "-serial", "chardev:console",
            "-device", "virtio-serial-device",
            "-chardev", f"socket,id=agent,path={agent_path},server=off",
            "-device", "virtserialport,chardev=agent,name=agent",
            "-qmp", f"unix:{qmp_path},server=on,wait=off",
        ]
        if incoming:
            argv += ["-incoming", "defer"]
        if paused:
            argv.append("-S")
        with open(stderr_path, "wb") as stderr:
            process = spawn(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
                            start_new_session=True)
        qmp = None
        try:
            qmp = _connect_qmp(process, qmp_path, stderr_path, start_timeout)
            listener.settimeout(max(1.0, start_timeout))
            try:
                agent_sock, _ = listener.accept()
            except socket.timeout as exc:
                raise VMStartError(f"QEMU did not connect the agent channel within {start_timeout:.0f} s") from exc
            agent_sock.settimeout(None)
        except BaseException:
            if qmp is not None:
                qmp.close()
            _kill(process)
            for path in (agent_path, qmp_path, console_path, stderr_path):
                path.unlink(missing_ok=True)
            if owns_ram:
                ram_path.unlink(missing_ok=True)
            raise
        finally:
            listener.close()
            agent_path.unlink(missing_ok=True)
        return cls(name=name, spec=spec, directory=directory, ram_path=ram_path, owns_ram=owns_ram,
                   process=process, qmp=qmp, agent_sock=agent_sock, console_path=console_path,
                   stderr_path=stderr_path)

    # -- VMM-side operations ---------------------------------------------
    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        self.qmp.execute("stop")

    def resume(self) -> None:
        self.qmp.execute("cont")

    def status(self) -> str:
        return self.qmp.execute("query-status")["status"]

    def save_device_state(self, path: Path) -> None:
        """Write the device state (no RAM) of a stopped VM to ``path`` (~10-60 KB)."""
        self.qmp.execute("xen-save-devices-state", {"filename": str(path), "live": False})

    def load_device_state(self, path: Path, *, timeout: float = 30.0) -> None:
        """Feed a device-state stream into a VM started with ``incoming=True``; it stays paused."""
        fd = os.open(path, os.O_RDONLY)
        try:
            self.qmp.execute("getfd", {"fdname": "forkd-state"}, fds=[fd])
        finally:
            os.close(fd)
        self.qmp.execute("migrate-incoming", {"uri": "fd:forkd-state"})

        def loaded() -> bool:
            state = self.status()
            if state == "inmigrate":
                return False
            if state not in ("paused", "running", "prelaunch", "postmigrate", "finish-migrate"):
                raise QMPError(f"device-state load left the VM in state {state!r}")
            return True

        self.qmp.wait_until(loaded, timeout=timeout, what="the device state to load")
        migrate = self.qmp.execute("query-migrate")
        if migrate.get("status") == "failed":
            raise QMPError(f"device-state load failed: {migrate.get('error-desc', 'unknown error')}")

    def ram_mapping(self) -> tuple[int, int]:
        """(start address, length) of guest RAM inside the QEMU process."""
        target = str(self.ram_path)
        with open(f"/proc/{self.pid}/maps") as maps:
            best: tuple[int, int] | None = None
            for line in maps:
                if line.rstrip("\n").endswith(target) or line.rstrip("\n").endswith(target + " (deleted)"):
                    start_s, end_s = line.split()[0].split("-")
                    start, end = int(start_s, 16), int(end_s, 16)
                    if best is None or end - start > best[1]:
                        best = (start, end - start)
        if best is None:
            raise QMPError(f"guest RAM mapping of {target} not found in QEMU process {self.pid}")
        return best

    def console_tail(self, lines: int = CONSOLE_TAIL_LINES) -> str:
        return tail_of(self.console_path, lines) or tail_of(self.stderr_path, lines)

    def stderr_tail(self, lines: int = 10) -> str:
        """What QEMU itself printed (errors about its arguments, migration streams...)."""
        return tail_of(self.stderr_path, lines)

    def crash_error(self, what: str) -> GuestCrashed:
        """A GuestCrashed describing how this machine ended, with the console tail."""
        try:
            code = self.process.wait(timeout=2)
            how = f"QEMU exited with status {code}"
        except subprocess.TimeoutExpired:
            how = "the guest stopped answering"
        stderr = tail_of(self.stderr_path, 5)
        detail = f"; QEMU said: {stderr}" if stderr else ""
        return GuestCrashed(f"VM {self.name}: {what}: {how}{detail}", crash_tail(self.console_path))

    def kill(self, *, remove_files: bool = True) -> None:
        """Kill QEMU and remove its sockets, logs and (when owned) its RAM file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.qmp.close()
        try:
            self.agent_sock.close()
        except OSError:
            pass
        _kill(self.process)
        if remove_files:
            for suffix in ("qmp", "agent", "console", "stderr"):
                (self.directory / f"{self.name}.{suffix}").unlink(missing_ok=True)
            if self.owns_ram:
                self.ram_path.unlink(missing_ok=True)


def tail_of(path: Path, lines: int) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 16384))
            data = handle.read()
    except OSError:
        return ""
    text = data.decode("utf-8", "replace").replace("\r", "")
    return "\n".join(text.splitlines()[-lines:])


CRASH_MARKERS = ("Kernel panic", "Oops:", "BUG:", "reboot: Power down", "reboot: Restarting")


def crash_tail(path: Path, lines: int = CONSOLE_TAIL_LINES, limit: int = 150) -> str:
    """The console's last ``lines``, extended back to the start of a panic or oops report.

    A kernel panic prints its reason first and a long register dump and call
    trace after it; a fixed tail would show the trace and cut the reason.
    """
    text = tail_of(path, limit)
    candidates = text.splitlines()
    for index, line in enumerate(candidates):
        if any(marker in line for marker in CRASH_MARKERS):
            return "\n".join(candidates[index:])
    return "\n".join(candidates[-lines:])


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        try:
            process.kill()
        except OSError:
            pass
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _connect_qmp(process: subprocess.Popen, path: Path, stderr_path: Path, timeout: float) -> QMPClient:
    """Wait (bounded, tenacity) for QEMU's QMP socket and connect to it."""

    class _NotYet(Exception):
        pass

    def attempt() -> QMPClient:
        if process.poll() is not None:
            raise VMStartError(
                f"QEMU exited with status {process.returncode} while starting: "
                f"{tail_of(stderr_path, 10) or 'no output'}"
            )
        try:
            return QMPClient(str(path))
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise _NotYet() from exc

    try:
        for attempt_ in Retrying(stop=stop_after_delay(timeout), wait=wait_exponential(multiplier=0.001, max=0.05),
                                 retry=retry_if_exception_type(_NotYet), reraise=False):
            with attempt_:
                return attempt()
    except RetryError as exc:
        raise VMStartError(
            f"QEMU's QMP socket {path} did not appear within {timeout:.0f} s "
            f"(QEMU {'still running' if process.poll() is None else 'exited'}); "
            f"stderr: {tail_of(stderr_path, 10) or 'empty'}"
        ) from exc
    raise AssertionError("unreachable")  # pragma: no cover
