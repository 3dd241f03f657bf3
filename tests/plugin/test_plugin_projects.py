"""Snapshot names per project, and forkd.yaml's env/workdir reaching every command of forked VMs."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from pytest_forkd.project import lifecycle
from pytest_forkd.storage.store import SnapshotStore

pytestmark = pytest.mark.vm

FORKD = str(Path(sys.executable).parent / "forkd")

PROJECT_YAML = """
snapshots:
  base:
    setup: ["echo {name} > /etc/project-name"]
  web:
    setup: ["echo web-of-{name} > /etc/web"]
"""

PROJECT_SUITE = """
import pytest

def test_base_is_this_projects(forkd_vm):
    assert forkd_vm.read_file("/etc/project-name") == b"{name}\\n"

@pytest.mark.forkd(snapshot="web")
def test_web_is_this_projects(forkd_vm):
    assert forkd_vm.read_file("/etc/web") == b"web-of-{name}\\n"
    assert forkd_vm.read_file("/etc/project-name") == b"{name}\\n"
"""


def _project(root: Path, name: str) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "forkd.yaml").write_text(PROJECT_YAML.format(name=name))
    (folder / f"test_{name}.py").write_text(PROJECT_SUITE.format(name=name))
    return folder


def test_two_projects_that_both_define_base_keep_separate_snapshots(
    pytester: pytest.Pytester, run_forkd: Callable[..., pytest.RunResult], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    alpha, beta = _project(pytester.path, "alpha"), _project(pytester.path, "beta")

    for folder in (alpha, beta):
        result = run_forkd("-s", f"--rootdir={folder}", str(folder), store=store)
        result.assert_outcomes(passed=2)
        result.stdout.fnmatch_lines(
            ["*forkd: building snapshot 'base' from image 'default'*", "*forkd: building snapshot 'web' from 'base'*"]
        )

    # Each project kept its own: running the first again builds nothing.
    again = run_forkd("-s", f"--rootdir={alpha}", str(alpha), store=store)
    again.assert_outcomes(passed=2)
    again.stdout.no_fnmatch_line("*building snapshot*")

    root = SnapshotStore(store)
    projects = {
        project: sorted(snapshot.tag for snapshot in namespace.list())
        for project, namespace in lifecycle.namespaces(root)
        if project is not None
    }
    assert projects == {lifecycle.project_id(alpha): ["base", "web"], lifecycle.project_id(beta): ["base", "web"]}
    assert [snapshot.tag for snapshot in root.list()] == []  # nothing of theirs leaked into the shared names

    listed = subprocess.run(
        [FORKD, "snapshots", "ls", "--store", str(store), "--all"], capture_output=True, text=True, timeout=60
    )
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[0].split()[-4:] == ["AGE", "LAST", "USED", "PROJECT"]
    assert sum(line.startswith("web ") for line in listed.stdout.splitlines()) == 2


def test_builtin_base_and_shared_snapshots_are_shared_between_projects(
    pytester: pytest.Pytester, run_forkd: Callable[..., pytest.RunResult], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    suite = (
        "import pytest\n\n@pytest.mark.forkd(snapshot='common')\n"
        "def test_common(forkd_vm):\n    assert forkd_vm.read_file('/etc/common') == b'one\\n'\n"
    )
    folders = []
    for name in ("one", "two"):
        folder = pytester.path / name
        folder.mkdir()
        (folder / "forkd.yaml").write_text(
            "snapshots:\n  common:\n    shared: true\n    setup: ['echo one > /etc/common']\n"
        )
        (folder / f"test_{name}.py").write_text(suite)
        folders.append(folder)

    first = run_forkd("-s", f"--rootdir={folders[0]}", str(folders[0]), store=store)
    first.assert_outcomes(passed=1)
    second = run_forkd("-s", f"--rootdir={folders[1]}", str(folders[1]), store=store)
    second.assert_outcomes(passed=1)
    second.stdout.fnmatch_lines(["*forkd: using cached snapshot 'base'*", "*forkd: using cached snapshot 'common'*"])
    assert sorted(snapshot.tag for snapshot in SnapshotStore(store).list()) == ["base", "common"]


def test_snapshot_env_and_workdir_apply_to_every_command_of_forked_vms(
    pytester: pytest.Pytester, run_forkd: Callable[..., pytest.RunResult]
) -> None:
    pytester.makefile(
        ".yaml",
        forkd="""
settings:
  snapshot: app
snapshots:
  app:
    env: {APP_MODE: test, GREETING: hello}
    workdir: /srv/app
    setup: ['echo "$APP_MODE" > setup-saw-mode', 'pwd > setup-saw-dir']
  app2:
    from: app
    env: {GREETING: bonjour}
