"""The E2B-compatible server on the fake engine, driven by the official SDK: routing, auth, limits, errors, life.

The fake engine's guests are the real agent run on the host (no QEMU), so
these run in seconds; every call still goes through the real SDK, the real
HTTP and Connect stacks and the real agent. What needs a real guest (the
filesystem helper across forks, processes across a pause) is in
test_sdk_vm.py.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import io
import json
import time
import urllib.parse
from typing import Any

import httpx
import pytest

e2b = pytest.importorskip("e2b")

pytestmark = pytest.mark.slow  # no QEMU, but a server and seconds of fake-engine VMs per test
from e2b import (  # noqa: E402
    AsyncSandbox,
    AuthenticationException,
    CommandExitException,
    FileNotFoundException,
    NotFoundException,
    RateLimitException,
    Sandbox,
    SandboxException,
    SandboxNotFoundException,
    TimeoutException,
)

from pytest_forkd.e2b.server import E2BServer  # noqa: E402


def guest_dir(server: E2BServer, sandbox: Any) -> str:
    """Where the fake guest of ``sandbox`` keeps its files: its commands' working directory, on the host."""
    return str(server.vm(sandbox.sandbox_id).exec("pwd").stdout.strip())


def raw(server: E2BServer, method: str, path: str, **kwargs: Any) -> httpx.Response:
    headers = {"X-API-Key": server.api_key, **kwargs.pop("headers", {})}
    return httpx.request(method, server.url + path, headers=headers, timeout=60, **kwargs)


# -- the sandbox API ----------------------------------------------------------------------------------


def test_a_sandbox_is_created_used_listed_and_killed(fake_e2b: E2BServer) -> None:
    sandbox = Sandbox.create(metadata={"suite": "fake"}, envs={"FROM_CREATE": "yes"})
    where = guest_dir(fake_e2b, sandbox)
    result = sandbox.commands.run(
        "echo $FROM_CREATE $FROM_CALL; echo oops >&2; pwd", envs={"FROM_CALL": "1"}, cwd=where
    )
    assert (result.stdout, result.stderr, result.exit_code) == (f"yes 1\n{where}\n", "oops\n", 0)
    info = sandbox.get_info()
    assert info.sandbox_id == sandbox.sandbox_id and info.state.value == "running"
    assert info.metadata == {"suite": "fake"} and info.template_id == "base"
    listed = Sandbox.list().next_items()
    assert sandbox.sandbox_id in [item.sandbox_id for item in listed]
    assert fake_e2b.vm(sandbox.sandbox_id).exec("true").ok  # the sandbox is a forkd VM
    assert sandbox.kill() is True
    assert not sandbox.is_running()
    assert Sandbox.kill(sandbox.sandbox_id) is False
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(sandbox.sandbox_id)
    with pytest.raises(TimeoutException, match="was not found"):  # SandboxNotRunningException
        sandbox.commands.run("true")


def test_a_non_zero_exit_raises_with_its_code_and_output(fake_e2b: E2BServer) -> None:
    sandbox = Sandbox.create()
    with pytest.raises(CommandExitException) as caught:
        sandbox.commands.run("echo partial; echo why >&2; exit 7", cwd=guest_dir(fake_e2b, sandbox))
    assert (caught.value.exit_code, caught.value.stdout, caught.value.stderr) == (7, "partial\n", "why\n")


def test_background_commands_take_stdin_list_connect_and_die(fake_e2b: E2BServer) -> None:
    sandbox = Sandbox.create()
    where = guest_dir(fake_e2b, sandbox)
    handle = sandbox.commands.run("read line; echo got $line", background=True, stdin=True, cwd=where)
    assert handle.pid in [process.pid for process in sandbox.commands.list()]
    sandbox.commands.send_stdin(handle.pid, "hello\n")
    assert handle.wait().stdout == "got hello\n"
    reader = sandbox.commands.run("cat", background=True, stdin=True, cwd=where)
    sandbox.commands.stream_input(reader.pid, ["one\n", b"two\n"])
    sandbox.commands.close_stdin(reader.pid)
    assert reader.wait().stdout == "one\ntwo\n"
    sleeper = sandbox.commands.run("echo start; sleep 60", background=True, cwd=where)
    again = sandbox.commands.connect(sleeper.pid)
    assert sandbox.commands.kill(sleeper.pid) is True
    with pytest.raises(CommandExitException) as caught:
        again.wait()
    assert caught.value.exit_code == -1
    assert sandbox.commands.kill(sleeper.pid) is False
    assert [process.pid for process in sandbox.commands.list()] == []


