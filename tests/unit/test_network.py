"""Guest network choices: parsing, QEMU arguments, recipes and planning, without starting a VM."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pytest_forkd.engine.qemu.host import Qemu
from pytest_forkd.engine.qemu.machine import MachineSpec
from pytest_forkd.engine.qemu.network import (
    HOST_ADDRESS_OUTBOUND,
    HOST_ADDRESS_RESTRICTED,
    RELAY_SCRIPT,
    NetworkSpec,
    check_card,
    device_args,
    hostfwd_command,
    listening_addresses,
    netdev_args,
    network_from_record,
    network_spec,
)
from pytest_forkd.errors import ConfigError, ForkdError, InvalidArgument, NetworkError
from pytest_forkd.project.config import parse_project
from pytest_forkd.project.snapshot_builder import SnapshotBuilder
from pytest_forkd.storage.snapshot import Snapshot


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, NetworkSpec()),
        ("none", NetworkSpec()),
        ("outbound", NetworkSpec("outbound")),
        ("host", NetworkSpec("host")),
        ([9000, 8080, 8080], NetworkSpec("host", allow=(8080, 9000))),
        ({"mode": "host", "allow": [8080], "forward": [8000]}, NetworkSpec("host", (8080,), (8000,))),
        ({"allow": [8080]}, NetworkSpec("host", (8080,))),
        ({"mode": "outbound", "forward": [80]}, NetworkSpec("outbound", forward=(80,))),
    ],
)
def test_network_forms(value, expected):
    assert network_spec(value) == expected
    assert network_spec(expected) is expected


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("wifi", "'wifi'"),
        ({"mode": "bridge"}, "network.mode"),
        ({"mode": "host", "ports": [1]}, "network.ports"),
        ([8080, 70000], "network[1]"),
        ({"mode": "host", "allow": [0]}, "network.allow[0]"),
        ({"mode": "outbound", "allow": [8080]}, "network.allow"),
        ({"mode": "none", "forward": [8000]}, "network.forward"),
        ({"mode": "host", "allow": "8080"}, "network.allow"),
        (42, "network"),
        ([True], "network[0]"),
    ],
)
def test_bad_networks_are_invalid_arguments_naming_the_key(value, named):
    with pytest.raises(InvalidArgument) as caught:
        network_spec(value)
    assert named in str(caught.value)
    assert isinstance(caught.value, ForkdError)


def test_unknown_mode_lists_the_valid_ones():
    with pytest.raises(InvalidArgument, match="unknown network mode 'wifi'; use one of 'none', 'host', 'outbound'"):
        network_spec("wifi")


def test_no_network_means_no_card_and_no_arguments():
    spec = NetworkSpec()
    assert (spec.has_card, device_args(spec), netdev_args(spec), spec.host_address) == (False, [], [], None)


def test_outbound_is_an_unrestricted_user_network():
    spec = NetworkSpec("outbound")
    (netdev,) = netdev_args(spec)[1:]
    assert device_args(spec) == ["-device", "virtio-net-device,netdev=forkd-net"]
    assert netdev.startswith("user,id=forkd-net,")
    assert "restrict" not in netdev and "guestfwd" not in netdev
    assert spec.host_address == HOST_ADDRESS_OUTBOUND == "10.0.2.2"


def test_host_mode_is_restricted_with_one_relay_per_allowed_port():
    spec = NetworkSpec("host", allow=(8080, 9000))
    netdev = netdev_args(spec, python="/usr/bin/python3")[1]
    options = netdev.split(",")
    assert "restrict=on" in options
    relays = [option for option in options if option.startswith("guestfwd=")]
    assert relays == [
        f"guestfwd=tcp:10.0.2.100:{port}-cmd:/usr/bin/python3 -I -S {RELAY_SCRIPT} {port}" for port in (8080, 9000)
    ]
    assert spec.host_address == HOST_ADDRESS_RESTRICTED


def test_commas_in_paths_are_escaped_and_spaces_refused():
    assert "/opt/a,,b/python" in netdev_args(NetworkSpec("host", allow=(1,)), python="/opt/a,b/python")[1]
    with pytest.raises(NetworkError, match="contains a space"):
        netdev_args(NetworkSpec("host", allow=(1,)), python="/opt/my python/bin/python3")


def test_hostfwd_command_binds_the_host_loopback_only():
    assert hostfwd_command(40001, 8000) == "hostfwd_add forkd-net tcp:127.0.0.1:40001-10.0.2.15:8000"


def test_record_round_trip():
    spec = NetworkSpec("host", allow=(8080,), forward=(8000,))
    assert network_from_record(spec.to_json()) == spec
    assert network_from_record(None) == NetworkSpec()
    assert spec.with_forward([9000, 8000, 9000]).forward == (8000, 9000)


def _spec(card: bool) -> MachineSpec:
    return MachineSpec(qemu=Qemu("/usr/bin/qemu-system-x86_64", "7.2.0"), accel="tcg", network_card=card)


def test_the_card_is_part_of_the_machine_and_its_fingerprint(monkeypatch):
    monkeypatch.setattr("pytest_forkd.engine.qemu.machine.tsc_khz", lambda: 2000000)
    without, with_card = _spec(False), _spec(True)
    assert "virtio-net-device,netdev=forkd-net" not in " ".join(without.machine_args())
    assert with_card.machine_args()[-2:] == ["-device", "virtio-net-device,netdev=forkd-net"]
    assert without.fingerprint() != with_card.fingerprint()
    # Machines without network keep the fingerprint they had before networking existed.
    assert without.machine_args()[-1] == "migration.send-configuration=off"


def test_a_child_keeps_its_parents_card():
    check_card("base", NetworkSpec("host"), NetworkSpec("outbound"))
    check_card("base", NetworkSpec(), NetworkSpec())
    with pytest.raises(NetworkError, match="'base' has no network card.*'outbound'"):
        check_card("base", NetworkSpec(), NetworkSpec("outbound"))
    with pytest.raises(NetworkError, match="'web' has a network card.*'none'"):
        check_card("web", NetworkSpec("host"), NetworkSpec())


PROC_NET_TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0 100 0 0 10 0
   1: 0100007F:1F41 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2 1 0 100 0 0 10 0
   2: 0F02000A:1F40 0202000A:9C40 01 00000000:00000000 00:00000000 00000000     0        0 3 1 0 100 0 0 10 0
   3: 0F02000A:1F42 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4 1 0 100 0 0 10 0
  sl  local_address                         remote_address                        st tx_queue rx_queue
   0: 00000000000000000000000000000000:1F43 00000000000000000000000000000000:0000 0A 00000000:00000000
   1: 00000000000000000000000001000000:1F44 00000000000000000000000000000000:0000 0A 00000000:00000000
"""


