"""`network:` in forkd.yaml through a real pytest run: the suite's VMs reach a host service and serve the host."""

from __future__ import annotations

import http.server
import threading

import pytest

pytestmark = pytest.mark.vm

SUITE = """
import urllib.request

import pytest
from tenacity import Retrying, retry_if_result, stop_after_delay, wait_fixed

from pytest_forkd.engine.qemu.network import listening_addresses

PORT = {port}
GET = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=4).read().decode())"


def test_reaches_the_allowed_host_service(forkd_vm):
    assert forkd_vm.network.mode == "host"
    result = forkd_vm.exec(["python3", "-c", GET, f"http://{{forkd_vm.host_address}}:{{PORT}}/"])
    assert result.stdout == "fake-api\\n"


def test_serves_the_host_through_a_forward(forkd_vm):
    forkd_vm.exec("cd /tmp && echo from-guest > index.html && "
                  "(setsid python3 -m http.server 8000 >/dev/null 2>&1 &)", check=True)
    Retrying(stop=stop_after_delay(60), wait=wait_fixed(0.2), reraise=True,
             retry=retry_if_result(lambda found: not found))(
        lambda: listening_addresses(forkd_vm.exec(["cat", "/proc/net/tcp"]).stdout, 8000))
    port = forkd_vm.forward(8000)
    with urllib.request.urlopen(f"http://127.0.0.1:{{port}}/index.html", timeout=20) as response:
        assert response.read() == b"from-guest\\n"


def test_children_of_a_checkpoint_may_get_another_policy(forkd_vm, forkd_checkpoint):
    (child,) = forkd_checkpoint(forkd_vm).snapshot.fork(1, network="outbound")
    assert child.host_address == "10.0.2.2"
    assert child.exec(["python3", "-c", GET, f"http://10.0.2.2:{{PORT}}/"]).stdout == "fake-api\\n"
"""


class _FakeApi(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        body = b"fake-api"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_network_declared_in_forkd_yaml_reaches_the_tests_vms(pytester, run_forkd, tmp_path, workers):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        pytester.makefile(".yaml", forkd=f"snapshots:\n  web:\n    network: {{mode: host, allow: [{port}]}}\n")
        pytester.makepyfile(test_web=SUITE.format(port=port))
        result = run_forkd("--forkd-snapshot=web", "-p", "no:randomly", *workers, store=tmp_path)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
    result.assert_outcomes(passed=3)
    stored = {path.parent.name for path in tmp_path.rglob("snapshot.json")}  # project namespaces included
    assert {"web", "base-net"} <= stored