def test_a_user_the_sandbox_lacks_is_an_authentication_error(fake_e2b: E2BServer) -> None:
    """As envd answers a call as an unknown user ("invalid username"), not as a sandbox that stopped running."""
    sandbox = Sandbox.create()
    where = guest_dir(fake_e2b, sandbox)
    with pytest.raises(AuthenticationException, match="'no-such-user'"):
        sandbox.commands.run("true", user="no-such-user", cwd=where)
    with pytest.raises(AuthenticationException, match="'no-such-user'"):
        sandbox.files.write(f"{where}/x", "y", user="no-such-user")
    with pytest.raises(AuthenticationException, match="'no-such-user'"):
        sandbox.files.get_info(where, user="no-such-user")
    sandbox.files.write(f"{where}/readable", "y")
    with pytest.raises(AuthenticationException, match="'no-such-user'"):
        sandbox.files.read(f"{where}/readable", user="no-such-user")
    assert sandbox.is_running() and sandbox.commands.run("echo fine", cwd=where).stdout == "fine\n"


def test_a_command_timeout_kills_it_and_raises_timeout(fake_e2b: E2BServer) -> None:
    sandbox = Sandbox.create()
    started = time.monotonic()
    with pytest.raises(TimeoutException):
        sandbox.commands.run("sleep 30", timeout=1, cwd=guest_dir(fake_e2b, sandbox))
    assert time.monotonic() - started < 20
    for _ in range(50):  # the process is killed at its deadline, whether or not anyone listens
        if not sandbox.commands.list():
            break
        time.sleep(0.1)
    assert sandbox.commands.list() == []


def test_files_text_bytes_streams_several_at_once_and_metadata(fake_e2b: E2BServer) -> None:
    sandbox = Sandbox.create()
    where = guest_dir(fake_e2b, sandbox)
    info = sandbox.files.write(f"{where}/deep/dir/a.txt", "hello", metadata={"owner": "tests"})
    assert info.path == f"{where}/deep/dir/a.txt" and info.metadata == {"owner": "tests"}
    assert sandbox.files.read(f"{where}/deep/dir/a.txt") == "hello"
    sandbox.files.write_files([{"path": f"{where}/m1", "data": b"\x00\x01"}, {"path": f"{where}/m2", "data": "two"}])
    assert bytes(sandbox.files.read(f"{where}/m1", format="bytes")) == b"\x00\x01"
    sandbox.files.write(f"{where}/streamed", io.BytesIO(b"s" * 300_000))
    assert b"".join(sandbox.files.read(f"{where}/streamed", format="stream")) == b"s" * 300_000
    sandbox.files.write(f"{where}/zipped", b"z" * 100_000, gzip=True)
    assert len(sandbox.files.read(f"{where}/zipped", format="bytes")) == 100_000
    entry = sandbox.files.get_info(f"{where}/deep/dir/a.txt")
    assert (entry.name, entry.size, entry.type.value, entry.metadata) == ("a.txt", 5, "file", {"owner": "tests"})
    names = {item.name for item in sandbox.files.list(where, depth=3)}
    assert {"deep", "dir", "a.txt", "m1", "m2", "streamed", "zipped"} <= names
    sandbox.files.rename(f"{where}/m2", f"{where}/moved/m2")
    assert not sandbox.files.exists(f"{where}/m2") and sandbox.files.read(f"{where}/moved/m2") == "two"
    assert sandbox.files.make_dir(f"{where}/newdir") is True and sandbox.files.make_dir(f"{where}/newdir") is False
    sandbox.files.remove(f"{where}/deep")
    assert not sandbox.files.exists(f"{where}/deep/dir/a.txt")
    with pytest.raises(FileNotFoundException):
        sandbox.files.read(f"{where}/nope")
    with pytest.raises(FileNotFoundException):
        sandbox.files.remove(f"{where}/nope")