@pytest.mark.parametrize(
    ("port", "addresses"),
    [(8000, {"0.0.0.0"}), (8001, {"127.0.0.1"}), (8002, {"10.0.2.15"}), (8003, {"::"}), (8004, {"::1"}), (8005, set())],
)
def test_listening_addresses_read_proc_net_tcp(port, addresses):
    assert listening_addresses(PROC_NET_TCP, port) == addresses


def _project(tmp_path: Path, text: str):
    import yaml

    return parse_project(yaml.safe_load(text), path=tmp_path / "forkd.yaml")


def test_forkd_yaml_network_per_snapshot(tmp_path):
    project = _project(
        tmp_path,
        """
snapshots:
  web:
    network: {mode: host, allow: [8080], forward: [8000]}
  out:
    from: web
    network: outbound
  ports:
    network: [9000]
  plain: {}
""",
    )
    assert project.snapshots["web"].network == NetworkSpec("host", (8080,), (8000,))
    assert project.snapshots["out"].network == NetworkSpec("outbound")
    assert project.snapshots["ports"].network == NetworkSpec("host", (9000,))
    assert project.snapshots["plain"].network is None


@pytest.mark.parametrize(
    ("network", "message"),
    [
        ("wifi", "forkd.yaml: snapshots.web.network: unknown network mode 'wifi'"),
        ("{mode: host, allow: [99999]}", "forkd.yaml: snapshots.web.network.allow[0] must be a TCP port"),
        ("{mode: host, open: [1]}", "forkd.yaml: snapshots.web.network.open: unknown key"),
    ],
)
def test_forkd_yaml_network_errors_name_the_field(tmp_path, network, message):
    with pytest.raises(ConfigError) as caught:
        _project(tmp_path, f"snapshots:\n  web:\n    network: {network}\n")
    assert str(caught.value).startswith(message)


def _builder(tmp_path: Path, text: str) -> SnapshotBuilder:
    return SnapshotBuilder(factory=None, store=None, project=_project(tmp_path, text))  # type: ignore[arg-type]


def test_a_network_recipe_over_base_is_built_from_a_base_with_a_card(tmp_path):
    builder = _builder(
        tmp_path,
        """
snapshots:
  web: {network: {mode: host, allow: [8080]}}
  web2: {from: web}
  quiet: {from: web, network: none}
  tools: {}
""",
    )
    web = builder._plan("web", None)
    assert (web.tag, web.network, web.parent.tag) == ("web", NetworkSpec("host", (8080,)), "base-net")
    assert web.parent.network == NetworkSpec("host") and web.parent.parent is None
    web2 = builder._plan("web2", None)
    assert (web2.network, web2.parent.tag) == (NetworkSpec("host", (8080,)), "web")
    quiet = builder._plan("quiet", None)
    assert (quiet.network, quiet.parent.tag, quiet.parent.parent.tag) == (NetworkSpec(), "web-nonet", "base")
    tools = builder._plan("tools", 512)
    assert (tools.tag, tools.network, tools.parent.tag) == ("tools-m512", NetworkSpec(), "base-m512")
    big = builder._plan("web", 512)
    assert (big.tag, big.parent.tag) == ("web-m512", "base-m512-net")


