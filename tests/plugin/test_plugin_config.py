"""The plugin's configuration errors and its inertness, through real pytest runs (no VM is started)."""

from __future__ import annotations

import pytest


def test_forkd_yaml_errors_name_the_field_path(pytester, run_forkd):
    pytester.makefile(".yaml", forkd="snapshots:\n  web:\n    setup: [make, build, 3]\n")
    pytester.makepyfile("def test_x(): pass")
    result = run_forkd()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*forkd.yaml: snapshots.web.setup[[]2[]]: expected a string*"])


def test_unknown_snapshot_lists_the_available_ones(pytester, run_forkd, tmp_path):
    pytester.makefile(".yaml", forkd="snapshots:\n  tools: {setup: ['true']}\n")
    pytester.makepyfile("def test_x(): pass")
    result = run_forkd("--forkd-snapshot=nope", store=tmp_path)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*unknown snapshot 'nope': declared snapshots: base, tools; other snapshots in *"])


def test_bad_marker_fails_before_any_vm_starts(pytester, run_forkd):
    pytester.makepyfile("""
        import pytest

        @pytest.mark.forkd(backend="zfs")
        def test_x(forkd_vm): pass
    """)
    result = run_forkd()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "*forkd marker on test_bad_marker_fails_before_any_vm_starts.py::test_x: "
            "backend: unknown storage backend 'zfs'*"
        ]
    )


def test_bad_option_value(pytester, run_forkd, monkeypatch):
    monkeypatch.setenv("PYTEST_FORKD_POOL", "lots")
    pytester.makepyfile("def test_x(): pass")
    result = run_forkd()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*PYTEST_FORKD_POOL: expected a whole number >= 0*"])


@pytest.mark.vm  # boots QEMU in the inner pytest run
def test_plugin_is_inert_without_forkd_fixtures(pytester, run_forkd, shm_dir):
    pytester.makepyfile("def test_plain(): assert 1 + 1 == 2")
    result = run_forkd("--forkd-budget=fork.p95=1")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["forkd: engine QEMU *", "forkd: snapshot base (from default), backend diff*"])
    result.stdout.no_fnmatch_line("*-- forkd --*")
    assert not shm_dir.exists()  # no run directory, so no VM, was ever created
