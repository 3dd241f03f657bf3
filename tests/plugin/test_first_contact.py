"""What a new user meets first: mistakes in forkd.yaml, the ini file and the options are one usage line
(exit status 4) before any test runs, build progress keeps clear of pytest's progress line, and
``--forkd-report`` writes its page (no VM is started here; see test_first_contact_vms.py for builds).
"""

from __future__ import annotations

import re

import pytest


def assert_one_usage_line(result: pytest.RunResult, *patterns: str) -> None:
    """Exit status 4, nothing ran, no traceback: the error is one line matching ``patterns``."""
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    output = "\n".join(result.outlines + result.errlines)
    assert "Traceback" not in output and "INTERNALERROR" not in output, output
    assert not re.search(r"\b(passed|failed|error)\b in ", output), output  # no test ran
    errors = [line for line in result.errlines if line.startswith("ERROR: ")]
    assert len(errors) == 1, result.errlines
    for pattern in patterns:
        assert re.search(pattern, errors[0]), (pattern, errors[0])


TEST_FILE = "def test_x(forkd_vm):\n    pass\n"


def test_an_unknown_image_is_one_usage_line(pytester, run_forkd):
    pytester.makefile(".yaml", forkd="snapshots:\n  tools:\n    from: image:nosuch\n    setup: ['true']\n")
    pytester.makepyfile(TEST_FILE)
    result = run_forkd("--forkd-snapshot=tools")
    assert_one_usage_line(
        result,
        r"^ERROR: forkd\.yaml: snapshots\.tools\.from: no image named 'nosuch'",
        r"forkd image build --name nosuch",
        r"from: base",
    )


def test_an_unknown_image_behind_a_marker_is_one_usage_line(pytester, run_forkd):
    pytester.makefile(".yaml", forkd="snapshots:\n  base2:\n    from: tools\n  tools:\n    from: image:nosuch\n")
    pytester.makepyfile("import pytest\n\n@pytest.mark.forkd(snapshot='base2')\ndef test_x(forkd_vm):\n    pass\n")
    result = run_forkd()
    assert_one_usage_line(result, r"forkd\.yaml: snapshots\.tools\.from: no image named 'nosuch'")


def test_an_unknown_snapshot_is_one_usage_line(pytester, run_forkd, tmp_path):
    pytester.makepyfile(TEST_FILE)
    result = run_forkd("--forkd-snapshot=nosuch", store=tmp_path)
    assert_one_usage_line(result, r"unknown snapshot 'nosuch'", r"Declare 'nosuch' under `snapshots:`")


def test_an_unknown_forkd_yaml_field_is_one_usage_line(pytester, run_forkd):
    pytester.makefile(".yaml", forkd="snapshots:\n  web:\n    setpu: ['true']\n")
    pytester.makepyfile(TEST_FILE)
    result = run_forkd()
    assert_one_usage_line(
        result, r"forkd\.yaml: snapshots\.web\.setpu: unknown key; did you mean 'setup'\? valid keys: from, .*setup"
    )


def test_every_mistake_of_forkd_yaml_and_the_options_is_reported_in_one_run(pytester, run_forkd):
    """A misspelt top-level key, a misspelt budget field and a bad --forkd-budget: one run names all three."""
    pytester.makefile(".yaml", forkd="snapshot:\n  web: {}\nbudgets:\n  fork: {p95: 300}\n")
    pytester.makepyfile(TEST_FILE)
    result = run_forkd("--forkd-budget=exec.p59=5")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    output = "\n".join(result.outlines + result.errlines)
    assert "Traceback" not in output and not re.search(r"\b(passed|failed|error)\b in ", output), output
    errors = [line for line in result.errlines if line.startswith("ERROR: ")]
    assert errors == [
        "ERROR: forkd.yaml: snapshot: unknown key; did you mean 'snapshots'? "
        "valid keys: settings, images, snapshots, budgets",
        "ERROR: forkd.yaml: budgets.fork.p95: unknown key 'p95'; did you mean 'p95_ms'? "
        "valid keys: p50_ms, p95_ms, p99_ms, max_ms, mean_ms, backends",
        "ERROR: --forkd-budget 'exec.p59=5': unknown statistic 'p59'; did you mean 'p99'? "
        "valid statistics: p50, p95, p99, max, mean",
    ]


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("snapshots:\n  web:\n    from: base\n   setup: ['true']\n", 4),  # indentation
        ("snapshots:\n  web:\n    setup: ['true'\n", 3),  # unclosed list, found at the end of the file
        ("settings:\n  pool: 1\n\tbackend: full\n", 3),  # a tab
    ],
)
def test_a_yaml_syntax_error_names_the_file_and_line(pytester, run_forkd, text, line):
    pytester.makefile(".yaml", forkd=text)
    pytester.makepyfile(TEST_FILE)
    result = run_forkd()
    assert_one_usage_line(result, rf"^ERROR: forkd\.yaml: not valid YAML at line {line}, column \d+: ", r"; fix ")