def test_an_upload_past_the_limit_is_refused_and_leaves_the_old_file(fake_e2b: E2BServer) -> None:
    sandbox = Sandbox.create()
    where = guest_dir(fake_e2b, sandbox)
    sandbox.files.write(f"{where}/kept", "old")
    limit = fake_e2b.config.limits.max_upload
    with pytest.raises(SandboxException, match="upload limit"):
        sandbox.files.write(f"{where}/kept", io.BytesIO(b"x" * (limit + 1)))
    assert sandbox.files.read(f"{where}/kept") == "old"


def test_watchers_report_writes_polled_and_streamed(fake_e2b: E2BServer) -> None:
    sandbox = Sandbox.create()
    where = guest_dir(fake_e2b, sandbox)
    sandbox.files.make_dir(f"{where}/watched")
    handle = sandbox.files.watch_dir(f"{where}/watched")
    sandbox.files.write(f"{where}/watched/new.txt", "x")
    events: list[Any] = []
    for _ in range(50):
        events += handle.get_new_events()
        if any(event.name == "new.txt" and event.type.value == "write" for event in events):
            break
        time.sleep(0.1)
    assert [(event.name, event.type.value) for event in events if not event.name.startswith(".")][:2] == [
        ("new.txt", "create"),
        ("new.txt", "write"),
    ]
    handle.stop()

    async def streamed() -> list[tuple[str, str]]:
        sandbox_async = await AsyncSandbox.connect(sandbox.sandbox_id)
        seen: list[tuple[str, str]] = []
        got = asyncio.Event()

        def on_event(event: Any) -> None:
            seen.append((event.name, event.type.value))
            got.set()

        watch = await sandbox_async.files.watch_dir(f"{where}/watched", on_event, recursive=True)
        await sandbox_async.files.write(f"{where}/watched/other.txt", "y")
        await asyncio.wait_for(got.wait(), 30)
        await watch.stop()
        return seen

    assert ("other.txt", "create") in asyncio.run(streamed())


def test_a_terminal_runs_takes_input_resizes_and_ends(fake_e2b: E2BServer) -> None:
    from e2b import PtySize

    sandbox = Sandbox.create()
    output = bytearray()
    terminal = sandbox.pty.create(PtySize(rows=24, cols=80), cwd=guest_dir(fake_e2b, sandbox))
    sandbox.pty.resize(terminal.pid, PtySize(rows=30, cols=100))
    sandbox.pty.send_stdin(terminal.pid, b"stty size; exit 3\n")
    with pytest.raises(CommandExitException) as caught:
        terminal.wait(on_pty=output.extend)
    assert caught.value.exit_code == 3 and b"30 100" in output


def test_pause_and_connect_keep_the_files_and_auto_resume_wakes_a_paused_sandbox(fake_e2b: E2BServer) -> None:
    sandbox = Sandbox.create(lifecycle={"on_timeout": "pause", "auto_resume": True})
    where = guest_dir(fake_e2b, sandbox)
    sandbox.files.write(f"{where}/kept.txt", "across the pause")
    assert sandbox.pause() is True
    assert sandbox.get_info().state.value == "paused"
    assert Sandbox.pause(sandbox.sandbox_id) is False  # already paused
    assert sandbox.sandbox_id in [item.sandbox_id for item in Sandbox.list().next_items()]
    resumed = Sandbox.connect(sandbox.sandbox_id)
    assert resumed.get_info().state.value == "running"
    where = guest_dir(fake_e2b, resumed)
    assert resumed.files.read(f"{where}/kept.txt") == "across the pause"
    resumed.pause()
    assert resumed.get_info().state.value == "paused"
    assert resumed.commands.list() == []  # an in-sandbox call resumes it
    assert resumed.get_info().state.value == "running"
    assert resumed.files.read(f"{guest_dir(fake_e2b, resumed)}/kept.txt") == "across the pause"


def test_a_paused_sandbox_without_auto_resume_is_not_running(fake_e2b: E2BServer) -> None:
    sandbox = Sandbox.create()
    sandbox.pause()
    with pytest.raises(TimeoutException, match="paused"):
        sandbox.files.read("/etc/hostname")
    assert not sandbox.is_running()


