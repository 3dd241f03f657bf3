"""One QEMU ``microvm`` process: command line, lifecycle and the VMM-side operations.

This is the only module that knows QEMU's command line. Everything above it
(VM handle, storage backends) speaks in terms of :class:`MachineSpec` and the
operations of :class:`Machine`: stop, resume, save/load device state and the
location of guest RAM inside the VMM process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
import re
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pytest_forkd import private
from pytest_forkd.engine.base import MemoryLayout
from pytest_forkd.engine.memory import filesystem_type
from pytest_forkd.engine.qemu import network as net
from pytest_forkd.engine.qemu.host import Qemu, tsc_khz, version_tuple
from pytest_forkd.engine.qemu.qmp import QMPClient, QMPConnectionError, QMPError
from pytest_forkd.engine.rundir import PRIVATE_UMASK, private_listener, private_open
from pytest_forkd.engine.space import exit_text
from pytest_forkd.engine.spawner import spawn
from pytest_forkd.errors import BackendError, GuestCrashed, SnapshotError, VMStartError, WaitTimeout
from pytest_forkd.waiting import poll_until

CONSOLE_TAIL_LINES = 40
#: ``info jit`` lines read by :meth:`Machine.translation_stats`, and the key each becomes.
_JIT_FIGURES = {
    "gen code size": "gen_code_bytes",
    "TB count": "tb_count",
    "TB flush count": "tb_flushes",
    "TB invalidate count": "tb_invalidations",
}
_FIRST_NUMBER = re.compile(r"\s+(\d+)")
_loader_counter = itertools.count(1)
# The CPU model under TCG: a fixed one, so parents and children (and snapshots
# taken on another QEMU) agree, and one that boots on QEMU 7.2 through 10.x.
# `-cpu max` changes with each QEMU release; on QEMU 10 it hangs the Debian 12
# kernel at "LSM: Security Framework initializing". qemu64 plus the SSE4.2 and
# POPCNT extensions that distributions' userlands may assume boots Debian 12
# and 13 guests on both. RDRAND seeds the guest kernel's random pool at once:
# without it Debian 13's kernel takes ~2 s of emulated jitter to get there,
# and Python blocks in getrandom() until it has. Under KVM the host's own CPU
# is passed through.
TCG_CPU = "qemu64,+ssse3,+sse4.1,+sse4.2,+popcnt,+rdrand"
KVM_CPU = "host"
# QEMU's PVH entry boots the uncompressed kernel without the kernel's own
# decompression (seconds under TCG). On QEMU 10 microvm the Debian 12 kernel
# booted that way hangs at "ACPI: Core revision" or resets before its first
# line in nearly every TCG boot (0/10 measured, 6.1.0-50 and -57 alike), while
# its bzImage boots; QEMU 7.2 boots both. So PVH only up to this release.
PVH_LAST_MAJOR = 7


def boot_kernel(qemu: Qemu, kernel: Path, bzimage: Path | None) -> Path:
    """The kernel file a root VM boots on ``qemu``: the image's PVH kernel where that boots, else its bzImage."""
    if bzimage is None:
        return kernel
    major = version_tuple(qemu.version)[:1]
    return kernel if major and major[0] <= PVH_LAST_MAJOR else bzimage


def cpu_model(accel: str) -> str:
    """The ``-cpu`` argument for an accelerator ("kvm" or "tcg")."""
    return KVM_CPU if accel == "kvm" else TCG_CPU