def test_ini_keys_take_their_real_types(pytester, run_forkd):
    pytester.makepyprojecttoml(
        "[tool.pytest]\nforkd_pool = 0\nforkd_pool_prefill = true\nforkd_keep_failed_count = 2\n"
    )
    pytester.makeconftest(
        "def pytest_report_header(config):\n"
        "    from pytest_forkd.plugin.state import run_state\n"
        "    s = run_state(config).settings\n"
        "    return [f'resolved: pool={s.pool!r} prefill={s.pool_prefill!r} count={s.keep_failed_count!r} '\n"
        "            f'source={s.describe(\"pool\")}']\n"
    )
    pytester.makepyfile("def test_plain(): pass")
    result = run_forkd()
    assert result.ret == pytest.ExitCode.OK, result.errlines
    result.stdout.fnmatch_lines(["resolved: pool=0 prefill=True count=2 source=0 (from ini forkd_pool)"])


def test_a_bad_ini_value_names_the_key(pytester, run_forkd):
    pytester.makeini("[pytest]\nforkd_keep_failed = maybe\n")
    pytester.makepyfile("def test_plain(): pass")
    result = run_forkd()
    assert_one_usage_line(result, r"ini forkd_keep_failed: expected true or false")


def test_an_unset_ini_flag_leaves_forkd_yaml_in_charge(pytester, run_forkd):
    """A bool key pytest reads as False when unset would override forkd.yaml: unset stays unset."""
    pytester.makefile(".yaml", forkd="settings:\n  pool_prefill: true\n  pool: 3\n")
    pytester.makeconftest(
        "def pytest_report_header(config):\n"
        "    from pytest_forkd.plugin.state import run_state\n"
        "    s = run_state(config).settings\n"
        "    return [f'resolved: pool={s.pool!r} prefill={s.pool_prefill!r}']\n"
    )
    pytester.makepyfile("def test_plain(): pass")
    result = run_forkd()
    result.stdout.fnmatch_lines(["resolved: pool=3 prefill=True"])


PROGRESS_SUITE = """
from pytest_forkd.plugin.progress import progress_printer

def test_one(): pass

def test_two(request):
    progress = progress_printer(request.config)
    print("captured output stays captured")
    progress("forkd: building snapshot 'web' from 'base' (1 setup command)...")
    progress("forkd: built snapshot 'web' in 0.1 s")

def test_three(): pass
"""


def test_progress_lines_keep_clear_of_the_progress_line(pytester, run_forkd):
    pytester.makepyfile(test_suite=PROGRESS_SUITE)
    result = run_forkd()
    result.assert_outcomes(passed=3)
    lines = result.outlines
    start = lines.index("forkd: building snapshot 'web' from 'base' (1 setup command)...")
    assert lines[start - 1] == "test_suite.py ."  # pytest's line so far, ended before the progress
    assert lines[start + 1] == "forkd: built snapshot 'web' in 0.1 s"
    assert re.fullmatch(r"test_suite\.py \.\. +\[100%\]", lines[start + 2]), lines[start + 2]
    assert "captured output stays captured" not in result.stdout.str()


def test_progress_lines_keep_clear_of_quiet_dots(pytester, run_forkd):
    pytester.makepyfile(test_suite=PROGRESS_SUITE)
    result = run_forkd("-q")
    lines = result.outlines
    start = lines.index("forkd: building snapshot 'web' from 'base' (1 setup command)...")
    assert lines[start - 1] == "."
    assert re.fullmatch(r"\.\. +\[100%\]", lines[start + 2]), lines[start + 2]


def test_xdist_workers_print_no_progress(pytester, run_forkd):
    pytester.makepyfile(test_suite=PROGRESS_SUITE)
    result = run_forkd("-p", "xdist", "-n", "2")
    result.assert_outcomes(passed=3)
    assert "forkd: building snapshot" not in result.stdout.str() + result.stderr.str()


def test_the_html_report_of_a_run_without_vms(pytester, run_forkd):
    pytester.makepyfile(
        "import time\n\ndef test_quick(): pass\n\ndef test_slow():\n    time.sleep(0.3)\n\n"
        "def test_broken():\n    assert False\n"
    )
    result = run_forkd("--forkd-report=reports/run.html")
    result.assert_outcomes(passed=2, failed=1)
    page = (pytester.path / "reports" / "run.html").read_text(encoding="utf-8")
    result.stdout.fnmatch_lines([f"forkd: HTML report written to {pytester.path / 'reports' / 'run.html'}"])
    assert "No forkd operation was timed in this run." in page
    slowest = page[page.index("id='slowest'") :]
    assert slowest.index("test_slow") < slowest.index("test_quick")
    assert "1 failed, 2 passed" in page