def test_timeouts_kill_or_pause_as_the_lifecycle_says(fake_e2b: E2BServer) -> None:
    killed = Sandbox.create(timeout=1)
    paused = Sandbox.create(timeout=1, lifecycle={"on_timeout": "pause"})
    extended = Sandbox.create(timeout=1)
    extended.set_timeout(60)
    time.sleep(3)
    with pytest.raises(SandboxNotFoundException):
        killed.get_info()
    assert paused.get_info().state.value == "paused"
    assert extended.get_info().state.value == "running"


def test_fork_copies_the_files_and_the_source_runs_on(fake_e2b: E2BServer) -> None:
    source = Sandbox.create(metadata={"k": "v"})
    where = guest_dir(fake_e2b, source)
    source.files.write(f"{where}/state", "before")
    end = source.get_info().end_at
    children = source.fork(count=2)
    assert len(children) == 2 and len({child.sandbox_id for child in children} | {source.sandbox_id}) == 3
    for number, child in enumerate(children):
        child_dir = guest_dir(fake_e2b, child)
        assert child.files.read(f"{child_dir}/state") == "before"
        child.files.write(f"{child_dir}/state", f"child {number}")
        assert child.get_info().metadata == {"k": "v"}
    assert source.files.read(f"{where}/state") == "before"
    assert source.get_info().end_at == end and source.is_running()
    with pytest.raises(e2b.InvalidArgumentException):
        source.fork(count=21)


def test_snapshots_are_made_listed_used_and_deleted(fake_e2b: E2BServer) -> None:
    source = Sandbox.create()
    source.files.write(f"{guest_dir(fake_e2b, source)}/in-snapshot", "yes")
    snapshot = source.create_snapshot(name="fake-snap")
    assert snapshot.snapshot_id == "fake-snap"
    assert [item.snapshot_id for item in Sandbox.list_snapshots(sandbox_id=source.sandbox_id).next_items()] == [
        "fake-snap"
    ]
    copy = Sandbox.create(snapshot.snapshot_id)
    assert copy.files.read(f"{guest_dir(fake_e2b, copy)}/in-snapshot") == "yes"
    assert copy.get_info().template_id == "fake-snap"
    assert Sandbox.delete_snapshot("fake-snap") is True
    assert Sandbox.delete_snapshot("fake-snap") is False
    assert copy.files.read(f"{guest_dir(fake_e2b, copy)}/in-snapshot") == "yes"  # still running from it


def test_list_filters_and_pages(fake_e2b: E2BServer) -> None:
    from e2b import SandboxQuery, SandboxState

    first = Sandbox.create(metadata={"group": "paging"})
    second = Sandbox.create(metadata={"group": "paging"})
    Sandbox.create(metadata={"group": "other"})
    second.pause()
    paginator = Sandbox.list(query=SandboxQuery(metadata={"group": "paging"}), limit=1)
    pages = []
    while paginator.has_next:
        pages.append([item.sandbox_id for item in paginator.next_items()])
    assert pages == [[first.sandbox_id], [second.sandbox_id]]
    running = Sandbox.list(query=SandboxQuery(metadata={"group": "paging"}, state=[SandboxState.RUNNING]))
    assert [item.sandbox_id for item in running.next_items()] == [first.sandbox_id]


def test_metrics_come_from_the_guest(fake_e2b: E2BServer) -> None:
    sandbox = Sandbox.create()
    metrics = sandbox.get_metrics()
    assert len(metrics) == 1 and metrics[0].mem_total > 0 and metrics[0].cpu_count == 1


# -- errors and limits --------------------------------------------------------------------------------


def test_a_wrong_or_missing_key_is_an_authentication_error(fake_e2b: E2BServer) -> None:
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="e2b_wrong_key_000000")
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key="e2b_wrong_key_000000").next_items()
    assert httpx.get(fake_e2b.url + "/v2/sandboxes").status_code == 401


def test_an_unknown_template_is_named_in_the_error(fake_e2b: E2BServer) -> None:
    with pytest.raises(SandboxException, match="unknown template 'no-such-template'") as caught:
        Sandbox.create("no-such-template")
    assert caught.value.status_code == 404