@dataclass(frozen=True)
class MachineSpec:
    """Everything that must be identical between a parent and its children."""

    qemu: Qemu
    accel: str  # resolved: "kvm" or "tcg"
    memory_mib: int = 256
    vcpus: int = 1
    kernel_args: tuple[str, ...] = ()
    network_card: bool = False
    """A virtio-net card (see :mod:`.network`): a device, so a child must have it iff its parent had."""
    disk: Path | None = None
    """A read-only disk (a container image's root) on virtio-blk; a device, so children attach it too.

    Left out of the fingerprint: its path differs between hosts, and the
    image key (part of every snapshot's fingerprint) already names its content.
    """

    def with_memory(self, memory_mib: int) -> MachineSpec:
        return dataclasses.replace(self, memory_mib=memory_mib)

    def machine_args(self) -> list[str]:
        cpu = cpu_model(self.accel)
        return [
            "-M",
            "microvm,suppress-vmdesc=on",
            "-accel",
            self.accel,
            "-cpu",
            cpu,
            "-smp",
            str(self.vcpus),
            "-m",
            f"{self.memory_mib}M",
            "-display",
            "none",
            "-no-reboot",
            "-nodefaults",
            "-no-user-config",
            "-global",
            "migration.send-configuration=off",
        ] + self.card_args()

    def card_args(self) -> list[str]:
        """The network card, when the machine has one (its backend comes from :class:`~.network.NetworkSpec`)."""
        return net.device_args(net.NetworkSpec("outbound")) if self.network_card else []

    def disk_args(self) -> list[str]:
        """The image disk, read-only and shared by every VM of the image (QEMU takes a shared lock)."""
        if self.disk is None:
            return []
        path = str(self.disk).replace(",", ",,")  # QEMU's option syntax doubles a comma in a value
        return [
            "-drive",
            f"file={path},if=none,id=image,format=raw,readonly=on",
            "-device",
            "virtio-blk-device,drive=image",
        ]

    def append_line(self) -> str:
        # reboot=t: on microvm the kernel's ACPI and keyboard-controller resets never reach QEMU, so a
        # panic (panic=-1 restarts at once) spun forever; a triple fault makes QEMU (-no-reboot) exit.
        base = ["console=ttyS0", "quiet", "panic=-1", "reboot=t", f"tsc_early_khz={tsc_khz()}", "tsc=reliable"]
        return " ".join(base + list(self.kernel_args))

    def record(self) -> dict[str, Any]:
        """What a snapshot (and an archive made of it) records about this machine, as JSON."""
        args = self.machine_args()
        return {
            "qemu_version": self.qemu.version,
            "machine": args[args.index("-M") + 1].split(",")[0],
            "cpu_model": args[args.index("-cpu") + 1],
            "accel": self.accel,
            "machine_args": args,
            "machine_fingerprint": self.fingerprint(),
        }

    def fingerprint(self) -> str:
        """Hash of what a snapshot depends on: QEMU version and machine arguments.

        The host's TSC frequency is left out: children never boot, so it never
        reaches them, and it differs slightly between otherwise identical hosts
        (it is measured at boot), which would keep a snapshot from moving to
        another runner of the same kind.
        """
        portable_append = [word for word in self.append_line().split() if not word.startswith("tsc_early_khz=")]
        text = "\0".join([self.qemu.version, *self.machine_args(), " ".join(portable_append)])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def machine_record(
    qemu: Qemu, *, accel: str, memory_mib: int, vcpus: int, kernel_args: tuple[str, ...], network_card: bool
) -> dict[str, Any]:
    """The record (:meth:`MachineSpec.record`) of the machine these arguments make with ``qemu``."""
    return MachineSpec(
        qemu=qemu,
        accel=accel,
        memory_mib=memory_mib,
        vcpus=vcpus,
        kernel_args=kernel_args,
        network_card=network_card,
    ).record()


def machine_record_of_hash(
    machine_hash: str | None,
    versions: list[str],
    *,
    memory_mib: int,
    vcpus: int,
    kernel_args: tuple[str, ...],
    network_card: bool,
) -> dict[str, Any] | None:
    """The record of the machine whose :meth:`MachineSpec.fingerprint` is ``machine_hash``, or None.

    For snapshots written before records kept their machine: the candidates
    (each QEMU version of ``versions``, both accelerators) are hashed until one matches.
    """
    for version in filter(None, versions):
        for accel in ("tcg", "kvm"):
            record = machine_record(
                Qemu("qemu-system-x86_64", version),
                accel=accel,
                memory_mib=memory_mib,
                vcpus=vcpus,
                kernel_args=kernel_args,
                network_card=network_card,
            )
            if record["machine_fingerprint"] == machine_hash:
                return record
    return None


def has_network_card(machine_args: list[str]) -> bool:
    """Whether machine arguments (a record's ``machine_args``) give the machine a network card."""
    return net.device_args(net.NetworkSpec("outbound"))[-1] in machine_args


