"""forkd.yaml's settings.debian_mirror reaches the image builder of a pytest run (no VM is started)."""

from __future__ import annotations

import pytest


def test_forkd_yaml_names_the_mirror_of_guest_images(pytester, run_forkd, monkeypatch):
    monkeypatch.delenv("FORKD_DEBIAN_MIRROR", raising=False)
    pytester.makefile(".yaml", forkd="settings:\n  debian_mirror: http://192.0.2.10/debian/\n")
    pytester.makepyfile("""
        from pytest_forkd.image.mirror import find_mirror

        def test_mirror():
            mirror = find_mirror()
            assert (mirror.url, mirror.origin) == ("http://192.0.2.10/debian", "forkd.yaml settings.debian_mirror")
    """)
    run_forkd().assert_outcomes(passed=1)


def test_the_environment_overrides_forkd_yaml(pytester, run_forkd, monkeypatch):
    monkeypatch.setenv("FORKD_DEBIAN_MIRROR", "http://192.0.2.11/debian")
    pytester.makefile(".yaml", forkd="settings:\n  debian_mirror: http://192.0.2.10/debian\n")
    pytester.makepyfile("""
        from pytest_forkd.image.mirror import find_mirror

        def test_mirror():
            assert find_mirror().url == "http://192.0.2.11/debian"
    """)
    run_forkd().assert_outcomes(passed=1)


def test_a_mirror_that_is_not_a_url_is_a_usage_error(pytester, run_forkd):
    pytester.makefile(".yaml", forkd="settings:\n  debian_mirror: mirror.example/debian\n")
    pytester.makepyfile("def test_x(): pass")
    result = run_forkd()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*forkd.yaml settings.debian_mirror: 'mirror.example/debian' is not a mirror URL*"])
