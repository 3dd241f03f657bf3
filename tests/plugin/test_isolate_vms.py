"""``pytest --forkd-isolate`` against real VMs: third-party suites and probe tests, each test in its own child VM.

One inner run is shared by most tests here (each run boots a parent, copies
the project and collects it with the guest's pytest, Debian bookworm's 7.2):
six 1.17.0's own ``test_six.py`` from its sdist (it has skips) beside probe
tests of the isolation and of the suite's configuration (an option a
conftest.py reads in ``pytest_configure``, ``addopts = -p pytester``,
pytest-timeout on both sides, class scope, ``record_*``, ``-s``), with a
pytest.ini and forkd.yaml at the top. Smaller runs: through pytest-xdist, a
Ctrl-C during a test, and pluggy 1.5.0's own suite installed editable in a
virtualenv (a ``src/`` layout whose package the guest's pytest itself
imports). The sdists come from PyPI and are kept in the user's cache.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import venv
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from filelock import FileLock
from isolate_support import host_pytest_timeout, sdist
from support import USER_CACHE, assert_nothing_left

pytestmark = pytest.mark.vm

REPOSITORY = Path(__file__).parents[2]

#: The guest image of these projects: the suites' test dependencies (tkinter for six's moves, pytest-timeout).
FORKD_YAML = """\
images:
  tests:
    packages: [python3-pytest, python3-pytest-timeout, python3-tk]
snapshots:
  base:
    from: image:tests
"""

#: The shared project's ini: pytester through addopts, and the junit family in which record_xml_attribute writes.
PYTEST_INI = """\
[pytest]
addopts = -p pytester
junit_family = xunit1
"""

PROBES_CONFTEST = """\
import pytest

SEEN_IN_CONFIGURE = []


def pytest_addoption(parser):
    parser.addoption("--flavour", default="mild")
    parser.getgroup("probes").addoption("--sigint-probe", action="store_true", default=False)


def pytest_configure(config):
    SEEN_IN_CONFIGURE.append(config.getoption("flavour"))


@pytest.fixture(scope="session")
def announced():
    print("session fixture set up in the parent", flush=True)
    return "announced"
"""

CONFIGURATION = """\
import os
import time
import unittest
import uuid

import pytest

import conftest


def test_conftest_saw_the_option_in_pytest_configure():
    assert conftest.SEEN_IN_CONFIGURE == ["spicy"]


def test_pytester_from_the_ini_addopts(pytester):
    pytester.makepyfile("def test_inner():\\n    pass\\n")
    pytester.runpytest().assert_outcomes(passed=1)


def test_times_out_under_pytest_timeout():
    time.sleep(60)


def test_records_for_junit(record_property, record_xml_attribute, record_testsuite_property, announced):
    record_property("flavour", "spicy")
    record_xml_attribute("owner", "probes")
    record_testsuite_property("suite_run", "shared")


@pytest.mark.skipif(True, reason="never here")
def test_skipped():
    pass


@pytest.mark.xfail(reason="known")
def test_xfails():
    assert False


@pytest.mark.skipif("not config.getoption('sigint_probe')", reason="only for the Ctrl-C run")
def test_waits_for_sigint(announced):
    time.sleep(120)


class TestClassScope:
    @pytest.fixture(scope="class")
    def class_resource(self):
        return uuid.uuid4().hex

    @classmethod
    def setup_class(cls):
        cls.set_up_by = uuid.uuid4().hex

    def test_one(self, class_resource):
        print(f"class resource {class_resource} set up {self.set_up_by}")

    def test_two(self, class_resource):
        print(f"class resource {class_resource} set up {self.set_up_by}")