def test_snapshot_records_its_network(tmp_path):
    record = Snapshot(
        tag="s",
        path=tmp_path,
        backend="full",
        memory_mib=256,
        vcpus=1,
        image="default",
        fingerprint={},
        state_file="state",
        memory_file="memory",
        network={"mode": "host", "allow": [8080], "forward": []},
    )
    record.save_to(tmp_path)
    loaded = Snapshot.load_from(tmp_path)
    assert network_from_record(loaded.network) == NetworkSpec("host", (8080,))
    plain = Snapshot(
        tag="p",
        path=tmp_path,
        backend="full",
        memory_mib=256,
        vcpus=1,
        image="default",
        fingerprint={},
        state_file="state",
        memory_file="memory",
    )
    assert plain.network is None


def test_relay_copies_both_ways_and_closes(tmp_path):
    """The guestfwd relay, with a socketpair standing in for the guest's connection."""
    import socket

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def echo_upper() -> None:
        connection, _ = server.accept()
        with connection:
            data = b""
            while chunk := connection.recv(1024):
                data += chunk
            connection.sendall(data.upper())

    thread = threading.Thread(target=echo_upper)
    thread.start()
    guest, relay_end = socket.socketpair()
    process = subprocess.Popen(
        [sys.executable, "-I", "-S", str(RELAY_SCRIPT), str(port)],
        stdin=relay_end,
        stdout=relay_end,
        stderr=subprocess.DEVNULL,
    )
    relay_end.close()
    guest.sendall(b"hello relay")
    guest.shutdown(socket.SHUT_WR)
    answer = b""
    while chunk := guest.recv(1024):
        answer += chunk
    assert answer == b"HELLO RELAY"
    assert process.wait(timeout=10) == 0
    thread.join(timeout=10)
    guest.close()
    server.close()


def test_relay_to_a_closed_port_exits_nonzero():
    import socket

    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    guest, relay_end = socket.socketpair()
    process = subprocess.Popen(
        [sys.executable, "-I", "-S", str(RELAY_SCRIPT), str(port)],
        stdin=relay_end,
        stdout=relay_end,
        stderr=subprocess.DEVNULL,
    )
    relay_end.close()
    assert process.wait(timeout=10) == 1
    assert guest.recv(10) == b""
    guest.close()


def test_machine_refuses_a_network_that_disagrees_with_its_card(tmp_path):
    from pytest_forkd.engine.qemu.machine import Machine

    with pytest.raises(NetworkError, match="needs a machine with a network card"):
        Machine.launch(
            _spec(False),
            tmp_path,
            "vm",
            kernel=tmp_path / "k",
            initrd=tmp_path / "i",
            ram_path=tmp_path / "r",
            share=True,
            owns_ram=True,
            network=NetworkSpec("outbound"),
        )
    assert list(tmp_path.iterdir()) == []


def test_describe_names_mode_ports_and_forwards():
    assert NetworkSpec().describe() == "none"
    assert NetworkSpec("outbound", forward=(8000,)).describe() == "outbound, forwards guest ports 8000"
    assert NetworkSpec("host", allow=(8080, 9000)).describe() == "host (ports 8080, 9000 at 10.0.2.100)"


def test_cli_network_takes_a_mode_or_host_ports():
    from pytest_forkd.cli.exec_cmd import cli_network

    assert cli_network(None) is None
    assert cli_network("outbound") == "outbound"
    assert cli_network("8080,9000") == [8080, 9000]
    with pytest.raises(InvalidArgument, match="--network: expected a mode"):
        cli_network("8080,web")


def test_a_record_without_network_has_no_network_field(tmp_path):
    import json

    Snapshot(
        tag="p",
        path=tmp_path,
        backend="full",
        memory_mib=256,
        vcpus=1,
        image="default",
        fingerprint={},
        state_file="state",
        memory_file="memory",
    ).save_to(tmp_path)
    assert "network" not in json.loads((tmp_path / "snapshot.json").read_text())


def test_export_finds_the_machine_of_a_snapshot_with_a_network_card(tmp_path, monkeypatch):
    from pytest_forkd.archives.archive import _machine_of

    monkeypatch.setattr("pytest_forkd.engine.qemu.machine.tsc_khz", lambda: 2000000)
    spec = _spec(True)
    record = Snapshot(
        tag="web",
        path=tmp_path,
        backend="full",
        memory_mib=256,
        vcpus=1,
        image="default",
        fingerprint={"qemu": "7.2.0", "machine": spec.fingerprint()},
        state_file="state",
        memory_file="memory",
        network=NetworkSpec("outbound").to_json(),
    )
    machine = _machine_of(record, ())
    assert "virtio-net-device,netdev=forkd-net" in machine["machine_args"]
