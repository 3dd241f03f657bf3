"""The Inspect sandbox ``forkd`` without VMs: registration, configs, Inspect's limits and errors, shared sessions.

Tests that start a fresh interpreter or Inspect's CLI are marked ``slow``.

Start-up errors (a broken forkd.yaml, an unknown snapshot) are checked
through a real ``inspect_ai.eval``: forkd refuses them before anything boots.
The sandbox's work in VMs is in tests/integration/test_inspect_*.py.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_forkd.errors import AgentError, ConfigError, InvalidArgument
from pytest_forkd.guest.client import GuestOSError
from pytest_forkd.guest.exec_result import ExecResult
from pytest_forkd.integrations.sessions import SESSIONS, SharedSessions

if TYPE_CHECKING:  # bound by inspect_imported below
    from inspect_ai import Task
    from inspect_ai import eval as inspect_eval
    from inspect_ai._util.error import PrerequisiteError
    from inspect_ai.dataset import Sample
    from inspect_ai.util import OutputLimitExceededError, SandboxUserUnsupportedError
    from inspect_ai.util._sandbox.limits import override_max_exec_output_size
    from pydantic import BaseModel

    from pytest_forkd.integrations import inspect_support as support
    from pytest_forkd.integrations.inspect_sandbox import ForkdSandboxEnvironment


@pytest.fixture(autouse=True, scope="module")
def inspect_imported() -> None:
    """Inspect and forkd's sandbox for it, imported when this module's first test runs, not at collection.

    Importing Inspect takes a second: a run that selects none of these tests
    (``-k``, another file) does not pay it. The names become the module's, as
    imports at its top would make them.
    """
    global Task, inspect_eval, PrerequisiteError, Sample, OutputLimitExceededError, SandboxUserUnsupportedError
    global override_max_exec_output_size, BaseModel, support, ForkdSandboxEnvironment
    pytest.importorskip("inspect_ai", reason="needs inspect-ai: pip install 'pytest-forkd[inspect]'")
    from inspect_ai import Task
    from inspect_ai import eval as inspect_eval
    from inspect_ai._util.error import PrerequisiteError
    from inspect_ai.dataset import Sample
    from inspect_ai.util import OutputLimitExceededError, SandboxUserUnsupportedError
    from inspect_ai.util._sandbox.limits import override_max_exec_output_size
    from pydantic import BaseModel

    from pytest_forkd.integrations import inspect_support as support
    from pytest_forkd.integrations.inspect_sandbox import ForkdSandboxEnvironment


REPO = Path(__file__).resolve().parents[2]


def result(exit_code: int = 0, stdout: bytes = b"", stderr: bytes = b"", **fields: Any) -> ExecResult:
    return ExecResult(
        command=("cmd",), exit_code=exit_code, stdout_bytes=stdout, stderr_bytes=stderr, duration_ms=1.0, **fields
    )


# -- registration and import cost ----------------------------------------------------------------------------


def fresh_python(code: str, **env: str) -> str:
    completed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}, timeout=120
    )
    assert completed.returncode == 0, completed.stderr
    return completed.stdout


@pytest.mark.slow  # a fresh interpreter (or Inspect's CLI) in a subprocess
def test_inspect_finds_the_forkd_sandbox_through_its_entry_point_without_an_import() -> None:
    output = fresh_python(
        "import sys\n"
        "from inspect_ai.util._sandbox.registry import registry_find_sandboxenv\n"
        "assert 'pytest_forkd.integrations.inspect_sandbox' not in sys.modules\n"
        "print(registry_find_sandboxenv('forkd').__qualname__)\n"
    )
    assert output.strip() == "ForkdSandboxEnvironment"


@pytest.mark.slow  # a fresh interpreter (or Inspect's CLI) in a subprocess
def test_import_pytest_forkd_and_pytest_start_up_do_not_import_inspect(tmp_path: Path) -> None:
    (tmp_path / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
    output = fresh_python(
        "import sys, pytest_forkd\n"
        "assert 'inspect_ai' not in sys.modules, 'import pytest_forkd'\n"
        f"code = pytest.main(['-q', '-p', 'no:cacheprovider', {str(tmp_path)!r}]) if (pytest := __import__('pytest')) "
        "else 1\n"
        "print('inspect_ai' in sys.modules, int(code))\n"
    )
    assert output.strip().splitlines()[-1] == "False 0"


# -- configs --------------------------------------------------------------------------------------------------


def test_configs_as_inspect_passes_them() -> None:
    assert support.parse_config(None) == support.ForkdSandboxConfig()
    assert support.parse_config("forkd.yaml") == support.ForkdSandboxConfig(config="forkd.yaml")
    model = support.ForkdSandboxConfig(config="x/forkd.yaml", snapshot="tools")
    assert support.parse_config(model) is model
    assert ForkdSandboxEnvironment.config_deserialize(model.model_dump()) == model
    # forkd.yaml first, then Docker's files: Inspect then carries a task's compose.yaml or Dockerfile over to forkd.
    assert ForkdSandboxEnvironment.config_files() == [
        "forkd.yaml",
        "compose.yaml",
        "compose.yml",
        "docker-compose.yaml",
        "docker-compose.yml",
        "Dockerfile",
    ]
    assert ForkdSandboxEnvironment.is_docker_compatible()
    assert support.config_path(model, Path("/tasks")) == Path("/tasks/x/forkd.yaml")
    assert support.config_path(support.ForkdSandboxConfig(config="/abs/forkd.yaml"), Path("/t")) == Path(
        "/abs/forkd.yaml"
    )


@pytest.mark.parametrize(
    ("config", "says"),
    [("  ", "empty string"), (42, "got int")],
)
def test_a_config_forkd_cannot_read_is_refused_in_one_line(config: object, says: str) -> None:
    with pytest.raises(support.ForkdSandboxError, match=says) as caught:
        support.parse_config(config)
    assert "\n" not in str(caught.value)


def test_a_config_with_unknown_fields_is_refused_when_read_back() -> None:
    with pytest.raises(support.ForkdSandboxError) as caught:
        ForkdSandboxEnvironment.config_deserialize({"snapshot": "base", "image": "ubuntu"})
    assert str(caught.value) == "forkd sandbox: config.image: unknown key; valid keys: config, snapshot"


def test_every_mistake_of_a_config_is_named_with_the_field_meant() -> None:
    class Misspelt(BaseModel):
        snapshto: str = "tools"
        confg: str = "forkd.yaml"

    with pytest.raises(support.ForkdSandboxError) as caught:
        support.parse_config(Misspelt())
    assert str(caught.value).splitlines() == [
        "forkd sandbox: config.snapshto: unknown key; did you mean 'snapshot'? valid keys: config, snapshot",
        "forkd sandbox: config.confg: unknown key; did you mean 'config'? valid keys: config, snapshot",
    ]


def test_a_config_built_with_mistakes_names_each_field() -> None:
    with pytest.raises(ValueError) as caught:  # pydantic's ValidationError, as before, with forkd's lines in it
        support.ForkdSandboxConfig(snapshto="tools", config=3)  # type: ignore[call-arg, arg-type]
    message = str(caught.value)
    assert "forkd sandbox: config.config: input should be a valid string, got 3" in message
    assert "forkd sandbox: config.snapshto: unknown key; did you mean 'snapshot'?" in message


def test_a_forkd_yaml_with_several_mistakes_is_one_startup_error_a_line_each() -> None:
    error = support.startup_error(ConfigError("forkd.yaml: snapshot: unknown key\nforkd.yaml: budgets.fork.p95: bad"))
    assert str(error).splitlines() == [
        "forkd sandbox: forkd.yaml: snapshot: unknown key",
        "forkd sandbox: forkd.yaml: budgets.fork.p95: bad",
    ]


def test_a_startup_error_is_forkds_config_error_and_inspects_prerequisite_error() -> None:
    error = support.startup_error(ConfigError("unknown snapshot 'nope': declare it"))
    assert isinstance(error, ConfigError) and isinstance(error, PrerequisiteError)
    assert error.message == str(error) == "forkd sandbox: unknown snapshot 'nope': declare it"


def empty_task(sandbox: Any) -> Task:
    return Task(dataset=[Sample(input="[]", id="one")], sandbox=sandbox)


def run_offline(task: Task, tmp_path: Path) -> Any:
    return inspect_eval(task, model="mockllm/model", log_dir=str(tmp_path / "logs"), display="none")


def test_an_unknown_snapshot_fails_the_eval_with_one_line_before_anything_boots(tmp_path: Path) -> None:
    spec = ("forkd", support.ForkdSandboxConfig(snapshot="no-such-snapshot"))
    with pytest.raises(support.ForkdSandboxError) as caught:
        run_offline(empty_task(spec), tmp_path)
    message = str(caught.value)
    assert message.startswith("forkd sandbox: unknown snapshot 'no-such-snapshot'")
    assert "\n" not in message
    assert isinstance(caught.value.__cause__, ConfigError)
    assert SESSIONS.keys() == []  # nothing kept open for the failed start


def test_a_broken_forkd_yaml_fails_the_eval_naming_the_field(tmp_path: Path) -> None:
    config = tmp_path / "forkd.yaml"
    config.write_text("snapshots:\n  tools:\n    from: base\n    setup: 42\n")
    with pytest.raises(support.ForkdSandboxError) as caught:
        run_offline(empty_task(("forkd", str(config))), tmp_path)
    assert "snapshots.tools.setup" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_forkd_yaml_next_to_the_task_is_found_without_a_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found through config_files(): its settings select a snapshot it does not declare, which fails
    # before anything boots, naming the file.
    (tmp_path / "forkd.yaml").write_text("settings:\n  snapshot: declared-nowhere\n")
    (tmp_path / "task.py").write_text(
        "from inspect_ai import Task, task\n"
        "from inspect_ai.dataset import Sample\n"
        "@task\n"
        "def discovered():\n"
        "    return Task(dataset=[Sample(input='[]')], sandbox='forkd')\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTEST_FORKD_SNAPSHOT", raising=False)
    with pytest.raises(support.ForkdSandboxError, match="unknown snapshot 'declared-nowhere'") as caught:
        inspect_eval("task.py", model="mockllm/model", log_dir=str(tmp_path / "logs"), display="none")
    assert "forkd.yaml" in str(caught.value)


def test_a_missing_forkd_yaml_fails_the_eval_naming_it(tmp_path: Path) -> None:
    with pytest.raises(support.ForkdSandboxError, match="no such forkd.yaml"):
        run_offline(empty_task(("forkd", str(tmp_path / "absent.yaml"))), tmp_path)


@pytest.mark.slow  # a fresh interpreter (or Inspect's CLI) in a subprocess
def test_the_cli_prints_a_startup_error_without_a_traceback(tmp_path: Path) -> None:
    task_file = tmp_path / "task.py"
    task_file.write_text(
        "from inspect_ai import Task, task\n"
        "from inspect_ai.dataset import Sample\n"
        "@task\n"
        "def broken():\n"
        "    return Task(dataset=[Sample(input='[]')], sandbox=('forkd', 'missing.yaml'))\n"
    )
    completed = subprocess.run(
        [str(Path(sys.executable).parent / "inspect"), "eval", task_file.name, "--model", "mockllm/model",
         "--log-dir", str(tmp_path / "logs"), "--display", "plain"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        env={**os.environ, "COLUMNS": "1000"},  # one line per message, however long the path
    )  # fmt: skip
    output = completed.stdout + completed.stderr
    assert completed.returncode != 0
    words = " ".join(output.split())
    assert "forkd sandbox: " in words and "missing.yaml: no such forkd.yaml" in words, output
    assert "Traceback" not in output


def test_an_event_loop_other_than_asyncio_is_refused_at_task_init() -> None:
    # Driven by hand, as trio would: no asyncio loop is running.
    coroutine = ForkdSandboxEnvironment.task_init("startup", None)
    with pytest.raises(support.ForkdSandboxError, match="needs Inspect's asyncio backend"):
        coroutine.send(None)


# -- exec results, limits and errors ---------------------------------------------------------------------------


def test_a_result_within_the_limit_is_inspects_result() -> None:
    mapped = support.exec_result(result(3, b"out", b"err"), 100)
    assert (mapped.success, mapped.returncode, mapped.stdout, mapped.stderr) == (False, 3, "out", "err")
    assert support.exec_result(result(-15), 100).returncode == 143  # killed by SIGTERM, as a shell shows it


def test_output_past_inspects_limit_raises_output_limit_exceeded_with_what_was_kept() -> None:
    with override_max_exec_output_size(1024):
        with pytest.raises(OutputLimitExceededError) as caught:
            support.exec_result(result(0, b"a" * 512 + b"z" * 512, truncated=True), 1024)
    assert caught.value.limit_str == "1 KiB"
    assert "limit of 1 KiB was exceeded" in str(caught.value)
    assert caught.value.truncated_output is not None and caught.value.truncated_output.endswith("z" * 512)


def test_a_timeout_is_a_timeout_error_with_the_partial_output() -> None:
    error = support.timeout_error(2, result(-9, b"partial", timed_out=True))
    assert isinstance(error, TimeoutError)
    assert str(error) == "Command timed out after 2 seconds"
    assert error.truncated_output == "partial"  # type: ignore[attr-defined]


def test_a_non_executable_program_is_a_permission_error_but_a_missing_one_is_a_result() -> None:
    denied = result(126, stderr=b"forkd-exec: exec: /etc/hosts: Permission denied\n")
    error = support.launch_error(["/etc/hosts"], denied)
    assert isinstance(error, PermissionError) and error.filename == "/etc/hosts"
    missing = result(127, stderr=b"forkd-exec: exec: nope: not found\n")
    assert support.launch_error(["nope"], missing) is None
    # The command's own 126 (a script it ran) is its result, not a launch failure.
    assert support.launch_error(["sh"], result(126, stderr=b"sh: ./x: Permission denied\n")) is None


def test_users_are_the_guest_agents_and_an_unknown_one_is_unsupported() -> None:
    assert support.is_root(None) and support.is_root("root") and support.is_root("0")
    assert (
        support.guest_user("root") == "0"
        and support.guest_user("agent") == "agent"
        and support.guest_user(None) is None
    )
    unknown = support.user_error(
        "bob", AgentError("exec in the guest failed: unable to find user bob: no matching entries in /etc/passwd")
    )
    assert isinstance(unknown, SandboxUserUnsupportedError) and "'bob'" in str(unknown)
    malformed = support.user_error("a b", InvalidArgument("user must be 'NAME', 'UID', ... got 'a b'"))
    assert isinstance(malformed, SandboxUserUnsupportedError)
    assert support.user_error("bob", AgentError("exec in the guest failed: the agent is busy")) is None


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (errno.ENOENT, FileNotFoundError),
        (errno.EACCES, PermissionError),
        (errno.EPERM, PermissionError),
        (errno.EISDIR, IsADirectoryError),
        (errno.ENOTDIR, NotADirectoryError),
    ],
)
def test_guest_os_errors_become_the_host_exceptions_inspect_documents(code: int, expected: type) -> None:
    error = support.os_error(GuestOSError("read_file in the guest failed", code, os.strerror(code), "/r/x"), "x")
    assert type(error) is expected
    assert error.filename == "x" and error.errno == code


def test_relative_paths_resolve_against_the_working_directory() -> None:
    assert support.guest_path("a/b.txt", "/srv/app") == "/srv/app/a/b.txt"
    assert support.guest_path("../up", "/srv/app") == "/srv/up"
    assert support.guest_path("/etc/hosts", "/srv/app") == "/etc/hosts"


def test_text_keeps_its_newlines_and_bad_utf8_is_a_decode_error() -> None:
    assert support.decode_text(b"a\r\nb") == "a\r\nb"
    with pytest.raises(UnicodeDecodeError):
        support.decode_text(b"\xc3\x28")


def test_default_concurrency_is_bounded_by_the_cores() -> None:
    cores = len(os.sched_getaffinity(0))
    concurrency = ForkdSandboxEnvironment.default_concurrency()
    assert concurrency is not None and 1 <= concurrency <= 4 * cores


# -- shared sessions ---------------------------------------------------------------------------------------------


class FakeSession:
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_concurrent_users_open_one_session_and_the_last_release_closes_it() -> None:
    sessions = SharedSessions()
    opened: list[FakeSession] = []

    def opener() -> Any:
        time.sleep(0.05)
        opened.append(FakeSession())
        return opened[-1]

    got: list[Any] = []
    threads = [threading.Thread(target=lambda: got.append(sessions.acquire("k", opener))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(opened) == 1 and all(session is opened[0] for session in got)
    assert sessions.users("k") == 4
    for _ in range(3):
        sessions.release("k")
    assert opened[0].closed == 0 and sessions.get("k") is opened[0]
    sessions.release("k")
    assert opened[0].closed == 1 and sessions.get("k") is None and sessions.keys() == []


def test_a_failed_open_keeps_nothing_and_the_next_user_tries_again() -> None:
    sessions = SharedSessions()

    def failing() -> Any:
        raise ConfigError("broken")

    with pytest.raises(ConfigError):
        sessions.acquire("k", failing)
    assert sessions.keys() == []
    fresh = FakeSession()
    assert sessions.acquire("k", lambda: fresh) is fresh  # type: ignore[arg-type,return-value]


def test_a_lent_session_is_never_closed_here() -> None:
    sessions = SharedSessions()
    lent = FakeSession()
    sessions.lend("lent", lent)  # type: ignore[arg-type]
    assert sessions.acquire("lent", lambda: pytest.fail("a lent session is not opened")) is lent  # type: ignore[comparison-overlap]
    sessions.release("lent")
    sessions.release("lent")
    sessions.close_all()
    assert lent.closed == 0 and sessions.keys() == []


# -- cli_cleanup -------------------------------------------------------------------------------------------------


@pytest.mark.slow  # a fresh interpreter (or Inspect's CLI) in a subprocess
def test_inspect_sandbox_cleanup_removes_a_dead_evals_run_directory_and_keeps_live_ones(tmp_path: Path) -> None:
    root = Path(f"/dev/shm/forkd-inspect-cleanup-{os.getpid()}")
    root.mkdir(mode=0o700)
    try:
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        stale = root / f"run-{dead.stdout.strip()}-aaaaaa"
        stale.mkdir(mode=0o700)
        (stale / "owner.json").write_text(json.dumps({"pid": int(dead.stdout), "start_time": 1}))
        (stale / "vm1.ram").write_bytes(b"\0" * 4096)
        live = root / f"run-{os.getpid()}-bbbbbb"
        live.mkdir(mode=0o700)
        from pytest_forkd import processes

        (live / "owner.json").write_text(
            json.dumps({"pid": os.getpid(), "start_time": processes.start_time(os.getpid())})
        )
        completed = subprocess.run(
            [str(Path(sys.executable).parent / "inspect"), "sandbox", "cleanup", "forkd"],
            capture_output=True,
            text=True,
            env={**os.environ, "FORKD_SHM_DIR": str(root)},
            timeout=120,
        )
        assert completed.returncode == 0, completed.stderr
        assert "removed 1 stale run directory" in completed.stdout
        assert not stale.exists() and live.is_dir()
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
