"""Guest networking against real QEMU: forwards into the guest, host services from the guest.

Everything stays on the host's loopback: servers the tests run listen on
127.0.0.1, and forwarded guest ports are bound to 127.0.0.1 only.
"""

from __future__ import annotations

import http.server
import threading
import urllib.request
from collections.abc import Iterator

import pytest
from tenacity import Retrying, retry_if_result, stop_after_delay, wait_fixed

from pytest_forkd.core.factory import VMFactory
from pytest_forkd.core.vm import VM
from pytest_forkd.engine.qemu.network import NetworkSpec, listening_addresses
from pytest_forkd.errors import InvalidArgument, NetworkError
from pytest_forkd.storage.snapshot import Snapshot

GUEST_PORT = 8000
# A guest-side HTTP GET: prints the body, exits 1 with the error on stderr.
GET = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=4).read().decode())"


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        body = f"host:{self.server.server_address[1]}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def host_servers() -> Iterator[list[int]]:
    """Two HTTP servers on the host's loopback; yields their ports."""
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hello) for _ in range(2)]
    threads = [threading.Thread(target=server.serve_forever, daemon=True) for server in servers]
    for thread in threads:
        thread.start()
    yield [server.server_address[1] for server in servers]
    for server, thread in zip(servers, threads):
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def net_vm(outbound_snapshot: Snapshot) -> Iterator[VM]:
    child = outbound_snapshot.fork(1)[0]
    yield child
    child.close()


def start_guest_server(vm: VM, port: int = GUEST_PORT, bind: str = "0.0.0.0", wait: bool = True) -> None:
    """Start an HTTP server in the guest in the background (and wait until it listens)."""
    vm.exec(
        f"mkdir -p /srv/www && echo served-by-guest > /srv/www/index.html && cd /srv/www && "
        f"python3 -m http.server {port} --bind {bind} >/dev/null 2>&1 &",
        check=True,
    )
    if not wait:
        return
    poll = Retrying(
        stop=stop_after_delay(60), wait=wait_fixed(0.2), reraise=True, retry=retry_if_result(lambda found: not found)
    )
    poll(lambda: listening_addresses(vm.exec(["cat", "/proc/net/tcp"]).stdout, port))