@dataclass
class Machine:
    """A running QEMU process with its QMP session and its agent connection."""

    name: str
    spec: MachineSpec
    directory: Path
    ram_path: Path
    owns_ram: bool
    process: subprocess.Popen[bytes]
    qmp: QMPClient
    agent_sock: socket.socket
    console_path: Path
    stderr_path: Path
    network: net.NetworkSpec = field(default_factory=net.NetworkSpec)
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
        network: net.NetworkSpec | None = None,
    ) -> "Machine":
        """Start QEMU; return once QMP is up and QEMU has connected the agent channel.

        ``share=True`` maps ``ram_path`` shared (a root VM whose RAM file may
        become a snapshot); ``share=False`` maps it copy-on-write (a child of a
        snapshot). ``incoming=True`` waits for a device-state stream.
        ``network`` is the user-mode network behind the spec's network card
        (default: none without a card, an isolated one with a card).
        """
        if network is None:
            network = net.NetworkSpec("host") if spec.network_card else net.NetworkSpec()
        if network.has_card != spec.network_card:
            raise net.NetworkError(
                f"network mode {network.mode!r} needs a machine {'with' if network.has_card else 'without'} "
                "a network card; the machine spec and the network must agree"
            )
        agent_path = directory / f"{name}.agent"
        qmp_path = directory / f"{name}.qmp"
        console_path = directory / f"{name}.console"
        stderr_path = directory / f"{name}.stderr"
        listener = private_listener(agent_path)
        argv = [
            spec.qemu.binary,
            *spec.machine_args(),
            "-kernel",
            str(kernel),
            "-initrd",
            str(initrd),
            "-append",
            spec.append_line(),
            "-object",
            f"memory-backend-file,id=mem,size={spec.memory_mib}M,mem-path={ram_path},share={'on' if share else 'off'}",
            "-machine",
            "memory-backend=mem",
            "-chardev",
            f"file,id=console,path={console_path}",
            "-serial",
            "chardev:console",
            "-device",
            "virtio-serial-device",
            "-chardev",
            f"socket,id=agent,path={agent_path},server=off",
            "-device",
            "virtserialport,chardev=agent,name=agent",
            "-qmp",
            f"unix:{qmp_path},server=on,wait=off",
            *spec.disk_args(),
        ]
        argv += net.netdev_args(network)
        if incoming:
            argv += ["-incoming", "defer"]
        if paused:
            argv.append("-S")
        # QEMU creates the RAM file, the console log and the QMP socket: a 177 umask makes each 0600.
        stderr = private_open(stderr_path)
        try:
            process = spawn(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,
                umask=PRIVATE_UMASK,
            )
        except BaseException as exc:
            listener.close()
            agent_path.unlink(missing_ok=True)
            stderr_path.unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise VMStartError(
                    f"cannot start {spec.qemu.binary}: {exc.strerror or exc}; "
                    "check the QEMU installation (forkd doctor)"
                ) from exc
            raise
        finally:
            os.close(stderr)
        qmp = None
        try:
            qmp = _connect_qmp(process, qmp_path, stderr_path, start_timeout, ram_path)
            agent_sock = _accept_agent(process, listener, stderr_path, max(1.0, start_timeout), ram_path)
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
        return cls(
            name=name,
            spec=spec,
            directory=directory,
            ram_path=ram_path,
            owns_ram=owns_ram,
            process=process,
            qmp=qmp,
            agent_sock=agent_sock,
            console_path=console_path,
            stderr_path=stderr_path,
            network=network,
        )

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
        return str(self.qmp.execute("query-status")["status"])

    def save_device_state(self, path: Path) -> None:
        """Write the device state (no RAM) of a stopped VM to ``path`` (~10-60 KB).

        The file is created 0600 first: QEMU would create it 0660 minus the
        umask, and it keeps the mode of a file that exists.
        """
        if not path.exists():
            private.touch(path)
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

    def forward_port(self, guest_port: int, attempts: int = 5) -> int:
        """Forward a free port on the host's loopback to ``guest_port`` in the guest; return the host port.

        The port is picked free, then bound by QEMU: another process may take it
        in between, so a refused bind is retried on another port.
        """
        if not self.network.has_card:
            raise net.NetworkError(
                f"VM {self.name} has no network (mode 'none'), so guest port {guest_port} "
                "cannot be forwarded; start it with network='host' or 'outbound'"
            )
        said = ""
        for _ in range(attempts):
            host_port = net.free_host_port()
            said = self._hmp(net.hostfwd_command(host_port, guest_port))
            if not said.strip():
                return host_port
        raise net.NetworkError(
            f"cannot forward guest port {guest_port} of VM {self.name} to a host port: QEMU said {said.strip()!r}"
        )

    def move_forward(self, from_port: int, to_port: int, guest_port: int) -> bool:
        """Move the forward of ``guest_port`` from host port ``from_port`` to ``to_port``; False if taken."""
        said = self._hmp(net.hostfwd_command(to_port, guest_port))
        if said.strip():
            return False
        self._hmp(net.hostfwd_remove_command(from_port))
        return True

    def _hmp(self, command: str) -> str:
        return self.qmp.execute("human-monitor-command", {"command-line": command}) or ""

    def ram_mapping(self) -> tuple[int, int]:
        """(start address, length) of guest RAM inside the QEMU process."""
        target = str(self.ram_path)
        try:
            maps = open(f"/proc/{self.pid}/maps")
        except OSError as exc:
            raise QMPError(
                f"cannot read the memory map of QEMU process {self.pid} ({exc.strerror}): "
                "the VM died; see its console log"
            ) from None
        with maps:
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

    def memory_layout(self) -> MemoryLayout:
        """Where guest RAM is: the RAM file, and its mapping inside this QEMU process."""
        start, length = self.ram_mapping()
        return MemoryLayout(path=self.ram_path, pid=self.pid, start=start, length=length, shared=self.owns_ram)

    # -- live snapshots (background-snapshot migration) ----------------------------
    def start_live_snapshot(self, stream: Path, armed: Callable[[], bool]) -> None:
        """Start QEMU's background snapshot into ``stream``; return once write protection is armed.

        userfaultfd write-protection inside QEMU copies a page out before the
        guest's first write to it, so the stream holds memory as it was when
        the snapshot started while the guest runs on. It covers anonymous and
        tmpfs memory only. ``armed()`` is asked too (the caller checks that the
        guest answers again).
        """
        filesystem = filesystem_type(self.ram_path)
        if filesystem != "tmpfs":
            raise BackendError(
                f"the uffd backend cannot branch VM {self.name}: its memory is a private mapping of "
                f"{self.ram_path} on {filesystem}, and userfaultfd write-protection covers only anonymous "
                "and tmpfs memory. Fork it from a snapshot on /dev/shm (pytest sessions do this for you; "
                "or use --forkd-store under /dev/shm), or use the diff backend"
            )
        qmp = self.qmp
        qmp.execute(
            "migrate-set-capabilities", {"capabilities": [{"capability": "background-snapshot", "state": True}]}
        )
        qmp.execute("migrate-set-parameters", {"max-bandwidth": 1 << 40})
        fd = os.open(stream, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            qmp.execute("getfd", {"fdname": "forkd-bgsnap"}, fds=[fd])
            qmp.execute("migrate", {"uri": "fd:forkd-bgsnap"})

            def write_protection_armed() -> bool:
                status = qmp.execute("query-migrate").get("status")
                if status in ("failed", "cancelled"):
                    raise SnapshotError(f"background snapshot of VM {self.name} {status}")
                return status != "setup" and self.status() == "running" and armed()

            qmp.wait_until(write_protection_armed, timeout=120, what="the live branch to start", interval=0.001)
        finally:
            os.close(fd)

    def finish_live_snapshot(self, timeout: float) -> None:
        """Wait for the background snapshot started by :meth:`start_live_snapshot` to complete."""

        def completed() -> bool:
            info = self.qmp.execute("query-migrate")
            status = info.get("status")
            if status in ("failed", "cancelled"):
                raise SnapshotError(
                    f"background snapshot of VM {self.name} {status}: {info.get('error-desc', 'no reason given')}"
                )
            return bool(status == "completed")

        poll_until(
            completed,
            timeout=timeout,
            interval=0.01,
            what=f"the background snapshot of VM {self.name}",
            error=lambda message: SnapshotError(f"background snapshot of VM {self.name} did not finish in {timeout} s"),
        )

    def materialise(
        self, stream: Path, image: Any, memory_file: Path, state_file: Path, *, timeout: float = 600.0
    ) -> None:
        """Load a live-snapshot stream into a fresh flat RAM file with a loader QEMU; save its devices.

        The loader has this machine's arguments and ``-incoming``; the device
        state saved from it describes the same instant as the memory.
        """
        private.touch(memory_file)  # QEMU would create it 0644; it keeps the mode of an existing (empty) file
        loader = Machine.launch(
            self.spec,
            self.directory,
            f"{self.name}-loader{next(_loader_counter)}",
            kernel=image.stub_kernel,
            initrd=image.stub_initrd,
            ram_path=memory_file,
            share=True,
            owns_ram=False,
            incoming=True,
            paused=True,
        )
        try:
            loader.load_device_state(stream, timeout=timeout)
            loader.save_device_state(state_file)
        finally:
            loader.kill()

    def console_tail(self, lines: int = CONSOLE_TAIL_LINES) -> str:
        return tail_of(self.console_path, lines) or tail_of(self.stderr_path, lines)

    def stderr_tail(self, lines: int = 10) -> str:
        """What QEMU itself printed (errors about its arguments, migration streams...)."""
        return tail_of(self.stderr_path, lines)

    def translation_stats(self) -> dict[str, int]:
        """TCG's translation state from HMP ``info jit``; empty under KVM or when QEMU cannot say."""
        try:
            text = str(self.qmp.execute("human-monitor-command", {"command-line": "info jit"}) or "")
        except (QMPError, QMPConnectionError, OSError):
            return {}
        stats: dict[str, int] = {}
        for line in text.splitlines():
            for label, key in _JIT_FIGURES.items():
                if line.startswith(label):
                    number = _FIRST_NUMBER.match(line[len(label) :])
                    if number is not None:
                        stats[key] = int(number.group(1))
        return stats

    def crash_error(self, what: str) -> GuestCrashed:
        """A GuestCrashed describing how this machine ended, with the console tail."""
        try:
            code = self.process.wait(timeout=2)
            how = f"QEMU exited with {exit_text(code, self.ram_path)}"
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


def _kill(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        try:
            process.kill()
        except OSError:
            pass
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _accept_agent(
    process: subprocess.Popen[bytes],
    listener: socket.socket,
    stderr_path: Path,
    timeout: float,
    ram_path: Path | None = None,
) -> socket.socket:
    """Accept QEMU's agent-channel connection, noticing at once when QEMU exits instead."""

    def attempt() -> socket.socket:
        if process.poll() is not None:
            raise VMStartError(
                f"QEMU exited with {exit_text(process.returncode, ram_path)} before connecting the agent channel: "
                f"{tail_of(stderr_path, 10) or 'no output'}"
            )
        connection, _ = listener.accept()
        return connection

    listener.settimeout(0.1)  # each attempt blocks this long in accept()
    return poll_until(
        attempt,
        timeout=timeout,
        interval=0.001,
        retry_on=(socket.timeout,),
        what="QEMU to connect the agent channel",
        error=lambda message: VMStartError(f"QEMU did not connect the agent channel within {timeout:.0f} s"),
    )


#: What a starting QEMU's monitor may throw at a client: our wrapper, and raw socket or JSON
#: errors (ConnectionResetError, EOF, JSONDecodeError) should any reach this far.
_STARTUP_TRANSPORT_ERRORS = (QMPConnectionError, OSError, ValueError)


def _connect_qmp(
    process: subprocess.Popen[bytes], path: Path, stderr_path: Path, timeout: float, ram_path: Path | None = None
) -> QMPClient:
    """Wait (bounded, poll_until) for QEMU's QMP socket and connect to it.

    Any transport failure while QEMU starts is retried: a socket that is not
    there yet or refuses, but also a connection QEMU accepted and then dropped
    (reset, EOF, garbled greeting). If QEMU has exited meanwhile, the next
    attempt reports its exit status and stderr; a QEMU that keeps running but
    never completes the handshake fails when ``timeout`` runs out.
    """

    def exited() -> VMStartError:
        return VMStartError(
            f"QEMU exited with {exit_text(process.returncode, ram_path)} while starting: "
            f"{tail_of(stderr_path, 10) or 'no output'}"
        )

    def attempt() -> QMPClient:
        if process.poll() is not None:
            raise exited()
        return QMPClient(str(path), greeting_timeout=max(0.5, min(10.0, timeout)))

    try:
        return poll_until(
            attempt,
            timeout=timeout,
            interval=0.001,
            backoff=0.05,
            retry_on=_STARTUP_TRANSPORT_ERRORS,
            what=f"QEMU's QMP socket {path}",
        )
    except WaitTimeout as exc:
        try:
            process.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
        if process.poll() is not None:
            raise exited() from exc
        last_error = exc.last_error
        if isinstance(last_error, QMPConnectionError):
            never_there = last_error.not_listening_yet
        else:
            never_there = isinstance(last_error, (FileNotFoundError, ConnectionRefusedError))
        what = "did not appear" if never_there else f"did not answer ({type(last_error).__name__}: {last_error})"
        raise VMStartError(
            f"QEMU's QMP socket {path} {what} within {timeout:.0f} s (QEMU still running); "
            f"stderr: {tail_of(stderr_path, 10) or 'empty'}"
        ) from exc
