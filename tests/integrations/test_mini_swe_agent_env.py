"""The mini-swe-agent environment without QEMU: Docker's result dicts, the submission sentinel, warm parents.

The environment's VMs come from forkd's fake engine (the real guest agent as a
host process, see docs/guides/testing-without-qemu.md) through a stand-in for
the image's session, so every command here really runs through the agent;
the same environment against real VMs of a registry image is in
tests/integrations/test_mini_swe_agent_vm.py.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Hashable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("minisweagent", reason='needs mini-swe-agent: pip install "pytest-forkd[mini-swe-agent]"')

from minisweagent.environments import get_environment  # noqa: E402
from minisweagent.exceptions import Submitted  # noqa: E402
from support import is_running  # noqa: E402

from pytest_forkd.core.factory import VMFactory  # noqa: E402
from pytest_forkd.core.vm import VM  # noqa: E402
from pytest_forkd.engine.fake import guest_path  # noqa: E402
from pytest_forkd.errors import ConfigError  # noqa: E402
from pytest_forkd.integrations import mini_swe_agent  # noqa: E402
from pytest_forkd.integrations.mini_swe_agent import ForkdEnvironment  # noqa: E402
from pytest_forkd.integrations.sessions import (
    SESSIONS,  # noqa: E402
    ImageGuest,  # noqa: E402
)
from pytest_forkd.storage.snapshot import Snapshot  # noqa: E402
from pytest_forkd.waiting import poll_until  # noqa: E402

CLASS_PATH = "pytest_forkd.integrations.mini_swe_agent.ForkdEnvironment"


@pytest.fixture(scope="module")
def image_snapshot() -> Iterator[Snapshot]:
    """The fake image's warm parent: one frozen fake VM whose directory holds ``state``, shared by the module."""
    factory = VMFactory(engine="fake")
    try:
        root = factory.boot(memory_mib=64)
        root.exec(["sh", "-c", "echo buggy > state"])  # in the VM's own directory, copied into each child
        yield root.freeze("image", keep_running=False)
    finally:
        factory.close()


class FakeImageSession:
    """What an image's forkd session gives the environment (``fork``, ``close``), on the fake engine.

    Every session forks the module's one snapshot (what it opens is what the
    tests count, not a boot); closing one ends its use, and the VMs forked
    from it are closed by their environments.
    """

    def __init__(self, key: Hashable, snapshot: Snapshot) -> None:
        self.key = key
        self.snapshot = snapshot
        self.closed = False

    def fork(self, n: int = 1) -> list[VM]:
        assert not self.closed, "a closed session was forked"
        return self.snapshot.fork(n)

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch, image_snapshot: Snapshot) -> Iterator[dict[Hashable, FakeImageSession]]:
    """Sessions opened by environments (by key), each on the fake engine; all closed afterwards."""
    sessions: dict[Hashable, FakeImageSession] = {}

    def open_fake(key: Hashable, config: Any) -> FakeImageSession:
        assert key not in sessions or sessions[key].closed, "a warm parent was opened twice"
        sessions[key] = FakeImageSession(key, image_snapshot)
        return sessions[key]

    monkeypatch.setattr(mini_swe_agent, "_open", open_fake)
    yield sessions
    for session in sessions.values():
        session.close()
    assert SESSIONS.keys() == []


def own(env: ForkdEnvironment) -> str:
    """The VM's own directory: on the fake engine absolute paths are the host's, shared by every VM."""
    return guest_path(env.vm, ".")


def environment(tmp_path: Path, **config: Any) -> ForkdEnvironment:
    made = get_environment({"environment_class": CLASS_PATH, "image": "127.0.0.1:5000/project:1", **config})
    assert isinstance(made, ForkdEnvironment)
    return made


def test_execute_returns_dockers_dict_with_both_streams_in_one(opened: dict[Any, Any], tmp_path: Path) -> None:
    env = environment(tmp_path, cwd=str(tmp_path))
    try:
        result = env.execute({"command": "echo out; echo err >&2; echo again; cat state"}, cwd=own(env))
        assert result == {"output": "out\nerr\nagain\nbuggy\n", "returncode": 0, "exception_info": ""}
        assert env.execute({"command": "exit 3"}) == {"output": "", "returncode": 3, "exception_info": ""}
        assert env.execute({"command": "kill -9 $$"})["returncode"] == 137  # 128+N, as docker exec reports it
        assert env.execute({"command": "pwd"}, cwd=str(tmp_path))["output"] == f"{tmp_path}\n"
        missing = env.execute({"command": "true"}, cwd=str(tmp_path / "nowhere"))
        assert missing["returncode"] == 126 and "cannot run in" in missing["output"]
    finally:
        env.cleanup()