def test_unknown_sandboxes_are_not_found(fake_e2b: E2BServer) -> None:
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect("nosuchsandbox0000000")
    with pytest.raises(NotFoundException):
        Sandbox.set_timeout("nosuchsandbox0000000", 30)


def test_calls_not_served_are_named_never_a_500(fake_e2b: E2BServer) -> None:
    for method, path in (("POST", "/v3/templates"), ("GET", "/volumes"), ("POST", "/secrets"), ("GET", "/x")):
        answer = raw(fake_e2b, method, path, json={})
        assert answer.status_code == 501, (path, answer.text)
        assert path in answer.json()["message"] and "not served" in answer.json()["message"]
    with pytest.raises(SandboxException, match="volume mounts"):
        Sandbox.create(volume_mounts={"/data": "vol"})
    with pytest.raises(SandboxException, match="network rules"):
        Sandbox.create(network={"allow_out": ["8.8.8.8"]})
    offline = Sandbox.create(allow_internet_access=True)  # accepted (older SDKs always ask), and reported as given
    assert offline.get_info().allow_internet_access is False


def test_bodies_are_bounded(fake_e2b: E2BServer) -> None:
    answer = raw(fake_e2b, "POST", "/v2/sandboxes", content=b"{" + b" " * (128 * 1024) + b"}")
    assert answer.status_code == 413
    answer = raw(fake_e2b, "POST", "/v2/sandboxes", content=b"[1, 2]")
    assert answer.status_code == 400 and "JSON object" in answer.json()["message"]
    answer = raw(fake_e2b, "POST", "/v2/sandboxes", json={"templateID": 5})
    assert answer.status_code == 400 and "templateID" in answer.json()["message"]


def test_the_sandbox_limit_answers_429(fake_e2b: E2BServer) -> None:
    limit = fake_e2b.config.limits.max_sandboxes
    made = [Sandbox.create() for _ in range(limit - len(fake_e2b.sandbox_ids()))]
    with pytest.raises(RateLimitException):
        Sandbox.create(retries=0)
    made[0].kill()
    Sandbox.create(retries=0).kill()


def test_in_sandbox_calls_need_the_sandbox_token(fake_e2b: E2BServer) -> None:
    sandbox = Sandbox.create()
    path = f"{guest_dir(fake_e2b, sandbox)}/secret"
    sandbox.files.write(path, "s3cret")
    route = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "49983"}
    url = f"{fake_e2b.url}/files?path={urllib.parse.quote(path)}"
    assert httpx.get(url, headers=route).status_code == 401
    assert httpx.get(url, headers={**route, "X-Access-Token": "wrong"}).status_code == 401
    assert httpx.get(url, headers={**route, "X-API-Key": fake_e2b.api_key}).status_code == 401
    other = Sandbox.create()  # a token is its own sandbox's: another's opens nothing here
    assert httpx.get(url, headers={**route, "X-Access-Token": other._envd_access_token or ""}).status_code == 401
    answer = httpx.get(url, headers={**route, "X-Access-Token": sandbox._envd_access_token or ""})
    assert answer.status_code == 200 and answer.content == b"s3cret"
    # the code interpreter's port takes the traffic token; other ports are not open
    assert httpx.get(fake_e2b.url + "/contexts", headers={**route, "E2b-Sandbox-Port": "49999"}).status_code == 401
    closed = httpx.get(fake_e2b.url + "/", headers={**route, "E2b-Sandbox-Port": "8080"})
    assert closed.status_code == 502 and "port 8080 is not open" in closed.json()["message"]


def test_signed_urls_download_and_upload_without_headers(fake_e2b: E2BServer) -> None:
    sandbox = Sandbox.create()
    path = f"{guest_dir(fake_e2b, sandbox)}/signed.txt"
    upload = sandbox.upload_url(path, use_signature_expiration=60)
    assert httpx.post(upload, files={"file": ("ignored", b"via url")}).status_code == 200
    download = sandbox.download_url(path)
    assert httpx.get(download).content == b"via url"
    tampered = download.replace("signature=v1_", "signature=v1_x")
    assert httpx.get(tampered).status_code == 401
    signed_for_another = sandbox.download_url("/etc/hostname")
    quoted = urllib.parse.quote("/etc/hostname", safe=""), urllib.parse.quote(path, safe="")
    assert httpx.get(signed_for_another.replace(*quoted)).status_code == 401  # a signature is for its own path


