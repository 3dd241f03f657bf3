"""A suite whose image cannot be had, against the tests' real registry: one short line per test, asked once.

``pytest --forkd-image`` naming a tag the registry does not have (or a registry
nobody runs) fails each test with one line that leads with the reason and
names the reference: no internal traceback, no INTERNALERROR, and the registry
is asked once per session, not once per test. No VM starts: the image is
looked up before anything boots.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from registry import Registry, free_port, needs_registry

pytestmark = [pytest.mark.slow, needs_registry]

SUITE = """
import pytest

@pytest.fixture(scope="session")
def prepared(forkd_parent):
    return forkd_parent

def test_a(forkd_vm): pass
def test_b(forkd_vm): pass
def test_c(forkd_vm): pass
def test_d(prepared): pass
"""


@pytest.fixture
def counted_skopeo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """skopeo behind a wrapper that logs each of its commands, first on PATH: the log file."""
    real = shutil.which("skopeo")
    assert real is not None
    log = tmp_path / "skopeo-calls.log"
    wrappers = tmp_path / "bin"
    wrappers.mkdir()
    wrapper = wrappers / "skopeo"
    wrapper.write_text(f'#!/bin/sh\necho "$1" >> "{log}"\nexec "{real}" "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{wrappers}{os.pathsep}{os.environ['PATH']}")
    return log


def assert_one_line_per_test(result: pytest.RunResult, title: str, reference: str) -> list[str]:
    """Every test erred with one line leading with ``title`` and naming ``reference``; the lines of the report."""
    output = result.outlines + result.errlines
    text = "\n".join(output)
    assert "Traceback" not in text and "INTERNALERROR" not in text, text
    assert "pytest_forkd" not in text.split("short test summary info")[-1], text  # no module path in the summary
    result.assert_outcomes(errors=4)
    errors = text.split("= ERRORS =")[1].split("short test summary info")[0]
    reports = [block for block in re.split(r"\n_+ ERROR at setup of \w+ _+\n", errors)[1:]]
    assert len(reports) == 4, errors
    for report in reports:
        assert report.strip().startswith(f"{title}: ") and reference in report, report
    summary = [line for line in result.outlines if line.startswith("ERROR ")]
    assert len(summary) == 4 and all(f" - Failed: {title}: " in line for line in summary), summary
    return output


def test_a_missing_tag_fails_each_test_in_one_line_and_the_registry_is_asked_once(
    pytester: pytest.Pytester,
    run_forkd: Callable[..., pytest.RunResult],
    registry: Registry,
    counted_skopeo: Path,
    tmp_path: Path,
) -> None:
    reference = f"{registry.host}/forkd-tests/no-such-image:missing-tag"
    pytester.makepyfile(test_suite=SUITE)

    result = run_forkd(f"--forkd-image={reference}", "-p", "no:randomly", store=tmp_path / "store")

    output = assert_one_line_per_test(result, "image not found", f"docker://{reference}")
    assert len(output) < 80, "\n".join(output)
    result.stdout.fnmatch_lines([f"forkd: image docker://{reference} (from --forkd-image), backend *"])
    calls = counted_skopeo.read_text().split()
    assert calls.count("inspect") == 1, calls  # once for the session, not once per test
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_a_registry_nobody_runs_fails_each_test_in_one_line(
    pytester: pytest.Pytester, run_forkd: Callable[..., pytest.RunResult], tmp_path: Path
) -> None:
    reference = f"127.0.0.1:{free_port()}/forkd-tests/app:1"
    pytester.makepyfile(test_suite=SUITE)

    result = run_forkd(f"--forkd-image={reference}", store=tmp_path / "store")

    output = assert_one_line_per_test(result, "registry unreachable", reference)
    assert len(output) < 80, "\n".join(output)
