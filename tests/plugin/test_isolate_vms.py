"""``pytest --forkd-isolate`` against real VMs: a third-party suite and probe tests, each test in its own child VM.

One inner run is shared by most tests here (each run boots a parent, copies
the project and collects it with the guest's pytest): toolz's own tests from
its sdist (a subset of its modules, the files as published) beside probe
tests of the isolation, with forkd.yaml at the top. A second, smaller run
goes through pytest-xdist.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from filelock import FileLock
from support import USER_CACHE, assert_nothing_left

pytestmark = pytest.mark.vm

SDIST = Path(__file__).parents[2] / "examples" / "port_project" / "vendor" / "toolz-0.12.1.tar.gz"
#: toolz's test modules run here (``make example-port`` runs them all): a few minutes at most on 2 TCG cores.
TOOLZ_MODULES = ("test_compatibility", "test_recipes", "test_signatures", "test_tlz", "test_utils")

FORKD_YAML = """\
images:
  tests:
    packages: [python3-pytest]
snapshots:
  base:
    from: image:tests
"""

PROBES = """\
import os
import platform
import subprocess
import time
import uuid

import pytest


@pytest.fixture(scope="session")
def slow_resource():
    time.sleep(5)  # an expensive session set-up: done once, in the parent VM
    return {"id": uuid.uuid4().hex}


@pytest.mark.parametrize("n", range(10))
def test_shares_the_slow_resource(slow_resource, n):
    print(f"resource {slow_resource['id']}")


@pytest.mark.forkd_isolate(fresh=True)
def test_sets_up_its_own_resource(slow_resource):
    print(f"fresh resource {slow_resource['id']}")


def test_a_writes_etc():
    with open("/etc/forkd-isolation-probe", "w") as probe:
        probe.write("written by test_a")
    assert os.path.exists("/etc/forkd-isolation-probe")


def test_b_does_not_see_it():
    assert not os.path.exists("/etc/forkd-isolation-probe")


def test_c_runs_on_the_guest_kernel():
    print(f"kernel {platform.release()} node {platform.node()}")


def test_d_panics_the_guest_kernel():
    with open("/proc/sysrq-trigger", "w") as trigger:
        trigger.write("c")
    time.sleep(60)


def test_e_deletes_system_files():
    subprocess.run(["rm", "-rf", "/usr/bin", "/usr/lib/python3"], check=False)
    assert not os.path.exists("/usr/bin")


def test_f_after_the_wreckage():
    assert os.path.exists("/usr/bin/python3")
    assert not os.path.exists("/etc/forkd-isolation-probe")


def test_g_fails_an_assert():
    assert [1, 2, 3] == [1, 5, 3]


@pytest.mark.forkd_isolate(timeout=5)
def test_h_hangs():
    time.sleep(300)


def test_i_fills_the_disk():
    with open("/tmp/filler", "wb") as filler:
        while True:
            filler.write(b"x" * (1 << 20))


def test_j_after_the_disk_was_full():
    assert not os.path.exists("/tmp/filler")