def fetch(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/index.html", timeout=20) as response:
        return response.read().decode()


def guest_get(vm: VM, url: str):
    return vm.exec(["python3", "-c", GET, url], timeout=60)


def test_a_guest_server_answers_through_forward_and_keeps_serving_in_a_child(net_vm: VM) -> None:
    start_guest_server(net_vm, wait=False)
    host_port = net_vm.forward(GUEST_PORT)  # waits for the server to listen
    assert fetch(host_port) == "served-by-guest\n"
    assert net_vm.forward(GUEST_PORT) == host_port  # forwarding again is the same forward

    child = net_vm.fork(1)[0]
    try:
        child_port = child.forwards[GUEST_PORT]  # re-established in the child's own QEMU
        assert child_port != host_port
        assert child.forward(GUEST_PORT) == child_port
        assert fetch(child_port) == "served-by-guest\n"
        child.exec("echo changed-in-child > /srv/www/index.html", check=True)
        assert fetch(child_port) == "changed-in-child\n"
        assert fetch(host_port) == "served-by-guest\n"  # the parent keeps serving its own files
    finally:
        child.close()
    assert net_vm.network.forward == (GUEST_PORT,)


def test_forward_checks_that_the_guest_port_listens(net_vm: VM) -> None:
    with pytest.raises(NetworkError, match=r"nothing listens on guest port 8123 .*\(waited 0.5 s\)"):
        net_vm.forward(8123, timeout=0.5)
    start_guest_server(net_vm, 8124, bind="127.0.0.1")
    with pytest.raises(NetworkError, match=r"guest port 8124 .* listens only on the guest's loopback"):
        net_vm.forward(8124, timeout=0.5)
    with pytest.raises(InvalidArgument, match="guest_port must be a TCP port"):
        net_vm.forward(0)
    assert net_vm.forwards == {}
    assert net_vm.exec("echo still usable").stdout == "still usable\n"
    assert isinstance(net_vm.forward(8123, check=False), int)  # on request, forwarded all the same


def test_a_vm_without_network_has_no_card_forward_or_host_address(vm: VM) -> None:
    assert vm.network == NetworkSpec()
    assert vm.exec("test -e /sys/class/net/eth0").exit_code == 1
    with pytest.raises(NetworkError, match="no network .*guest port 8000"):
        vm.forward(8000)
    with pytest.raises(NetworkError, match="no host address"):
        _ = vm.host_address
    with pytest.raises(NetworkError, match="no network card"):
        vm.fork(1, network="outbound")
    assert vm.exec("echo still usable").stdout == "still usable\n"


def test_an_unknown_network_mode_is_refused_before_qemu_starts(factory: VMFactory) -> None:
    before = factory.vms
    with pytest.raises(InvalidArgument, match="unknown network mode 'wifi'"):
        factory.boot(network="wifi")
    with pytest.raises(InvalidArgument, match=r"network\.allow\[0\]"):
        factory.boot(network={"mode": "host", "allow": [123456]})
    assert factory.vms == before


def test_host_mode_reaches_only_the_allowed_host_ports(factory: VMFactory, host_servers: list[int]) -> None:
    allowed, other = host_servers
    root = factory.boot(network={"mode": "host", "allow": [allowed]})
    try:
        assert root.host_address == "10.0.2.100"
        assert guest_get(root, f"http://{root.host_address}:{allowed}/").stdout == f"host:{allowed}\n"
        refused = guest_get(root, f"http://{root.host_address}:{other}/")
        assert refused.exit_code == 1 and refused.stdout == ""
        gateway = guest_get(root, f"http://10.0.2.2:{other}/")
        assert gateway.exit_code == 1 and gateway.stdout == ""

        snapshot = root.branch()
        assert snapshot.network == {"mode": "host", "allow": [allowed], "forward": []}
        child = snapshot.fork(1)[0]
        try:
            assert guest_get(child, f"http://10.0.2.100:{allowed}/").stdout == f"host:{allowed}\n"
            assert guest_get(child, f"http://10.0.2.100:{other}/").exit_code == 1
        finally:
            child.close()
    finally:
        root.close()


def test_outbound_mode_reaches_the_host_loopback(net_vm: VM, host_servers: list[int]) -> None:
    port = host_servers[0]
    assert net_vm.host_address == "10.0.2.2"
    assert guest_get(net_vm, f"http://{net_vm.host_address}:{port}/").stdout == f"host:{port}\n"
    assert net_vm.origin is not None and net_vm.origin.network["mode"] == "outbound"


def test_children_can_get_another_policy_on_the_same_card(outbound_snapshot: Snapshot, host_servers: list[int]) -> None:
    allowed, other = host_servers
    (child,) = outbound_snapshot.fork(1, network={"mode": "host", "allow": [allowed]})
    try:
        assert child.network == NetworkSpec("host", (allowed,))
        assert guest_get(child, f"http://10.0.2.100:{allowed}/").stdout == f"host:{allowed}\n"
        assert guest_get(child, f"http://10.0.2.2:{other}/").exit_code == 1
    finally:
        child.close()
    with pytest.raises(NetworkError, match="has a network card"):
        outbound_snapshot.fork(1, network="none")


def test_forwards_listed_at_boot_are_made_at_start(factory: VMFactory) -> None:
    root = factory.boot(network={"mode": "outbound", "forward": [GUEST_PORT]})
    try:
        host_port = root.forwards[GUEST_PORT]
        start_guest_server(root)
        assert fetch(host_port) == "served-by-guest\n"
    finally:
        root.close()


def test_restore_keeps_the_forwarded_host_port(net_vm: VM) -> None:
    start_guest_server(net_vm)
    host_port = net_vm.forward(GUEST_PORT)
    with net_vm.checkpoint():
        net_vm.exec("echo damaged > /srv/www/index.html", check=True)
        assert fetch(host_port) == "damaged\n"
    assert net_vm.forwards == {GUEST_PORT: host_port}
    assert fetch(host_port) == "served-by-guest\n"


@pytest.mark.parametrize("backend", ["full", "diff", "uffd"])
def test_every_backend_branches_a_networked_vm(net_vm: VM, backend: str) -> None:
    reason = net_vm.factory.runtime.backends.get(backend).unavailable_reason()
    if reason:
        pytest.skip(f"{backend} is unavailable here: {reason}")
    start_guest_server(net_vm)
    net_vm.forward(GUEST_PORT)
    snapshot = net_vm.branch(backend=backend).wait_ready(timeout=120)
    (child,) = snapshot.fork(1)
    try:
        assert fetch(child.forwards[GUEST_PORT]) == "served-by-guest\n"
    finally:
        child.close()


def test_the_guest_has_the_driver_and_a_static_address(net_vm: VM, vm: VM) -> None:
    assert {"failover", "net_failover", "virtio_net"} <= set(vm.read_file("/etc/forkd/modules").decode().split())
    address = net_vm.exec("ip -4 addr show eth0; ip route", check=True).stdout
    assert "inet 10.0.2.15/24" in address and "default via 10.0.2.2" in address
    assert net_vm.read_file("/etc/resolv.conf") == b"nameserver 10.0.2.3\n"


def test_a_networked_snapshot_survives_export_and_import(net_vm: VM, tmp_path) -> None:
    from pytest_forkd import import_snapshot
    from pytest_forkd.archives import archive

    start_guest_server(net_vm)
    net_vm.forward(GUEST_PORT)
    path = tmp_path / "web.forkd.tar.zst"
    archive.export_snapshot(net_vm.branch("itest-net-export", backend="full"), path)
    imported = import_snapshot(path, store=tmp_path / "store")
    assert imported.network == {"mode": "outbound", "allow": [], "forward": [GUEST_PORT]}
    (child,) = net_vm.factory.fork_snapshot(imported, 1)
    try:
        assert fetch(child.forwards[GUEST_PORT]) == "served-by-guest\n"
    finally:
        child.close()
