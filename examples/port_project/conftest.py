"""Porting a real project's tests into forked VMs: the project's source goes into the parent VM once.

The project is toolz 0.12.1, as published on PyPI (its sdist is in vendor/,
checked against its sha256; project.py names it). The session's parent VM
starts from snapshot ``toolz-env`` (forkd.yaml: an image with python3-pytest,
workdir /srv/toolz). This conftest unpacks the sdist on the host, copies it
in with ``VM.copy_in``, byte-compiles it and starts a pytest process that
imports pytest and waits (zygote.py): every test then gets a copy-on-write
child of that warm parent, where that process runs one of the project's
test modules at once, without importing pytest again.

To port your own project, see the guide "Porting a project's tests" in the documentation
(https://pytest-forkd.readthedocs.io/en/latest/guides/porting/).
"""

from __future__ import annotations

import hashlib
import tarfile
from pathlib import Path

import pytest
from project import EXCLUDE, GUEST_PYTEST, GUEST_SOURCE, SDIST, SDIST_SHA256, TESTS_GLOB, ZYGOTE_DIR

#: Runs in a child: hand the module to the warm pytest process, wait for its status, show its output.
RUN_IN_ZYGOTE = (
    'printf "%s\\0" "$@" > {dir}/request && status=$(cat {dir}/status) && cat {dir}/output && exit "$status"'
)


def checked_sdist() -> Path:
    digest = hashlib.sha256(SDIST.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise pytest.UsageError(f"{SDIST} has sha256 {digest}, not the pinned {SDIST_SHA256}: download it again")
    return SDIST


def project_test_modules() -> list[str]:
    """The project's test modules, relative to its source root, read from the sdist itself."""
    with tarfile.open(checked_sdist()) as sdist:
        names = [member.name.split("/", 1)[1] for member in sdist.getmembers() if member.isfile()]
    return sorted(name for name in names if Path(name).match(TESTS_GLOB))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """One test per test module of the project, each run in its own forked VM."""
    if "project_test_module" in metafunc.fixturenames:
        modules = project_test_modules()
        metafunc.parametrize("project_test_module", modules, ids=[Path(name).stem for name in modules])


@pytest.fixture(scope="session", autouse=True)
def project_source(forkd_parent, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The project's source in the parent VM, its tests collected once: every test's VM is a child of this state."""
    unpacked = tmp_path_factory.mktemp("sdist")
    with tarfile.open(checked_sdist()) as sdist:
        if hasattr(tarfile, "data_filter"):  # Python 3.12, and 3.11.4 on
            sdist.extractall(unpacked, filter="data")
        else:
            sdist.extractall(unpacked)
    (root,) = unpacked.iterdir()  # an sdist holds one folder, NAME-VERSION
    copied = forkd_parent.copy_in(root, GUEST_SOURCE, exclude=EXCLUDE)
    print(f"copied {copied.files} files ({copied.bytes} bytes) of {root.name} into {GUEST_SOURCE}")
    forkd_parent.exec(["python3", "-m", "compileall", "-q", "."], timeout=900, check=True)  # once, not per child
    # A pytest process past its imports, waiting in the parent: every child forks it warm (see zygote.py).
    forkd_parent.copy_in(Path(__file__).parent / "zygote.py", f"{ZYGOTE_DIR}/zygote.py")
    forkd_parent.exec(["mkfifo", *(f"{ZYGOTE_DIR}/{name}" for name in ("ready", "request", "status"))], check=True)
    forkd_parent.exec(
        f"setsid python3 {ZYGOTE_DIR}/zygote.py {ZYGOTE_DIR} </dev/null >{ZYGOTE_DIR}/log 2>&1 &", check=True
    )
    ready = forkd_parent.exec(["cat", f"{ZYGOTE_DIR}/ready"], timeout=900)  # blocks until pytest is imported
    assert ready.stdout == "ready\n", forkd_parent.read_file(f"{ZYGOTE_DIR}/log").decode(errors="replace")
    return GUEST_SOURCE


@pytest.fixture
def run_project_tests(forkd_vm):
    """Run the project's pytest on some arguments in this test's VM, through the warm process; the ExecResult."""

    def run(*args: str, timeout: float = 900):
        script = RUN_IN_ZYGOTE.format(dir=ZYGOTE_DIR)
        return forkd_vm.exec(["sh", "-c", script, "sh", *GUEST_PYTEST[3:], *args], timeout=timeout, timing="workload")

    return run