"""


@dataclass
class InnerRun:
    returncode: int
    output: str
    junit: ElementTree.Element

    def outcomes(self, name_part: str) -> dict[str, str]:
        """Each test case of the junit XML whose name contains ``name_part`` (named from there on): passed,
        failure, error or skipped."""
        found = {}
        for case in self.junit.iter("testcase"):
            name = f"{case.get('classname')}.{case.get('name')}"
            if name_part in name:
                kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
                found[name[name.index(name_part) :]] = kinds[0] if kinds else "passed"
        return found

    def case(self, name: str) -> ElementTree.Element:
        (case,) = [case for case in self.junit.iter("testcase") if case.get("name") == name]
        return case


def unpack_toolz(into: Path) -> Path:
    with tarfile.open(SDIST) as sdist:
        if hasattr(tarfile, "data_filter"):
            sdist.extractall(into, filter="data")
        else:
            sdist.extractall(into)
    return into / "toolz-0.12.1"


def inner_env(shm_dir: Path) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_FORKD_")}
    env.update(FORKD_SHM_DIR=str(shm_dir), FORKD_CACHE_DIR=str(USER_CACHE))
    env.pop("FORKD_STORE", None)
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_ADDOPTS", None)
    return env


def run_pytest(cwd: Path, env: dict[str, str], *args: str, junit: Path) -> InnerRun:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", f"--junitxml={junit}", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    output = result.stdout + result.stderr
    assert junit.is_file(), output[-6000:]
    return InnerRun(result.returncode, output, ElementTree.parse(junit).getroot())


@pytest.fixture(scope="module")
def shm_dir() -> Iterator[Path]:
    directory = Path(f"/dev/shm/forkd-isolate-test-{os.getpid()}")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where this module keeps its project and runs: one folder for all xdist workers, so each run happens once."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        directory = tmp_path_factory.getbasetemp().parent / "isolate-vms"
        directory.mkdir(exist_ok=True)
        return directory
    return tmp_path_factory.mktemp("isolate-vms")


def once(shared_dir: Path, name: str, produce: Callable[[], InnerRun]) -> InnerRun:
    """The run ``name``: made by the first worker that asks (``produce``), read back by the others."""
    saved = shared_dir / f"{name}.json"
    with FileLock(shared_dir / f"{name}.lock"):
        if saved.is_file():
            data = json.loads(saved.read_text())
            return InnerRun(data["returncode"], data["output"], ElementTree.fromstring(data["junit"]))
        run = produce()
        junit = ElementTree.tostring(run.junit, encoding="unicode")
        saved.write_text(json.dumps({"returncode": run.returncode, "output": run.output, "junit": junit}))
        return run


@pytest.fixture(scope="module")
def project(shared_dir: Path) -> Path:
    """toolz's sdist unpacked as published, probe tests beside it, forkd.yaml at the top (the rootdir)."""
    top = shared_dir / "project"
    with FileLock(shared_dir / "project.lock"):
        if not (top / "forkd.yaml").is_file():
            top.mkdir()
            unpack_toolz(top)
            (top / "probes").mkdir()
            (top / "probes" / "test_isolation_probes.py").write_text(PROBES)
            (top / "forkd.yaml").write_text(FORKD_YAML)
    return top


def toolz_args() -> list[str]:
    return [f"toolz/tests/{module}.py" for module in TOOLZ_MODULES]


@pytest.fixture(scope="module")
def isolated(project: Path, shm_dir: Path, shared_store: Path, shared_dir: Path) -> InnerRun:
    """The shared run: toolz's subset and the probes, every test in its own child VM, from toolz's folder."""

    def produce() -> InnerRun:
        run = run_pytest(
            project / "toolz-0.12.1",
            inner_env(shm_dir),
            "--forkd-isolate",
            f"--forkd-store={shared_store}",
            "-rA",
            *toolz_args(),
            "../probes",
            junit=shared_dir / "isolated.xml",
        )
        assert_nothing_left(shm_dir)
        return run

    return once(shared_dir, "isolated", produce)


@pytest.fixture(scope="module")
def on_host(project: Path, shared_dir: Path) -> InnerRun:
    """The same toolz modules run on the host, without forkd: the count to match."""

    def produce() -> InnerRun:
        env = inner_env(Path("/nonexistent"))
        return run_pytest(project / "toolz-0.12.1", env, "-p", "no:forkd", *toolz_args(), junit=shared_dir / "host.xml")

    return once(shared_dir, "host", produce)


def test_the_third_party_suite_passes_as_it_does_on_the_host(isolated: InnerRun, on_host: InnerRun) -> None:
    in_vms = isolated.outcomes("toolz.tests")
    on_the_host = on_host.outcomes("toolz.tests")
    assert on_the_host and set(on_the_host.values()) == {"passed"}, on_host.output[-4000:]
    assert in_vms == on_the_host, isolated.output[-6000:]
    assert "forkd: copying" in isolated.output or "collected" in isolated.output


def test_a_file_written_to_etc_is_not_seen_by_a_later_test(isolated: InnerRun) -> None:
    outcomes = isolated.outcomes("test_isolation_probes")
    assert outcomes["test_isolation_probes.test_a_writes_etc"] == "passed", isolated.output[-6000:]
    assert outcomes["test_isolation_probes.test_b_does_not_see_it"] == "passed"


def test_each_test_runs_on_the_guest_kernel(isolated: InnerRun) -> None:
    found = re.search(r"kernel (\S+) node (\S+)", isolated.output)
    assert found, isolated.output[-6000:]
    assert found.group(1) != platform.release()
    assert found.group(2) == "forkd"