class TestUnittestClass(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.token = uuid.uuid4().hex

    def test_one(self):
        print(f"setUpClass ran once: {self.token}")

    def test_two(self):
        print(f"setUpClass ran once: {self.token}")
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


@pytest.mark.parametrize("n", range(6))
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


@pytest.mark.timeout(0)
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


@pytest.mark.timeout(0)
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

    def skip_reasons(self, name_part: str) -> dict[str, str]:
        """The skip message of each skipped case named as :meth:`outcomes` names it."""
        found = {}
        for case in self.junit.iter("testcase"):
            name = f"{case.get('classname')}.{case.get('name')}"
            skipped = case.find("skipped")
            if name_part in name and skipped is not None:
                found[name[name.index(name_part) :]] = skipped.get("message", "")
        return found

    def counts(self) -> dict[str, int]:
        values = list(self.outcomes("").values())
        return {kind: values.count(kind) for kind in ("passed", "failure", "error", "skipped")}


def unpack(archive: Path, into: Path) -> Path:
    """The sdist unpacked as published under ``into``: its one top folder."""
    with tarfile.open(archive) as opened:
        if hasattr(tarfile, "data_filter"):
            opened.extractall(into, filter="data")
        else:
            opened.extractall(into)
    return into / archive.name.removesuffix(".tar.gz")


def inner_env(shm_dir: Path, *, host_plugins: bool = True) -> dict[str, str]:
    """The inner runs' environment: the user's cache, a private shm folder, pytest-timeout on the host's side."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_FORKD_")}
    env.update(FORKD_SHM_DIR=str(shm_dir), FORKD_CACHE_DIR=str(USER_CACHE))
    for name in ("FORKD_STORE", "PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS"):
        env.pop(name, None)
    if host_plugins:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(host_pytest_timeout())]))
    return env


def run_pytest(cwd: Path, env: dict[str, str], *args: str, junit: Path, python: str = sys.executable) -> InnerRun:
    result = subprocess.run(
        [python, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", f"--junitxml={junit}", *args],
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
    """six's sdist unpacked as published with forkd.yaml added, probe tests beside it, pytest.ini and forkd.yaml
    at the top (the probes' rootdir)."""
    top = shared_dir / "project"
    with FileLock(shared_dir / "project.lock"):
        if not (top / "forkd.yaml").is_file():
            top.mkdir(exist_ok=True)
            six = unpack(sdist("six", "1.17.0"), top)
            (six / "forkd.yaml").write_text(FORKD_YAML)  # six's setup.cfg makes its folder the rootdir
            (top / "probes").mkdir()
            (top / "probes" / "conftest.py").write_text(PROBES_CONFTEST)
            (top / "probes" / "test_isolation_probes.py").write_text(PROBES)
            (top / "probes" / "test_configuration.py").write_text(CONFIGURATION)
            (top / "pytest.ini").write_text(PYTEST_INI)
            (top / "forkd.yaml").write_text(FORKD_YAML)
    return top


@pytest.fixture(scope="module")
def six_isolated(project: Path, shm_dir: Path, shared_store: Path, shared_dir: Path) -> InnerRun:
    """six's own test_six.py, every test in its own child VM."""

    def produce() -> InnerRun:
        run = run_pytest(
            project / "six-1.17.0",
            inner_env(shm_dir),
            "--forkd-isolate",
            f"--forkd-store={shared_store}",
            "-rA",
            "test_six.py",
            junit=shared_dir / "six-isolated.xml",
        )
        assert_nothing_left(shm_dir)
        return run

    return once(shared_dir, "six-isolated", produce)


@pytest.fixture(scope="module")
def six_on_host(project: Path, shared_dir: Path) -> InnerRun:
    """The same, on the host without forkd: the cases and counts to match."""

    def produce() -> InnerRun:
        env = inner_env(Path("/nonexistent"))
        return run_pytest(project / "six-1.17.0", env, "-p", "no:forkd", "test_six.py", junit=shared_dir / "six.xml")

    return once(shared_dir, "six-host", produce)


@pytest.fixture(scope="module")
def isolated(project: Path, shm_dir: Path, shared_store: Path, shared_dir: Path) -> InnerRun:
    """The probes, every test in its own child VM: with a conftest option, pytest-timeout and ``-s``."""

    def produce() -> InnerRun:
        run = run_pytest(
            project,
            inner_env(shm_dir),
            "--forkd-isolate",
            f"--forkd-store={shared_store}",
            "-rA",
            "-s",
            "--flavour=spicy",
            "--timeout=20",
            "probes",
            junit=shared_dir / "isolated.xml",
        )
        assert_nothing_left(shm_dir)
        return run

    return once(shared_dir, "isolated", produce)


def test_six_gives_the_same_cases_and_counts_in_junit_as_on_the_host(
    six_isolated: InnerRun, six_on_host: InnerRun
) -> None:
    in_vms = six_isolated.outcomes("test_six")
    on_the_host = six_on_host.outcomes("test_six")
    assert six_on_host.returncode == 0 and "skipped" in on_the_host.values(), six_on_host.output[-4000:]
    assert "INTERNALERROR" not in six_isolated.output, six_isolated.output[-6000:]
    assert six_isolated.returncode == 0, six_isolated.output[-6000:]
    explained = optional_module_differences(six_isolated, six_on_host)
    for case in explained:
        del in_vms[case], on_the_host[case]
    assert in_vms == on_the_host, six_isolated.output[-6000:]
    if not explained:
        assert six_isolated.counts() == six_on_host.counts()
    assert "forkd: copying" in six_isolated.output


#: six's skips for optional standard-library modules (test_six.py's test_move_items), and the module each
#: says is missing.
SIX_OPTIONAL_MODULES = {"requires tkinter": "_tkinter", "requires gdbm": "dbm.gnu", "requires ndbm": "dbm.ndbm"}


def importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def optional_module_differences(in_vms: InnerRun, on_the_host: InnerRun) -> set[str]:
    """The cases that differ only because the host's Python and the guest's have other optional modules.

    Root's Python here has tkinter and no ndbm, like the guest; Debian's, which a
    normal user's virtualenv runs, has ndbm and no tkinter. Each such case is
    skipped on one side for the module and passes on the other, and the host's
    side must agree with what this interpreter (the host run's) can import.
    """
    vms, host = in_vms.skip_reasons("test_six"), on_the_host.skip_reasons("test_six")
    vm_outcomes, host_outcomes = in_vms.outcomes("test_six"), on_the_host.outcomes("test_six")
    explained = set()
    for case in set(vm_outcomes) & set(host_outcomes):
        if vm_outcomes[case] == host_outcomes[case]:
            continue
        if host_outcomes[case] == "skipped" and vm_outcomes[case] == "passed":
            module = SIX_OPTIONAL_MODULES.get(host.get(case, ""))
            if module is not None and not importable(module):
                explained.add(case)
        elif vm_outcomes[case] == "skipped" and host_outcomes[case] == "passed":
            module = SIX_OPTIONAL_MODULES.get(vms.get(case, ""))
            if module is not None and importable(module):
                explained.add(case)
    return explained


def test_a_conftest_reads_the_command_lines_option_in_pytest_configure(isolated: InnerRun) -> None:
    outcomes = isolated.outcomes("test_configuration")
    assert outcomes["test_configuration.test_conftest_saw_the_option_in_pytest_configure"] == "passed", isolated.output[
        -6000:
    ]
    assert "INTERNALERROR" not in isolated.output


def test_pytester_from_the_ini_addopts_works_in_the_vm(isolated: InnerRun) -> None:
    outcomes = isolated.outcomes("test_configuration")
    assert outcomes["test_configuration.test_pytester_from_the_ini_addopts"] == "passed", isolated.output[-6000:]


def test_pytest_timeout_fails_the_test_that_overran_and_the_run_goes_on(isolated: InnerRun) -> None:
    failure = isolated.case("test_times_out_under_pytest_timeout").find("failure")
    assert failure is not None, isolated.output[-6000:]
    assert "Timeout" in (failure.get("message") or ""), failure.get("message")
    outcomes = isolated.outcomes("test_configuration")
    assert outcomes["test_configuration.test_records_for_junit"] == "passed"
    assert "INTERNALERROR" not in isolated.output


def test_class_scope_and_set_up_class_are_set_up_once_in_the_parent(isolated: InnerRun) -> None:
    # Under -s each line follows pytest's progress letters on the host's terminal.
    seen = re.findall(r"class resource ([0-9a-f]{32}) set up ([0-9a-f]{32})$", isolated.output, re.MULTILINE)
    assert len(seen) == 2 and len(set(seen)) == 1, isolated.output[-6000:]  # one class set-up, in the parent
    tokens = re.findall(r"setUpClass ran once: ([0-9a-f]{32})$", isolated.output, re.MULTILINE)
    assert len(tokens) == 2 and len(set(tokens)) == 1, isolated.output[-6000:]  # unittest's setUpClass too


def test_record_fixtures_reach_the_hosts_junit_xml(isolated: InnerRun) -> None:
    case = isolated.case("test_records_for_junit")
    assert case.get("owner") == "probes"
    assert [(p.get("name"), p.get("value")) for p in case.iter("property")] == [("flavour", "spicy")]
    suite = next(isolated.junit.iter("testsuite"))
    suite_properties = [(p.get("name"), p.get("value")) for p in suite.findall("properties/property")]
    assert ("suite_run", "shared") in suite_properties


def test_skips_and_xfails_come_back_as_such(isolated: InnerRun) -> None:
    outcomes = isolated.outcomes("test_configuration")
    assert outcomes["test_configuration.test_skipped"] == "skipped"
    assert outcomes["test_configuration.test_xfails"] == "skipped"
    assert outcomes["test_configuration.test_waits_for_sigint"] == "skipped"


def test_session_fixture_output_shows_under_s(isolated: InnerRun) -> None:
    assert "session fixture set up in the parent" in isolated.output


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
    assert failure is not None and "past its timeout of 5 s" in (failure.text or "")
    assert isolated.returncode == 1  # failed tests, not an interrupted run


def test_a_session_fixture_runs_once_in_the_parent_and_fresh_tests_get_their_own(isolated: InnerRun) -> None:
    # Under -s each line follows pytest's progress letters on the host's terminal.
    shared = set(re.findall(r"(?:^|[^a-z ])resource ([0-9a-f]{32})$", isolated.output, re.MULTILINE))
    fresh = set(re.findall(r"fresh resource ([0-9a-f]{32})$", isolated.output, re.MULTILINE))
    outcomes = isolated.outcomes("test_shares_the_slow_resource")
    assert len(outcomes) == 6 and set(outcomes.values()) == {"passed"}, isolated.output[-6000:]
    assert len(shared) == 1, isolated.output[-6000:]  # one set-up, inherited by all six children
    assert len(fresh) == 1 and fresh != shared


def test_sigint_during_an_isolated_test_ends_pytest_within_seconds_leaving_no_vm(
    project: Path, shm_dir: Path, shared_store: Path, tmp_path: Path
) -> None:
    output = tmp_path / "output.txt"
    with output.open("w") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", "--forkd-isolate",
             f"--forkd-store={shared_store}", "-s", "--sigint-probe", "-k", "test_waits_for_sigint", "probes"],
            cwd=project, env=inner_env(shm_dir), stdout=sink, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 900
        while "session fixture set up in the parent" not in output.read_text():
            assert process.poll() is None and time.monotonic() < deadline, output.read_text()[-4000:]
            time.sleep(0.5)
        time.sleep(5)  # the test's child is forked and its test sleeps
        assert process.poll() is None, output.read_text()[-4000:]
        interrupted = time.monotonic()
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)
        ended_after = time.monotonic() - interrupted
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = output.read_text()
    assert ended_after < 20, text[-4000:]
    assert "KeyboardInterrupt" in text, text[-4000:]
    assert process.returncode == pytest.ExitCode.INTERRUPTED, text[-4000:]
    assert_nothing_left(shm_dir)


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


