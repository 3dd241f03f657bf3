"""Per-VM defaults: ``VM.env`` and ``VM.cwd`` reach every command and travel with snapshots to forks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_forkd.core.vm import VM
from pytest_forkd.errors import ForkdError, InvalidArgument
from pytest_forkd.storage.snapshot import Snapshot
from pytest_forkd.storage.store import SnapshotStore

SHOW = 'printf "%s|%s|%s" "$APP_MODE" "$EXTRA" "$(pwd)"'


def test_env_and_cwd_reach_every_exec_and_a_call_overrides_them(vm: VM) -> None:
    vm.exec(["mkdir", "-p", "/srv/app"], check=True)
    plain = vm.exec(SHOW).stdout
    vm.env = {"APP_MODE": "test", "EXTRA": "vm"}
    vm.cwd = "/srv/app"

    assert vm.exec(SHOW).stdout == "test|vm|/srv/app"
    assert vm.exec(SHOW, env={"EXTRA": "call"}).stdout == "test|call|/srv/app"  # merged over VM.env
    assert vm.exec(SHOW, cwd="/tmp").stdout == "test|vm|/tmp"
    assert vm.exec(["sh", "-c", 'echo "$PATH"']).stdout.strip() != ""  # the guest's own environment stays

    vm.env["EXTRA"] = "changed in place"
    assert vm.exec(SHOW).stdout == "test|changed in place|/srv/app"

    vm.env, vm.cwd = {}, None
    assert vm.exec(SHOW).stdout == plain


def test_forks_branches_checkpoints_and_restores_inherit_the_defaults(vm: VM) -> None:
    vm.exec(["mkdir", "-p", "/work"], check=True)
    vm.env = {"APP_MODE": "parent"}
    vm.cwd = "/work"

    snapshot = vm.branch(backend="full")
    assert (snapshot.extra["env"], snapshot.extra["cwd"]) == ({"APP_MODE": "parent"}, "/work")
    children = snapshot.fork(2)
    try:
        assert [child.exec(SHOW).stdout for child in children] == ["parent||/work"] * 2
        assert children[0].env == {"APP_MODE": "parent"} and children[0].cwd == "/work"
        children[0].env["APP_MODE"] = "child"  # a child's defaults are its own
        assert children[0].exec(SHOW).stdout == "child||/work"
        assert children[1].exec(SHOW).stdout == "parent||/work"
        assert vm.exec(SHOW).stdout == "parent||/work"
    finally:
        for child in children:
            child.close()

    with vm.checkpoint() as checkpoint:
        vm.env = {"APP_MODE": "changed"}
        vm.cwd = "/"
        grandchild = checkpoint.fork(1)[0]
        try:
            assert grandchild.exec(SHOW).stdout == "parent||/work"
        finally:
            grandchild.close()
    # Rolled back on exit: the defaults are part of the state the checkpoint restores.
    assert vm.exec(SHOW).stdout == "parent||/work"

    forked = vm.fork(1)[0]
    try:
        assert forked.exec(SHOW).stdout == "parent||/work"
    finally:
        forked.close()


def test_a_child_restored_in_another_process_gets_the_defaults(vm: VM, tmp_path: Path) -> None:
    from pytest_forkd.project.snapshot_builder import publish_copy

    vm.exec(["mkdir", "-p", "/opt/proj"], check=True)
    vm.env = {"APP_MODE": "elsewhere", "EXTRA": "x y"}
    vm.cwd = "/opt/proj"
    staged = vm.branch(backend="full")
    stored = publish_copy(staged, SnapshotStore(tmp_path / "store"), "defaults")
    assert Snapshot.load_from(stored.path).extra["cwd"] == "/opt/proj"

    script = (
        "import json, sys\n"
        "from pytest_forkd.core.factory import VMFactory\n"
        "from pytest_forkd.storage.snapshot import Snapshot\n"
        "factory = VMFactory(accel=sys.argv[2])\n"
        "try:\n"
        "    child = factory.fork_snapshot(Snapshot.load_from(sys.argv[1]), 1)[0]\n"
        f"    print(json.dumps([child.env, child.cwd, child.exec({SHOW!r}).stdout]))\n"
        "finally:\n"
        "    factory.close()\n"
    )
    accel = os.environ.get("PYTEST_FORKD_ACCEL", "auto")
    done = subprocess.run(
        [sys.executable, "-c", script, str(stored.path), accel], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr
    env, cwd, shown = json.loads(done.stdout.strip().splitlines()[-1])
    assert (env, cwd, shown) == ({"APP_MODE": "elsewhere", "EXTRA": "x y"}, "/opt/proj", "elsewhere|x y|/opt/proj")


def test_bad_defaults_are_refused_and_the_vm_stays_usable(vm: VM) -> None:
    with pytest.raises(InvalidArgument, match="env\\['N'\\] must be a str"):
        vm.env = {"N": 1}
    with pytest.raises(InvalidArgument, match="'not=valid' is not a valid variable name"):
        vm.env = {"not=valid": "x"}
    with pytest.raises(InvalidArgument, match="cwd 'relative/dir' is relative"):
        vm.cwd = "relative/dir"
    assert (vm.env, vm.cwd) == ({}, None)

    vm.cwd = "/does/not/exist"
    with pytest.raises(ForkdError):
        vm.exec("true")
    vm.cwd = None
    assert vm.exec("echo fine").stdout == "fine\n"