def test_a_gzip_bomb_upload_is_stopped_at_the_limit(fake_e2b: E2BServer) -> None:
    sandbox = Sandbox.create()
    path = f"{guest_dir(fake_e2b, sandbox)}/bomb"
    bomb = gzip.compress(b"\0" * (fake_e2b.config.limits.max_upload + (1 << 20)))
    answer = httpx.post(
        fake_e2b.url + "/files",
        params={"path": path},
        content=bomb,
        headers={
            "Content-Type": "application/octet-stream",
            "Content-Encoding": "gzip",
            "E2b-Sandbox-Id": sandbox.sandbox_id,
            "E2b-Sandbox-Port": "49983",
            "X-Access-Token": sandbox._envd_access_token or "",
        },
        timeout=60,
    )
    assert answer.status_code == 413
    assert not sandbox.files.exists(path)


def test_the_api_answers_json_errors_the_sdk_maps(fake_e2b: E2BServer) -> None:
    answer = raw(fake_e2b, "DELETE", "/sandboxes/nosuchsandbox0000000")
    assert answer.status_code == 404 and answer.json() == {
        "code": 404,
        "message": "sandbox nosuchsandbox0000000 not found",
    }
    answer = raw(fake_e2b, "GET", "/v2/sandboxes", params={"state": "sleeping"})
    assert answer.status_code == 400
    answer = raw(fake_e2b, "GET", "/v2/sandboxes", params={"nextToken": base64.b64encode(b"nobody").decode()})
    assert answer.status_code == 200 and answer.json() == []


def test_the_code_interpreter_routes_reach_the_sandbox_interpreter(fake_e2b: E2BServer) -> None:
    """The routes only translate: a stand-in interpreter shows what they send and what the client parses."""
    from e2b_code_interpreter import Sandbox as CodeSandbox

    calls: list[tuple[str, Any]] = []

    class StandIn:
        def __init__(self, vm: Any) -> None:
            calls.append(("made", vm.name))

        async def create_context(self, *, language: str | None = None, cwd: str | None = None) -> dict[str, Any]:
            return {"id": "ctx1", "language": language or "python", "cwd": cwd or "/home/user"}

        async def list_contexts(self) -> list[dict[str, Any]]:
            return [{"id": "ctx1", "language": "python", "cwd": "/home/user"}]

        async def restart_context(self, context_id: str) -> None:
            calls.append(("restart", context_id))

        async def remove_context(self, context_id: str) -> None:
            from pytest_forkd.e2b.interpreter import UnknownContext

            raise UnknownContext(f"context {context_id!r} not found")

        async def execute(self, code: str, **options: Any) -> Any:
            calls.append(("execute", (code, options)))
            yield {"type": "stdout", "text": "hi\n", "timestamp": 0}
            yield {"type": "error", "name": "ZeroDivisionError", "value": "division by zero", "traceback": "tb"}
            yield {"type": "end_of_execution"}

        async def close(self) -> None:
            calls.append(("close", None))

    fake_e2b.registry.interpreter_factory = StandIn
    try:
        sandbox = CodeSandbox.create()
        execution = sandbox.run_code("1/0", envs={"A": "b"})
        assert execution.logs.stdout == ["hi\n"] and execution.error is not None
        assert execution.error.name == "ZeroDivisionError"
        context = sandbox.create_code_context(cwd="/tmp")
        assert (context.id, context.cwd) == ("ctx1", "/tmp")
        assert [item.id for item in sandbox.list_code_contexts()] == ["ctx1"]
        sandbox.restart_code_context("ctx1")
        with pytest.raises(NotFoundException):
            sandbox.remove_code_context("ctx9")
        sandbox.kill()
    finally:
        fake_e2b.registry.interpreter_factory = None
    assert ("execute", ("1/0", {"context_id": None, "language": None, "env_vars": {"A": "b"}})) in calls
    assert ("restart", "ctx1") in calls and calls[-1] == ("close", None)


