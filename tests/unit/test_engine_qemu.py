"""The QEMU command line (MachineSpec, Machine.launch) and its clean-up when QEMU fails to start.

No VM is started: a fake QEMU records the arguments it was given and exits
with an error, which is also how a broken QEMU installation looks.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from pytest_forkd.engine.qemu.host import Qemu, tsc_khz
from pytest_forkd.engine.qemu.machine import Machine, MachineSpec, boot_kernel, tail_of
from pytest_forkd.errors import VMStartError

QEMU = Qemu(binary="/usr/bin/qemu-system-x86_64", version="7.2.22")


def option_values(argv: list[str], option: str) -> list[str]:
    """Every value that follows ``option`` in ``argv``."""
    return [argv[index + 1] for index, arg in enumerate(argv[:-1]) if arg == option]


def test_tcg_machine_arguments() -> None:
    args = MachineSpec(qemu=QEMU, accel="tcg", memory_mib=512, vcpus=2).machine_args()

    assert option_values(args, "-M") == ["microvm,suppress-vmdesc=on"]
    assert option_values(args, "-accel") == ["tcg"]
    # A fixed model that boots on QEMU 7.2 through 10 (`max` hangs Debian 12's kernel on QEMU 10).
    assert option_values(args, "-cpu") == ["qemu64,+ssse3,+sse4.1,+sse4.2,+popcnt,+rdrand"]
    assert option_values(args, "-smp") == ["2"]
    assert option_values(args, "-m") == ["512M"]
    assert {"-no-reboot", "-nodefaults", "-no-user-config"} <= set(args)
    # Children load a device-state-only stream: the parent must not send its configuration.
    assert option_values(args, "-global") == ["migration.send-configuration=off"]


def test_kvm_uses_the_host_cpu() -> None:
    args = MachineSpec(qemu=QEMU, accel="kvm").machine_args()

    assert option_values(args, "-accel") == ["kvm"]
    assert option_values(args, "-cpu") == ["host"]


def test_kernel_command_line_calibrates_the_tsc_and_exits_on_panic() -> None:
    line = MachineSpec(qemu=QEMU, accel="tcg", kernel_args=("loglevel=3", "forkd.x=1")).append_line().split()

    assert f"tsc_early_khz={tsc_khz()}" in line and "tsc=reliable" in line
    assert {"console=ttyS0", "panic=-1", "reboot=t"} <= set(line)
    assert line[-2:] == ["loglevel=3", "forkd.x=1"]  # the image's arguments come last, so they win


def test_fingerprint_tracks_what_children_must_share() -> None:
    spec = MachineSpec(qemu=QEMU, accel="tcg")

    assert spec.fingerprint() == MachineSpec(qemu=QEMU, accel="tcg").fingerprint()
    different = [
        MachineSpec(qemu=Qemu(QEMU.binary, "8.0.0"), accel="tcg"),
        MachineSpec(qemu=QEMU, accel="kvm"),
        MachineSpec(qemu=QEMU, accel="tcg", memory_mib=1024),
        MachineSpec(qemu=QEMU, accel="tcg", vcpus=2),
        MachineSpec(qemu=QEMU, accel="tcg", kernel_args=("quiet=0",)),
    ]
    fingerprints = {spec.fingerprint()} | {other.fingerprint() for other in different}
    assert len(fingerprints) == len(different) + 1


def test_fingerprint_ignores_the_host_tsc_so_snapshots_move_between_runners(monkeypatch: pytest.MonkeyPatch) -> None:
    import pytest_forkd.engine.qemu.machine as qemu_module

    spec = MachineSpec(qemu=QEMU, accel="tcg")
    here = spec.fingerprint()
    monkeypatch.setattr(qemu_module, "tsc_khz", lambda: 1_234_567)

    assert "tsc_early_khz=1234567" in spec.append_line()
    assert spec.fingerprint() == here


@pytest.fixture
def failing_qemu(tmp_path: Path) -> tuple[Qemu, Path]:
    """A QEMU stand-in that records its argv, complains on stderr and exits with status 1."""
    record = tmp_path / "argv.json"
    script = tmp_path / "fake-qemu"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        f"json.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n"
        "sys.stderr.write('qemu-system-x86_64: -object memory-backend-file: fake failure\\n')\n"
        "sys.exit(1)\n"
    )
    script.chmod(0o755)
    return Qemu(binary=str(script), version="7.2.22"), record


def launch(qemu: Qemu, directory: Path, **options: object) -> None:
    defaults: dict[str, object] = dict(
        kernel=Path("/images/vmlinuz"),
        initrd=Path("/images/initrd.cpio"),
        ram_path=directory / "vm1.ram",
        share=True,
        owns_ram=True,
    )
    Machine.launch(MachineSpec(qemu=qemu, accel="tcg"), directory, "vm1", **{**defaults, **options})


def test_root_vm_command_line(failing_qemu: tuple[Qemu, Path], tmp_path: Path) -> None:
    qemu, record = failing_qemu
    run_dir = tmp_path / "run"
    run_dir.mkdir()

    with pytest.raises(VMStartError):
        launch(qemu, run_dir)

    argv = json.loads(record.read_text())
    spec = MachineSpec(qemu=qemu, accel="tcg")
    assert argv[: len(spec.machine_args())] == spec.machine_args()
    assert option_values(argv, "-kernel") == ["/images/vmlinuz"]
    assert option_values(argv, "-initrd") == ["/images/initrd.cpio"]
    assert option_values(argv, "-append") == [spec.append_line()]
    assert option_values(argv, "-object") == [
        f"memory-backend-file,id=mem,size=256M,mem-path={run_dir / 'vm1.ram'},share=on"
    ]
    assert option_values(argv, "-machine") == ["memory-backend=mem"]
    assert f"socket,id=agent,path={run_dir / 'vm1.agent'},server=off" in option_values(argv, "-chardev")
    assert f"file,id=console,path={run_dir / 'vm1.console'}" in option_values(argv, "-chardev")
    assert option_values(argv, "-qmp") == [f"unix:{run_dir / 'vm1.qmp'},server=on,wait=off"]
    assert "-incoming" not in argv


def test_child_maps_its_snapshot_copy_on_write_and_waits_for_state(
    failing_qemu: tuple[Qemu, Path], tmp_path: Path
) -> None:
    qemu, record = failing_qemu
    snapshot_memory = tmp_path / "memory.ram"
    snapshot_memory.write_bytes(b"\0" * 4096)

    with pytest.raises(VMStartError):
        launch(qemu, tmp_path, ram_path=snapshot_memory, share=False, owns_ram=False, incoming=True)

    argv = json.loads(record.read_text())
    assert option_values(argv, "-object") == [
        f"memory-backend-file,id=mem,size=256M,mem-path={snapshot_memory},share=off"
    ]
    assert argv[-2:] == ["-incoming", "defer"]
    assert snapshot_memory.read_bytes() == b"\0" * 4096  # not the child's to remove


def test_qemu_exiting_at_start_is_reported_with_its_stderr_and_leaves_nothing(
    failing_qemu: tuple[Qemu, Path], tmp_path: Path
) -> None:
    qemu, _ = failing_qemu
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "vm1.ram").write_bytes(b"guest memory")

    with pytest.raises(VMStartError) as caught:
        launch(qemu, run_dir)

    message = str(caught.value)
    assert "QEMU exited with status 1 while starting" in message
    assert "memory-backend-file: fake failure" in message
    assert os.listdir(run_dir) == []  # sockets, logs and the owned RAM file are gone


def test_tail_of_keeps_the_last_lines(tmp_path: Path) -> None:
    log = tmp_path / "console"
    log.write_bytes(b"".join(b"line %d\r\n" % number for number in range(100)))

    assert tail_of(log, 3) == "line 97\nline 98\nline 99"
    assert tail_of(tmp_path / "missing", 3) == ""


def test_crash_tail_keeps_the_panic_reason_above_a_long_trace(tmp_path: Path) -> None:
    from pytest_forkd.engine.qemu.machine import crash_tail

    console = tmp_path / "vm.console"
    trace = [f"[    1.{i:06d}]  trace line {i}" for i in range(80)]
    console.write_text("\n".join(["boot noise"] * 30 + ["Kernel panic - not syncing: sysrq triggered crash"] + trace))
    tail = crash_tail(console)
    assert tail.splitlines()[0] == "Kernel panic - not syncing: sysrq triggered crash"
    assert tail.splitlines()[-1].endswith("trace line 79")

    console.write_text("\n".join(f"line {i}" for i in range(100)))
    assert crash_tail(console, lines=5).splitlines() == [f"line {i}" for i in range(95, 100)]


ABORTING_QEMU = """#!{python}
# Stands in for a QEMU whose KVM start aborts right after it opened its monitor ("failed to set MSR").
import json, socket, sys, time
argv = sys.argv[1:]
path = argv[argv.index("-qmp") + 1].split(":", 1)[1].split(",")[0]
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(path)
listener.listen(1)
connection, _ = listener.accept()
mode = {mode!r}
if mode == "reset":
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\\x01" + b"\\x00" * 7)
elif mode == "garbage":
    connection.sendall(b"\\x00{{not json\\n")