""",
    )
    pytester.makepyfile(
        test_env="""
import pytest

SHOW = 'printf "%s %s %s" "$APP_MODE" "$GREETING" "$(pwd)"'

@pytest.fixture(scope="session", autouse=True)
def prepared(forkd_parent):
    assert forkd_parent.exec(SHOW).stdout == "test hello /srv/app"
    forkd_parent.exec("echo parent > from-parent", check=True)

def test_setup_ran_there(forkd_vm):
    assert forkd_vm.exec("cat setup-saw-mode setup-saw-dir from-parent").stdout == "test\\n/srv/app\\nparent\\n"

def test_every_command_gets_them(forkd_vm):
    assert (forkd_vm.env, forkd_vm.cwd) == ({"APP_MODE": "test", "GREETING": "hello"}, "/srv/app")
    assert forkd_vm.exec(SHOW).stdout == "test hello /srv/app"
    assert forkd_vm.exec(SHOW, env={"GREETING": "hi"}, cwd="/").stdout == "test hi /"

def test_children_of_checkpoints_get_them(forkd_vm, forkd_checkpoint):
    child = forkd_checkpoint(forkd_vm).fork(1)[0]
    assert child.exec(SHOW).stdout == "test hello /srv/app"

def test_parent_defaults_changed_later_reach_later_children(forkd_parent, forkd):
    forkd_parent.env["LATE"] = "yes"  # no command ran: only the defaults changed
    child = forkd.fork(1)[0]
    try:
        assert child.exec('echo "$LATE $APP_MODE"').stdout == "yes test\\n"
    finally:
        child.close()

@pytest.mark.forkd(snapshot="app2")
def test_a_snapshot_from_it_inherits_and_overrides(forkd_vm):
    assert forkd_vm.exec(SHOW).stdout == "test bonjour /srv/app"
"""
    )
    result = run_forkd("-s")
    result.assert_outcomes(passed=5)


def test_kept_failures_expire_by_count(
    pytester: pytest.Pytester, run_forkd: Callable[..., pytest.RunResult], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    pytester.makefile(".yaml", forkd="settings:\n  keep_failed_count: 1\n")
    pytester.makepyfile(
        test_fail="""
def test_first(forkd_vm):
    assert False, "first"

def test_second(forkd_vm):
    assert False, "second"
"""
    )
    result = run_forkd("--forkd-keep-failed", store=store)

    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*expired: failed-test_first (kept failure beyond the newest 1 (keep_failed_count))*"])
    project = lifecycle.project_store(store, pytester.path)
    assert [snapshot.tag for snapshot in project.list()] == ["failed-test_second"]
    result.stdout.fnmatch_lines([f"*forkd shell failed-test_second --store {project.root}*"])
    # Inside the project the CLI finds the project's own snapshots without --store.
    found = subprocess.run(
        [FORKD, "exec", "--snapshot", "failed-test_second", "--", "echo", "found"],
        cwd=pytester.path,
        env={**os.environ, "FORKD_STORE": str(store)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (found.returncode, found.stdout) == (0, "found\n"), found.stderr


def test_the_size_cap_evicts_an_unused_recipe_snapshot_which_the_next_run_rebuilds(
    pytester: pytest.Pytester, run_forkd: Callable[..., pytest.RunResult], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    snapshots = "snapshots:\n  one: {setup: ['echo 1 > /etc/n']}\n  two: {setup: ['echo 2 > /etc/n']}\n"
    pytester.makepyfile(
        test_n="""
import pytest

@pytest.mark.parametrize("name", ["one", "two"])
def test_n(forkd, name):
    vm = forkd.factory.fork_snapshot(forkd.snapshot_for(name), 1)[0]
    try:
        assert vm.read_file("/etc/n") == {"one": b"1\\n", "two": b"2\\n"}[name]
    finally:
        vm.close()
"""
    )
    pytester.makefile(".yaml", forkd=snapshots)
    run_forkd("-s", "-k", "one", store=store).assert_outcomes(passed=1)

    pytester.makefile(".yaml", forkd="settings: {store_max_size: 1MiB}\n" + snapshots)
    capped = run_forkd("-s", "-k", "two", store=store)
    capped.assert_outcomes(passed=1)
    capped.stdout.fnmatch_lines(["*forkd: evicted snapshot 'one' of project *least recently used recipe snapshot*"])
    project = lifecycle.project_store(store, pytester.path)
    assert sorted(snapshot.tag for snapshot in project.list()) == ["two"]
    assert SnapshotStore(store).exists("base")  # in use by that run: kept

    again = run_forkd("-s", "-k", "one", store=store)
    again.assert_outcomes(passed=1)
    again.stdout.fnmatch_lines(["*forkd: building snapshot 'one' from 'base'*"])