def test_pluggys_own_suite_installed_editable_passes_in_vms_as_on_the_host(
    shm_dir: Path, shared_store: Path, tmp_path: Path
) -> None:
    """A src/ layout installed with ``pip install -e`` in a virtualenv: the guest's pytest, whose own pluggy
    is Debian's older one, imports the project's pluggy 1.5.0 from the copied src/ as the host does."""
    project = unpack(sdist("pluggy", "1.5.0"), tmp_path)
    (project / "forkd.yaml").write_text(FORKD_YAML)
    environment = tmp_path / "venv"
    venv.create(environment, with_pip=True)
    python = str(environment / "bin" / "python")
    installed = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "-e", str(project),
         "-e", str(REPOSITORY)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stdout + installed.stderr
    env = inner_env(shm_dir, host_plugins=False)
    on_host = run_pytest(project, env, "-p", "no:forkd", junit=tmp_path / "host.xml", python=python)
    assert on_host.returncode == 0 and on_host.counts()["passed"] == 109, on_host.output[-4000:]
    isolated = run_pytest(
        project, env, "--forkd-isolate", f"--forkd-store={shared_store}", junit=tmp_path / "vms.xml", python=python
    )
    assert isolated.returncode == 0, isolated.output[-6000:]
    assert isolated.outcomes("") == on_host.outcomes(""), isolated.output[-6000:]
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
