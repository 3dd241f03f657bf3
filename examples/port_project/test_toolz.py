"""The project's own tests, one test module per forked VM (see conftest.py)."""

from __future__ import annotations

from project import GUEST_SOURCE


def test_project_test_module_passes_in_its_own_vm(run_project_tests, project_test_module):
    result = run_project_tests(project_test_module)
    print(result.stdout[-2000:])  # pytest's summary line, shown with -s or when the test fails
    assert result.exit_code == 0, (
        f"{project_test_module} failed in the guest (exit {result.exit_code}):\n"
        f"{result.stdout[-4000:]}\n{result.stderr[-2000:]}"
    )
    assert " passed" in result.stdout


def test_the_tests_import_the_copied_source(forkd_vm):
    result = forkd_vm.exec(["python3", "-c", "import toolz; print(toolz.__file__, toolz.__version__)"], check=True)
    assert result.stdout.split() == [f"{GUEST_SOURCE}/toolz/__init__.py", "0.12.1"]