def test_env_wins_over_forwarded_host_variables(
    opened: dict[Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FORWARDED", "from-host")
    monkeypatch.setenv("BOTH", "from-host")
    monkeypatch.delenv("UNSET_ON_HOST", raising=False)
    env = environment(
        tmp_path, forward_env=["FORWARDED", "BOTH", "UNSET_ON_HOST"], env={"BOTH": "from-config"}, cwd=str(tmp_path)
    )
    try:
        output = env.execute({"command": 'echo "$FORWARDED $BOTH ${UNSET_ON_HOST-unset}"'})["output"]
        assert output == "from-host from-config unset\n"
    finally:
        env.cleanup()


@pytest.mark.parametrize(
    ("command", "submission"),
    [
        ("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo the patch", "the patch\n"),
        ("printf '\\n  COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT  \\nline 1\\nline 2\\n'", "line 1\nline 2\n"),
        ("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT", ""),
    ],
)
def test_the_submission_sentinel_raises_submitted(
    opened: dict[Any, Any], tmp_path: Path, command: str, submission: str
) -> None:
    env = environment(tmp_path, cwd=str(tmp_path))
    try:
        with pytest.raises(Submitted) as caught:
            env.execute({"command": command})
        (message,) = caught.value.messages
        assert message == {
            "role": "exit",
            "content": submission,
            "extra": {"exit_status": "Submitted", "submission": submission},
        }
    finally:
        env.cleanup()


def test_no_submission_unless_the_sentinel_is_the_first_line_of_a_success(
    opened: dict[Any, Any], tmp_path: Path
) -> None:
    env = environment(tmp_path, cwd=str(tmp_path))
    try:
        failed = env.execute({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; exit 1"})
        assert failed["returncode"] == 1
        later = env.execute({"command": "echo first; echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"})
        assert later["output"] == "first\nCOMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n"
    finally:
        env.cleanup()


@pytest.mark.slow  # mini-swe-agent's timeouts are whole seconds: the two below cost two seconds of waiting
def test_a_timeout_is_reported_as_dockers_and_the_command_is_killed(opened: dict[Any, Any], tmp_path: Path) -> None:
    env = environment(tmp_path, cwd=str(tmp_path), timeout=1)
    marker, pids = tmp_path / "still-running", tmp_path / "pids"
    command = f"echo started; sleep 60 & echo $$ $! > {pids}; wait; touch {marker}"
    try:
        result = env.execute({"command": command})
        assert result["returncode"] == -1
        assert result["output"] == "started\n"
        assert result["exception_info"] == (
            f"An error occurred while executing the command: Command {command!r} timed out after 1 seconds"
        )
        assert result["extra"]["exception_type"] == "TimeoutExpired"
        # Killed with its shell and what the shell started, unlike a docker exec that outlives its client.
        shell_and_sleep = [int(pid) for pid in pids.read_text().split()]
        poll_until(lambda: not any(map(is_running, shell_and_sleep)), timeout=10, what="the timed-out command to die")
        assert not marker.exists()
        # The call's own timeout wins over the configured one: this outlasts 1 s and ends well within 5.
        assert env.execute({"command": "sleep 1.2; echo late"}, timeout=5)["output"] == "late\n"
    finally:
        env.cleanup()


def test_environments_of_an_image_share_one_warm_parent_and_cleanup_leaves_no_vm(
    opened: dict[Any, Any], tmp_path: Path
) -> None:
    first = environment(tmp_path, cwd=str(tmp_path))
    second = environment(tmp_path, cwd=str(tmp_path))
    assert len(opened) == 1
    (key,) = opened
    assert SESSIONS.users(key) == 2
    first.execute({"command": "echo fixed > state"}, cwd=own(first))
    assert second.execute({"command": "cat state"}, cwd=own(second))["output"] == "buggy\n"
    vm = first.vm
    first.cleanup()
    first.cleanup()  # idempotent
    assert vm.closed and SESSIONS.users(key) == 1 and not opened[key].closed
    with pytest.raises(ConfigError, match="cleaned up"):
        first.vm  # noqa: B018
    failed = first.execute({"command": "true"})
    assert failed["returncode"] == -1 and "cleaned up" in failed["exception_info"]
    second.cleanup()
    assert opened[key].closed and SESSIONS.keys() == []  # the last one closes the image's session: no VM is left
    # The next environment of the image opens it again (from the stored snapshot, in real use).
    third = environment(tmp_path, cwd=str(tmp_path))
    assert not opened[key].closed
    third.cleanup()


def test_images_have_a_warm_parent_each(opened: dict[Any, Any], tmp_path: Path) -> None:
    environments = [
        environment(tmp_path, image=f"127.0.0.1:5000/task-{index}:1", cwd=str(tmp_path)) for index in range(2)
    ]
    environments.append(environment(tmp_path, image="127.0.0.1:5000/task-0:1", cwd=str(tmp_path)))
    try:
        assert len(opened) == 2
        assert sorted(SESSIONS.users(key) for key in opened) == [1, 2]
    finally:
        for each in environments:
            each.cleanup()
    assert all(session.closed for session in opened.values())


def test_fork_gives_environments_of_this_ones_state_mid_run(opened: dict[Any, Any], tmp_path: Path) -> None:
    env = environment(tmp_path, cwd=str(tmp_path))
    try:
        env.execute({"command": "echo tried > state"}, cwd=own(env))
        branches = env.fork(2)
        try:
            for index, branch in enumerate(branches):
                assert branch.execute({"command": "cat state"}, cwd=own(branch))["output"] == "tried\n"
                branch.execute({"command": f"echo branch {index} > state"}, cwd=own(branch))
            assert env.execute({"command": "cat state"}, cwd=own(env))["output"] == "tried\n"
        finally:
            for branch in branches:
                branch.cleanup()
    finally:
        env.cleanup()


def test_template_vars_and_serialize_are_dockers(opened: dict[Any, Any], tmp_path: Path) -> None:
    env = environment(tmp_path, cwd=str(tmp_path))
    try:
        variables = env.get_template_vars(extra="given")
        assert variables["image"] == "127.0.0.1:5000/project:1" and variables["extra"] == "given"
        assert variables["system"] == "Linux" and variables["interpreter"] == ["bash", "-lc"]
        info = env.serialize()["info"]["config"]
        assert info["environment_type"] == CLASS_PATH
        assert info["environment"]["cwd"] == str(tmp_path) and info["environment"]["timeout"] == 30
    finally:
        env.cleanup()


def test_a_docker_config_runs_unchanged(opened: dict[Any, Any], tmp_path: Path) -> None:
    config = {"executable": "docker", "run_args": ["--rm"], "container_timeout": "2h", "pull_timeout": 120}
    env = environment(tmp_path, cwd=str(tmp_path), **config)
    try:
        assert env.execute({"command": "echo ok"})["output"] == "ok\n"
    finally:
        env.cleanup()


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"image": "x", "snapshot": "base"}, "give image or snapshot/config, not both"),
        ({"image": "Not A Reference"}, "ForkdEnvironment image: invalid image reference 'Not A Reference'"),
        ({"image": "x", "timeout": "soon"}, "ForkdEnvironment: timeout: Input should be a valid integer"),
    ],
)
def test_bad_configs_fail_with_one_line_before_anything_starts(
    opened: dict[Any, Any], config: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        ForkdEnvironment(**config)
    assert expected in str(caught.value) and "\n" not in str(caught.value)
    assert opened == {} and SESSIONS.keys() == []


def test_an_image_that_cannot_be_had_is_the_environments_error_and_nothing_is_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def unreachable(key: Hashable, config: Any) -> Any:
        raise ConfigError("127.0.0.1:9/none:1: the registry 127.0.0.1:9 is unreachable")

    monkeypatch.setattr(mini_swe_agent, "_open", unreachable)
    with pytest.raises(ConfigError, match="unreachable"):
        ForkdEnvironment(image="127.0.0.1:9/none:1")
    assert SESSIONS.keys() == []


def test_the_session_key_is_the_image_and_its_working_directory() -> None:
    config = mini_swe_agent.ForkdEnvironmentConfig(image="python:3.12", cwd="/testbed")
    key = mini_swe_agent._session_key(config)
    assert key == (
        "mini-swe-agent",
        ImageGuest(reference="docker://docker.io/library/python:3.12", workdir="/testbed", network="outbound"),
    )
    assert mini_swe_agent._session_key(mini_swe_agent.ForkdEnvironmentConfig(image="python:3.12", cwd="/")) != key
    snapshot = mini_swe_agent.ForkdEnvironmentConfig(snapshot="tools", config="forkd.yaml")
    assert mini_swe_agent._session_key(snapshot) == (
        "mini-swe-agent",
        os.path.abspath("forkd.yaml"),
        "tools",
        None,
    )


def test_the_documented_yaml_config_loads(tmp_path: Path, opened: dict[Any, Any]) -> None:
    import yaml

    text = textwrap.dedent(
        f"""\
        environment:
          environment_class: {CLASS_PATH}
          image: 127.0.0.1:5000/project:1
          cwd: {tmp_path}
          timeout: 60
          env: {{PAGER: cat}}
        """
    )
    env = get_environment(yaml.safe_load(text)["environment"])
    try:
        assert env.execute({"command": "echo $PAGER"})["output"] == "cat\n"
    finally:
        env.cleanup()  # type: ignore[attr-defined]