def test_a_kernel_panic_fails_that_test_alone_naming_the_crash(isolated: InnerRun) -> None:
    outcomes = isolated.outcomes("test_isolation_probes")
    assert outcomes["test_isolation_probes.test_d_panics_the_guest_kernel"] == "failure"
    panic = isolated.case("test_d_panics_the_guest_kernel").find("failure")
    assert panic is not None
    assert "GuestCrashed" in (panic.get("message") or "") + (panic.text or "")
    assert "Kernel panic" in (panic.text or "")
    assert outcomes["test_isolation_probes.test_f_after_the_wreckage"] == "passed", isolated.output[-6000:]
    assert outcomes["test_isolation_probes.test_e_deletes_system_files"] == "passed"


def test_a_failing_assert_shows_the_introspection_in_the_terminal_and_junit(isolated: InnerRun) -> None:
    assert "At index 1 diff: 2 != 5" in isolated.output
    failure = isolated.case("test_g_fails_an_assert").find("failure")
    assert failure is not None and "At index 1 diff: 2 != 5" in (failure.text or "")
    assert failure.get("message", "").startswith("assert [1, 2, 3] == [1, 5, 3]")


def test_a_test_that_fills_the_disk_fails_alone_with_the_cause(isolated: InnerRun) -> None:
    outcomes = isolated.outcomes("test_isolation_probes")
    assert outcomes["test_isolation_probes.test_i_fills_the_disk"] == "failure"
    failure = isolated.case("test_i_fills_the_disk").find("failure")
    assert failure is not None
    text = failure.text or ""
    # The guest's files live in its memory: the file system fills up, or the kernel kills the test's process first.
    assert "No space left on device" in text or "out-of-memory" in text, text[-3000:]
    assert outcomes["test_isolation_probes.test_j_after_the_disk_was_full"] == "passed"


def test_a_timeout_kills_the_test_not_the_run(isolated: InnerRun) -> None:
    failure = isolated.case("test_h_hangs").find("failure")
    assert failure is not None and "ran past its timeout of 5 s" in (failure.text or "")
    assert isolated.returncode == 1  # failed tests, not an interrupted run


def test_a_session_fixture_runs_once_in_the_parent_and_fresh_tests_get_their_own(isolated: InnerRun) -> None:
    shared = set(re.findall(r"^resource ([0-9a-f]{32})$", isolated.output, re.MULTILINE))
    fresh = set(re.findall(r"^fresh resource ([0-9a-f]{32})$", isolated.output, re.MULTILINE))
    outcomes = isolated.outcomes("test_shares_the_slow_resource")
    assert len(outcomes) == 10 and set(outcomes.values()) == {"passed"}, isolated.output[-6000:]
    assert len(shared) == 1, isolated.output[-6000:]  # one set-up, inherited by all ten children
    assert len(fresh) == 1 and fresh != shared


def test_xdist_workers_each_get_their_own_parent(
    project: Path, shm_dir: Path, shared_store: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    pytest.importorskip("xdist")
    junit = tmp_path_factory.mktemp("junit") / "xdist.xml"
    run = run_pytest(
        project,
        inner_env(shm_dir),
        "--forkd-isolate",
        f"--forkd-store={shared_store}",
        "-n",
        "2",
        "-k",
        "test_a_ or test_b_ or test_c_ or test_d_ or test_f_ or test_g_",
        "probes",
        junit=junit,
    )
    outcomes = run.outcomes("test_isolation_probes")
    assert sorted(outcomes.values()) == ["failure", "failure", "passed", "passed", "passed", "passed"], run.output[
        -6000:
    ]
    assert "GuestCrashed" in run.output and "At index 1 diff: 2 != 5" in run.output
    assert set(re.findall(r"snapshot 'base': .*\[(gw\d)\]", run.output)) == {"gw0", "gw1"}, run.output[-3000:]
    assert_nothing_left(shm_dir)


def test_a_guest_without_pytest_fails_each_test_saying_what_to_declare(
    shm_dir: Path, shared_store: Path, tmp_path: Path
) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_plain.py").write_text("def test_plain():\n    pass\n")
    run = run_pytest(
        tmp_path, inner_env(shm_dir), "--forkd-isolate", f"--forkd-store={shared_store}", junit=tmp_path / "j.xml"
    )
    error = run.case("test_plain").find("error")
    assert error is not None, run.output[-4000:]
    assert "the guest has no pytest" in (error.text or "") and "python3-pytest" in (error.text or "")
    assert_nothing_left(shm_dir)
