"""The persistent store through pytest runs: private files, and a damaged snapshot rebuilt by the next run."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pytest

from pytest_forkd import private
from pytest_forkd.storage.store import SnapshotStore

SUITE = """
def test_uses_a_vm(forkd_vm):
    assert forkd_vm.exec("echo hi").stdout == "hi\\n"
"""


@pytest.mark.vm  # boots QEMU in the inner pytest run
def test_a_run_stores_private_files_and_rebuilds_a_damaged_base(
    pytester: pytest.Pytester, run_forkd: Callable[..., pytest.RunResult], tmp_path: Path
) -> None:
    store_dir = tmp_path / "store"
    pytester.makepyfile(SUITE)

    first = run_forkd("-s", store=store_dir)
    first.assert_outcomes(passed=1)
    assert private.exposed(store_dir) == []  # directories 0700, files 0600, lock files too
    base = SnapshotStore(store_dir).get("base")
    assert set(base.files) == {base.state_file, base.memory_file}

    os.truncate(base.memory_path, 1 << 20)  # a full disk, an interrupted copy...
    second = run_forkd("-s", store=store_dir)

    second.assert_outcomes(passed=1)
    assert "stored snapshot 'base' is damaged" in second.stderr.str() + second.stdout.str()
    SnapshotStore(store_dir).verify("base")
    assert private.exposed(store_dir) == []