def test_the_async_sdk_runs_sandboxes_at_once(fake_e2b: E2BServer) -> None:
    async def run() -> list[str]:
        sandboxes = await asyncio.gather(*(AsyncSandbox.create() for _ in range(3)))
        results = await asyncio.gather(*(s.commands.run(f"echo {n}") for n, s in enumerate(sandboxes)))
        await asyncio.gather(*(s.kill() for s in sandboxes))
        return [result.stdout for result in results]

    assert asyncio.run(run()) == ["0\n", "1\n", "2\n"]


def test_request_json_shapes_are_the_sdks(fake_e2b: E2BServer) -> None:
    answer = raw(fake_e2b, "POST", "/v2/sandboxes", json={"templateID": "base", "timeout": 30})
    assert answer.status_code == 201
    created = answer.json()
    assert {"templateID", "sandboxID", "clientID", "envdVersion", "envdAccessToken", "trafficAccessToken"} <= set(
        created
    )
    detail = raw(fake_e2b, "GET", f"/sandboxes/{created['sandboxID']}").json()
    assert detail["lifecycle"] == {"onTimeout": "kill", "autoResume": False}
    assert json.loads(json.dumps(detail))["state"] == "running"
    assert raw(fake_e2b, "DELETE", f"/sandboxes/{created['sandboxID']}").status_code == 204


def test_a_client_that_goes_away_ends_its_stream_and_the_process_runs_on(fake_e2b: E2BServer) -> None:
    sandbox = Sandbox.create()
    handle = sandbox.commands.run("sleep 60", background=True, cwd=guest_dir(fake_e2b, sandbox))
    for _ in range(100):
        if fake_e2b.app.streams:
            break
        time.sleep(0.05)
    assert fake_e2b.app.streams == 1, "the Start stream is being served"
    handle.disconnect()
    for _ in range(100):  # noticed at once, not at the next output or keepalive
        if not fake_e2b.app.streams:
            break
        time.sleep(0.05)
    assert fake_e2b.app.streams == 0
    assert handle.pid in [process.pid for process in sandbox.commands.list()], "as with E2B, the process runs on"
    assert sandbox.commands.kill(handle.pid)


def test_template_mappings_are_made_ready_before_clients_come(fake_session: Any) -> None:
    """As ``forkd e2b serve`` starts: a mapping that cannot be made ready is reported then, naming it."""
    from pytest_forkd.e2b.config import ServerConfig
    from pytest_forkd.errors import VMError

    mapping = {"unreachable": "docker://127.0.0.1:1/forkd-tests/none:1"}  # nothing listens on port 1
    with E2BServer(fake_session, ServerConfig(templates=mapping), prepare_guest=False) as server:
        with pytest.raises(VMError, match="template 'unreachable' .*127.0.0.1:1"):
            server.warm_templates()
        assert server.sandbox_ids() == []


def test_the_sdks_debug_mode_reaches_the_debug_ports(fake_session: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_forkd.e2b.config import ServerConfig
    from pytest_forkd.errors import ConfigError

    try:
        server = E2BServer(fake_session, ServerConfig(debug_ports=True), prepare_guest=False).start()
    except ConfigError as exc:
        pytest.skip(f"the SDK's debug ports are in use here: {exc}")
    try:
        for name in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_DOMAIN"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("E2B_DEBUG", "true")
        monkeypatch.setenv("E2B_API_KEY", server.api_key)
        sandbox = Sandbox.create()  # debug mode: no API call, envd on localhost:49983
        assert sandbox.sandbox_id == "debug_sandbox_id"
        assert sandbox.commands.run("echo from debug mode").stdout == "from debug mode\n"
        where = server.vm("debug_sandbox_id").exec("pwd").stdout.strip()
        sandbox.files.write(f"{where}/debug.txt", "d")
        assert sandbox.files.read(f"{where}/debug.txt") == "d"
        assert [item.sandbox_id for item in Sandbox.list().next_items()] == ["debug_sandbox_id"]  # port 3000
    finally:
        server.stop()
