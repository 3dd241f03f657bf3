"""Helpers for running pytest suites that use pytest-forkd in a subprocess (pytester)."""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support import USER_CACHE, assert_nothing_left


@pytest.fixture(scope="session")
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One snapshot store for every inner run of the session, so ``base`` is built once."""
    return tmp_path_factory.mktemp("forkd-store")


@pytest.fixture
def shm_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private FORKD_SHM_DIR for the inner runs of one test, removed afterwards."""
    directory = Path(f"/dev/shm/forkd-plugin-test-{os.getpid()}-{secrets.token_hex(4)}")
    monkeypatch.setenv("FORKD_SHM_DIR", str(directory))
    monkeypatch.setenv("FORKD_CACHE_DIR", str(USER_CACHE))
    monkeypatch.delenv("FORKD_STORE", raising=False)
    for name in list(os.environ):
        if name.startswith("PYTEST_FORKD_"):
            monkeypatch.delenv(name)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def check_nothing_left(shm_dir: Path) -> Callable[[], None]:
    """Call it after starting VMs outside pytester (``forkd exec``, ``forkd shell``) to check the cleanup."""
    return lambda: assert_nothing_left(shm_dir)


@pytest.fixture
def run_forkd(pytester: pytest.Pytester, shm_dir: Path, shared_store: Path) -> Callable[..., pytest.RunResult]:
    """Run pytest in a subprocess with the shared store, then check that the run left nothing behind."""

    def run(*args: str, store: Path | None = None) -> pytest.RunResult:
        result = pytester.runpytest_subprocess(
            "-p", "no:cacheprovider", f"--forkd-store={store or shared_store}", *args, timeout=300
        )
        assert_nothing_left(shm_dir)
        return result

    return run