elif mode == "greet":
    connection.sendall(json.dumps({{"QMP": {{"version": {{"qemu": {{}}}}}}}}).encode() + b"\\n")
    request = json.loads(connection.makefile().readline())
    connection.sendall(json.dumps({{"return": {{}}, "id": request["id"]}}).encode() + b"\\n")
    time.sleep(0.3)
connection.close()
time.sleep({linger})
sys.stderr.write("qemu-system-x86_64: error: failed to set MSR 0x10a to 0x0\\n")
sys.exit(1)
"""


@pytest.mark.slow  # eight stand-in QEMU processes, each lingering
@pytest.mark.parametrize("mode", ["reset", "eof", "garbage", "greet"])
@pytest.mark.parametrize("linger", [0.0, 0.3])
def test_qemu_aborting_after_opening_its_monitor_is_a_start_error_with_its_stderr(
    tmp_path: Path, mode: str, linger: float
) -> None:
    script = tmp_path / "aborting-qemu"
    script.write_text(ABORTING_QEMU.format(python=sys.executable, mode=mode, linger=linger))
    script.chmod(0o755)
    run_dir = tmp_path / "run"
    run_dir.mkdir()

    with pytest.raises(VMStartError, match="QEMU exited with status 1 .*failed to set MSR 0x10a") as caught:
        launch(Qemu(binary=str(script), version="7.2.22"), run_dir, start_timeout=10.0)

    assert "\n" not in str(caught.value).strip()
    assert os.listdir(run_dir) == []


FLAKY_MONITOR_QEMU = """#!{python}
# Stands in for a QEMU whose monitor drops the first connection, then works: start-up must retry.
import json, socket, sys, time
argv = sys.argv[1:]
path = argv[argv.index("-qmp") + 1].split(":", 1)[1].split(",")[0]
agent = next(a for a in argv if a.startswith("socket,id=agent")).split("path=")[1].split(",")[0]
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(path)
listener.listen(1)
first, _ = listener.accept()
first.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\\x01" + b"\\x00" * 7)
first.close()
monitor, _ = listener.accept()
monitor.sendall(json.dumps({{"QMP": {{"version": {{"qemu": {{"major": 7}}}}}}}}).encode() + b"\\n")
request = json.loads(monitor.makefile().readline())
monitor.sendall(json.dumps({{"return": {{}}, "id": request["id"]}}).encode() + b"\\n")
channel = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
channel.connect(agent)
time.sleep(60)
"""


def test_a_monitor_connection_dropped_while_qemu_starts_is_retried(tmp_path: Path) -> None:
    script = tmp_path / "flaky-qemu"
    script.write_text(FLAKY_MONITOR_QEMU.format(python=sys.executable))
    script.chmod(0o755)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    machine = Machine.launch(
        MachineSpec(qemu=Qemu(str(script), "7.2.22"), accel="tcg"),
        run_dir,
        "vm1",
        kernel=Path("/k"),
        initrd=Path("/i"),
        ram_path=run_dir / "vm1.ram",
        share=True,
        owns_ram=True,
        start_timeout=10.0,
    )
    try:
        assert machine.alive() and machine.qmp.version == {"major": 7}
    finally:
        machine.kill()
    assert not machine.alive()
    assert os.listdir(run_dir) == []


@pytest.mark.parametrize(
    "error",
    [
        ConnectionResetError(104, "Connection reset by peer"),
        json.JSONDecodeError("Expecting value", "", 0),
        BrokenPipeError(32, "Broken pipe"),
        TimeoutError(),
    ],
)
def test_start_up_retries_raw_transport_errors_until_qemu_answers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, error: BaseException
) -> None:
    """Whatever a starting monitor throws, the next attempt decides: here the second one connects."""
    import subprocess

    from pytest_forkd.engine.qemu import machine as qemu_module

    attempts = []

    def flaky_client(path: str, **options: object) -> object:
        attempts.append(path)
        if len(attempts) == 1:
            raise error
        return "connected"

    monkeypatch.setattr(qemu_module, "QMPClient", flaky_client)
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert qemu_module._connect_qmp(process, tmp_path / "q.sock", tmp_path / "stderr", 5.0) == "connected"
        assert len(attempts) == 2
    finally:
        process.kill()
        process.wait()


@pytest.mark.parametrize(
    ("version", "expected"),
    [("7.2.22", "vmlinuz"), ("7.0.0", "vmlinuz"), ("8.2.2", "bzImage"), ("10.0.13", "bzImage")],
)
def test_boot_kernel_pvh_only_where_it_boots(version: str, expected: str) -> None:
    # QEMU 10's PVH entry hangs Debian 12's kernel at "ACPI: Core revision": newer QEMUs boot the bzImage.
    chosen = boot_kernel(Qemu(binary="qemu", version=version), Path("vmlinuz"), Path("bzImage"))

    assert chosen == Path(expected)


def test_boot_kernel_without_a_bzimage_boots_the_kernel() -> None:
    # An image whose kernel is already the bzImage (no PVH entry) keeps no second copy.
    assert boot_kernel(Qemu(binary="qemu", version="10.0.13"), Path("vmlinuz"), None) == Path("vmlinuz")
