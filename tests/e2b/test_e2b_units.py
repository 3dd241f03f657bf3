"""The E2B server's parts that need neither a VM nor a server: options, tokens, signatures, errors, the room's imports.

Also the guest's filesystem helper, run here as the guest runs it (``python3 -u``, requests on stdin) in a
temporary directory.
"""

from __future__ import annotations

import ast
import base64
import errno
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_forkd.e2b import config
from pytest_forkd.e2b.auth import new_id, signature_of, signature_valid
from pytest_forkd.errors import AgentError, ConfigError, NoSuchProcess, VMError
from pytest_forkd.guest import e2b_files_program

ROOM = Path(__file__).resolve().parents[2] / "pytest_forkd" / "e2b"


def test_server_options_are_checked() -> None:
    assert config.ServerConfig().host == "127.0.0.1"
    assert config.ServerConfig(host="::").url_host == "[::1]"
    with pytest.raises(ConfigError, match="--host"):
        config.ServerConfig(host="example.com")
    with pytest.raises(ConfigError, match="--port"):
        config.ServerConfig(port=70000)
    with pytest.raises(ConfigError, match="--api-key"):
        config.ServerConfig(api_key="short")
    with pytest.raises(ConfigError, match="--timeout"):
        config.ServerConfig(default_timeout_s=0)
    assert config.ServerConfig().api_key != config.ServerConfig().api_key  # a random key unless given


def test_template_options_are_name_equals_reference() -> None:
    assert config.parse_template_options(["py=docker://python:3.12-slim", "tools=tools"]) == {
        "py": "docker://python:3.12-slim",
        "tools": "tools",
    }
    for bad in (["noequals"], ["=ref"], ["a b=ref"], ["x=1", "x=2"]):
        with pytest.raises(ConfigError, match="--template"):
            config.parse_template_options(bad)


def test_ids_look_like_e2b_ids_and_differ() -> None:
    ids = {new_id() for _ in range(100)}
    assert len(ids) == 100 and all(len(item) == 20 and item.isalnum() and item.islower() for item in ids)


def test_file_url_signatures_are_the_sdks() -> None:
    from e2b.sandbox.signature import get_signature

    made = get_signature("/home/user/a.txt", "read", None, "token", 60)
    assert signature_of("/home/user/a.txt", "read", None, "token", made["expiration"]) == made["signature"]
    assert signature_valid(made["signature"], "/home/user/a.txt", "read", None, "token", str(made["expiration"]))
    assert not signature_valid(made["signature"], "/home/user/a.txt", "write", None, "token", str(made["expiration"]))
    assert not signature_valid(made["signature"], "/etc/passwd", "read", None, "token", str(made["expiration"]))
    expired = get_signature("/a", "read", "root", "token", -10)
    assert not signature_valid(expired["signature"], "/a", "read", "root", "token", str(expired["expiration"]))


def test_the_user_of_a_call_is_basic_auth_with_an_empty_password() -> None:
    from pytest_forkd.e2b.api_errors import ApiError
    from pytest_forkd.e2b.auth import user_of

    assert user_of({}) is None
    assert user_of({"authorization": "Basic " + base64.b64encode(b"root:").decode()}) == "root"
    for bad in ("Bearer x", "Basic !!!", "Basic " + base64.b64encode(b"a/b:").decode()):
        with pytest.raises(ApiError):
            user_of({"authorization": bad})


def test_forkd_errors_become_the_statuses_the_sdks_map() -> None:
    from pytest_forkd.e2b.api_errors import as_api_error

    class GuestFailure(VMError):
        def __init__(self, number: int) -> None:
            super().__init__("guest said no")
            self.errno = number

    assert as_api_error(GuestFailure(errno.ENOENT), "reading").status == 404
    assert as_api_error(GuestFailure(errno.ENOSPC), "writing").status == 507
    assert as_api_error(NoSuchProcess("gone"), "signalling").status == 404
    assert as_api_error(VMError("died"), "running", "sbx1").status == 502
    assert "was not found" in as_api_error(VMError("died"), "running", "sbx1").message
    refused = as_api_error(AgentError("spawn in the guest failed: bad request"), "starting", "sbx1")
    assert refused.status == 400, "the agent answered: the sandbox runs, it is no SandboxNotRunningException"
    unexpected = as_api_error(KeyError("x"), "listing")
    assert unexpected.status == 500 and "KeyError" in unexpected.message


