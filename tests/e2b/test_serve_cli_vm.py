"""``forkd e2b serve`` as users run it: a real subprocess, the SDK in other processes with only its printed env.

Also what must never leak: a client killed in the middle of a stream leaves
no process in the sandbox past its timeout, and Ctrl-C (SIGINT) of the server
with sandboxes running and paused leaves no QEMU process, no run directory
and no snapshot in the store.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import USER_CACHE, processes_mentioning

pytest.importorskip("e2b")

pytestmark = pytest.mark.vm

FORKD = [sys.executable, "-m", "pytest_forkd.cli"]


@dataclass
class Served:
    process: subprocess.Popen[str]
    env: dict[str, str]
    shm_root: Path

    @property
    def port(self) -> int:
        return int(self.env["E2B_API_URL"].rsplit(":", 1)[1])


def serve(shm_root: Path, *args: str) -> Served:
    """Start ``forkd e2b serve`` and wait for the three export lines it prints once it is ready."""
    env = {name: value for name, value in os.environ.items() if not name.startswith(("PYTEST_", "E2B_"))}
    env.update(FORKD_SHM_DIR=str(shm_root), FORKD_CACHE_DIR=str(USER_CACHE))
    process = subprocess.Popen(
        [*FORKD, "e2b", "serve", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    printed: dict[str, str] = {}
    assert process.stdout is not None
    while len(printed) < 3:
        line = process.stdout.readline()
        if not line:
            _, err = process.communicate(timeout=60)
            pytest.fail(f"forkd e2b serve ended before it printed its environment: {err[-3000:]}")
        assert line.startswith("export E2B_"), line
        name, _, value = line.removeprefix("export ").strip().partition("=")
        printed[name] = value
    return Served(process, printed, shm_root)


def client(served: Served, code: str, **kwargs: object) -> subprocess.Popen[str]:
    """A Python process that has nothing of the server but the printed environment."""
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), **served.env}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, text=True, stdout=subprocess.PIPE, **kwargs
    )


def stop(served: Served) -> int:
    served.process.send_signal(signal.SIGINT)
    try:
        return served.process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(served.process.pid, signal.SIGKILL)
        raise


def e2b_snapshots(pid: int) -> list[str]:
    """Snapshots server ``pid`` wrote to the user's store (pause and create_snapshot), still there."""
    store = USER_CACHE / "snapshots"
    return sorted(path.name for path in store.rglob(f"e2b-p{pid}-*")) if store.is_dir() else []


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with tempfile.TemporaryDirectory(prefix="forkd-e2b-cli-", dir="/dev/shm", ignore_cleanup_errors=True) as root:
        server = serve(Path(root))
        try:
            yield server
        finally:
            if server.process.poll() is None:
                stop(server)


def test_the_printed_environment_is_all_the_sdk_needs(served: Served) -> None:
    assert set(served.env) == {"E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY"}
    assert served.env["E2B_API_URL"] == served.env["E2B_SANDBOX_URL"] == f"http://127.0.0.1:{served.port}"
    run = client(
        served,
        """
        from e2b import Sandbox
        sandbox = Sandbox.create()
        print(sandbox.commands.run("echo made by $(whoami 2>/dev/null || id -un)").stdout.strip())
        sandbox.files.write("/tmp/x", "y")
        print(sandbox.files.read("/tmp/x"))
        sandbox.kill()
        """,
    )
    out, _ = run.communicate(timeout=300)
    assert run.returncode == 0 and out.split("\n")[:2] == ["made by user", "y"]  # E2B's default user


def test_it_listens_on_loopback_only(served: Served) -> None:
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, port = local.rsplit(":", 1)
            if state == "0A" and int(port, 16) == served.port:  # LISTEN
                listening.append(address)
    assert listening == ["0100007F"], f"listening on {listening} (0100007F is 127.0.0.1)"


def test_a_client_killed_mid_stream_leaves_no_process(served: Served) -> None:
    run = client(
        served,
        """
        import sys
        from e2b import Sandbox
        sandbox = Sandbox.create(timeout=300)
        print(sandbox.sandbox_id, flush=True)
        sandbox.commands.run(
            "i=0; while true; do echo line $i; i=$((i+1)); sleep 0.2; done",
            timeout=6, on_stdout=lambda text: print(text.strip(), flush=True),
        )
        """,
    )
    assert run.stdout is not None
    sandbox_id = run.stdout.readline().strip()
    assert run.stdout.readline().startswith("line"), "the stream was flowing"
    run.kill()  # mid-stream, without a word to the server
    run.wait(timeout=30)
    check = client(
        served,
        f"""
        import time
        from e2b import Sandbox
        sandbox = Sandbox.connect({sandbox_id!r})
        deadline = time.monotonic() + 60
        while sandbox.commands.list() and time.monotonic() < deadline:
            time.sleep(0.5)
        print(len(sandbox.commands.list()))
        listing = "for f in /proc/[0-9]*/cmdline; do tr '\\\\0' ' ' < $f; echo; done"
        print(sandbox.commands.run(listing + " | grep -c '[w]hile true; do echo line' || true").stdout.strip())
        sandbox.kill()
        """,
    )
    out, _ = check.communicate(timeout=300)
    assert check.returncode == 0 and out.split() == ["0", "0"], out


def test_ctrl_c_with_sandboxes_running_and_paused_leaves_nothing() -> None:
    with tempfile.TemporaryDirectory(prefix="forkd-e2b-sigint-", dir="/dev/shm", ignore_cleanup_errors=True) as root:
        served = serve(Path(root))
        run = client(
            served,
            """
            from e2b import Sandbox
            running = Sandbox.create()
            running.commands.run("sleep 600", background=True, timeout=0)
            paused = Sandbox.create()
            paused.files.write("/tmp/state", "x")
            paused.pause()
            print("ready", flush=True)
            """,
        )
        out, _ = run.communicate(timeout=300)
        assert run.returncode == 0 and out.strip() == "ready"
        assert e2b_snapshots(served.process.pid), "the paused sandbox's state is in the store"
        assert processes_mentioning(root), "its sandboxes run"
        assert stop(served) == 0
        for _ in range(50):
            if not processes_mentioning(root):
                break
            time.sleep(0.2)
        assert processes_mentioning(root) == []
        left = sorted(os.listdir(root)) if os.path.exists(root) else []  # the last run removes the root too
        assert left == [], "no run directory, socket or memory file is left"
        assert e2b_snapshots(served.process.pid) == [], "no snapshot is left in the store"