def test_the_html_report_under_xdist_is_written_once_by_the_controller(pytester, run_forkd):
    pytester.makepyfile("\n".join(f"def test_{index}(): pass\n" for index in range(6)))
    result = run_forkd("-p", "xdist", "-n", "2", "--forkd-report=run.html")
    result.assert_outcomes(passed=6)
    page = (pytester.path / "run.html").read_text(encoding="utf-8")
    assert "6 passed" in page
    assert sorted(path.name for path in pytester.path.iterdir() if path.suffix == ".html") == ["run.html"]


def test_an_unwritable_report_path_is_one_usage_line(pytester, run_forkd):
    (pytester.path / "taken").mkdir()
    pytester.makepyfile("def test_plain(): pass")
    result = run_forkd("--forkd-report=taken")
    assert_one_usage_line(result, r"--forkd-report taken: it is a directory; name a file")


def test_an_unknown_snapshot_behind_a_marker_is_one_usage_line(pytester, run_forkd, tmp_path):
    pytester.makepyfile("import pytest\n\n@pytest.mark.forkd(snapshot='nosuch')\ndef test_x(forkd_vm):\n    pass\n")
    result = run_forkd(store=tmp_path)
    assert_one_usage_line(result, r"unknown snapshot 'nosuch'", r"Declare 'nosuch' under `snapshots:`")


def test_help_groups_the_options_by_purpose(pytester, run_forkd):
    """``pytest --help`` shows the forkd options in three groups, each setting with its ini key and env name."""
    result = run_forkd("--help")
    assert result.ret == 0
    text = "\n".join(result.outlines)
    headings = ["pytest-forkd: VMs and snapshots:", "pytest-forkd: timings, budgets and baselines:"]
    headings.append("pytest-forkd: reports:")
    starts = [text.index(heading) for heading in headings]
    assert starts == sorted(starts)
    sections = [text[start:end] for start, end in zip(starts, [*starts[1:], len(text)])]
    sections[-1] = sections[-1].split("\n\n")[0]  # the reports group ends where pytest's next section begins
    members = {
        0: ["--forkd-snapshot", "--forkd-pool", "--forkd-keep-failed", "--forkd-store-max-size"],
        1: ["--forkd-budget", "--forkd-save", "--forkd-compare", "--forkd-compare-fail", "--forkd-compare-strict"],
        2: ["--forkd-json", "--forkd-report", "--forkd-transcript"],
    }
    for index, flags in members.items():
        for flag in flags:
            found = [
                number for number, section in enumerate(sections) if re.search(rf"^  {flag}(?![\w-])", section, re.M)
            ]
            assert found == [index], (flag, found)
    assert re.search(r"Also\s+ini\s+forkd_snapshot,\s+env\s+PYTEST_FORKD_SNAPSHOT", sections[0])


def test_the_header_names_the_image_a_forkd_image_run_starts_from(pytester, run_forkd, tmp_path):
    pytester.makepyfile(TEST_FILE)
    result = run_forkd("--forkd-image=127.0.0.1:5055/trial/bb:1", "--collect-only", store=tmp_path)
    assert result.ret == 0
    result.stdout.fnmatch_lines(["forkd: image docker://127.0.0.1:5055/trial/bb:1 (from --forkd-image), backend *"])
    assert "forkd: snapshot" not in result.stdout.str()
    plain = run_forkd("--collect-only", store=tmp_path)
    plain.stdout.fnmatch_lines(["forkd: snapshot base (from default), backend *"])


def test_an_image_failure_leads_with_its_reason_and_only_the_first_test_gets_the_builders_lines(pytestconfig):
    from types import SimpleNamespace

    from pytest_forkd.errors import ImageBuildError, ImageNotFound, RegistryUnreachable
    from pytest_forkd.plugin.fixtures import image_failure

    session = SimpleNamespace(settings=SimpleNamespace(image="docker://127.0.0.1:5000/app:1"))
    build = ImageBuildError(
        "podman build of /src/Dockerfile failed (exit 1); its last lines:\nSTEP 2/2: RUN false\nError"
    )
    first = image_failure(pytestconfig, session, build)
    again = image_failure(pytestconfig, session, build)
    assert first.startswith("image build failed: podman build of /src/Dockerfile failed") and "RUN false" in first
    assert "\n" not in again and again.endswith("(the first test's error shows the rest)")
    missing = ImageNotFound("docker://127.0.0.1:5000/app:1: no such repository or tag in 127.0.0.1:5000")
    assert image_failure(pytestconfig, session, missing).startswith("image not found: docker://127.0.0.1:5000/app:1:")
    unnamed = RegistryUnreachable("cannot connect to 127.0.0.1:5000: connection refused")
    line = image_failure(pytestconfig, session, unnamed)
    assert line.startswith("registry unreachable: ") and line.endswith("(--forkd-image docker://127.0.0.1:5000/app:1)")