def test_an_end_event_is_envds() -> None:
    from pytest_forkd.e2b.processes import ProcessEnd

    assert ProcessEnd.of(0) == ProcessEnd(0, True, "exit status 0")
    assert ProcessEnd.of(3) == ProcessEnd(3, True, "exit status 3")
    assert ProcessEnd.of(-9) == ProcessEnd(-1, False, "signal: killed")


#: The exceptions: the guest programs the room runs in a VM (the code interpreter's, the filesystem helper) live
#: beside the agent, and the room reads their paths from there.
READS_GUEST_PROGRAM = {("interpreter_channel.py", "pytest_forkd.guest"), ("guest_helper.py", "pytest_forkd.guest")}


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node but those under ``if TYPE_CHECKING:`` (imports for the type checker never run)."""
    found: list[ast.AST] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        found.append(node)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return found


def test_the_room_uses_the_vm_api_only() -> None:
    """pytest_forkd.e2b imports core, aio, project and the foundation; never engine, storage, guest or image."""
    forbidden = ("engine", "storage", "guest", "image")
    found = []
    for path in sorted(ROOM.glob("*.py")):
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == "pytest_forkd" and len(parts) > 1 and parts[1] in forbidden:
                    if (path.name, name) not in READS_GUEST_PROGRAM:
                        found.append(f"{path.name}: {name}")
    assert found == []


def helper(tmp_path: Path, *requests: dict[str, object]) -> list[dict[str, object]]:
    """Run the guest's filesystem helper as the guest does, with ``requests``; its answers, in order."""
    lines = "".join(json.dumps(request) + "\n" for request in requests)
    done = subprocess.run(
        [sys.executable, "-u", str(e2b_files_program())],
        input=lines,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    answers = [json.loads(line) for line in done.stdout.splitlines()]
    assert answers[0]["ready"] is True
    return answers[1:]


def test_the_guest_helper_answers_envds_filesystem_calls(tmp_path: Path) -> None:
    base = str(tmp_path)
    (tmp_path / "file.txt").write_text("hello")
    (tmp_path / "link").symlink_to(tmp_path / "file.txt")
    answers = helper(
        tmp_path,
        {"id": 1, "op": "stat", "path": f"{base}/file.txt"},
        {"id": 2, "op": "mkdir", "path": f"{base}/a/b"},
        {"id": 3, "op": "mkdir", "path": f"{base}/a/b"},
        {"id": 4, "op": "list", "path": base, "depth": 2},
        {"id": 5, "op": "move", "source": f"{base}/file.txt", "destination": f"{base}/c/moved.txt"},
        {"id": 6, "op": "remove", "path": f"{base}/nope"},
        {"id": 7, "op": "stat", "path": f"{base}/link"},
        {"id": 8, "op": "list", "path": f"{base}/c/moved.txt"},
        {"id": 9, "op": "nonsense"},
        "not a request",  # type: ignore[arg-type]
        {"id": 10, "op": "stat", "path": "relative", "user": "no-such-user-xyz"},
        {"id": 11, "op": "stat", "path": f"{base}/a", "user": "no-such-user-xyz"},
    )
    by_id = {answer["id"]: answer for answer in answers}
    assert by_id[1]["result"]["entry"]["size"] == 5 and by_id[1]["result"]["entry"]["type"] == "file"  # type: ignore[index]
    assert by_id[1]["result"]["entry"]["permissions"].startswith("-rw")  # type: ignore[index]
    assert by_id[2]["result"]["entry"]["type"] == "dir"  # type: ignore[index]
    assert by_id[3]["error"]["code"] == "exists"  # type: ignore[index]
    names = [entry["name"] for entry in by_id[4]["result"]["entries"]]  # type: ignore[index]
    assert sorted(names) == ["a", "b", "file.txt", "link"]
    assert by_id[5]["result"]["entry"]["path"] == f"{base}/c/moved.txt"  # type: ignore[index]
    assert by_id[6]["error"]["code"] == "not_found"  # type: ignore[index]
    link = by_id[7]["result"]["entry"]  # type: ignore[index]
    assert link["is_symlink"] is True and link["type"] == "symlink"  # its target moved away: a dangling link
    assert by_id[8]["error"]["code"] == "invalid"  # type: ignore[index]
    assert by_id[9]["error"]["code"] == "invalid"  # type: ignore[index]
    assert by_id[10]["error"]["code"] == "unknown_user"  # type: ignore[index]
    assert by_id[11]["error"]["code"] == "unknown_user"  # type: ignore[index]  # even for an absolute path
    assert len(answers) == 11  # the line that was not a request got no answer
