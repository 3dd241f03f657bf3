"""A pytest suite on a container image: forkd.yaml ``from: docker://...``, ``dockerfile:``, ``--forkd-image``.

The image is a Debian root with bash and python3 made by the tests and pushed
to a real registry on 127.0.0.1 (:mod:`registry`); the Dockerfile variant
builds FROM it with podman.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from registry import Registry

pytestmark = pytest.mark.vm

SUITE = """
import pytest

def test_the_image_config_and_the_setup_step_apply(forkd_vm):
    result = forkd_vm.exec("echo $FORKD_IMAGE $APP_MODE; pwd; cat /work/setup-done; cat /work/README")
    assert result.stdout.splitlines() == ["debian test", "/work", "ran", "{readme}"], result.stderr
    assert forkd_vm.exec(["python3", "-c", "import sys; print(sys.version_info[0])"]).stdout == "3\\n"
    assert forkd_vm.exec(["bash", "-c", "echo $BASH_VERSION"]).exit_code == 0

def test_a_child_writes_system_files(forkd_vm):
    forkd_vm.exec("echo dirty > /etc/forkd-marker && rm -f /usr/bin/env", check=True)

def test_its_sibling_sees_none_of_it(forkd_vm):
    assert forkd_vm.exec("test -e /etc/forkd-marker").exit_code == 1
    assert forkd_vm.exec("test -x /usr/bin/env").exit_code == 0

def test_a_checkpoint_rollback_restores_usr(forkd_vm):
    checkpoint = forkd_vm.checkpoint()
    forkd_vm.exec("rm -rf /usr/lib/python3* /usr/bin/python3*")
    assert forkd_vm.exec("test -e /usr/bin/python3").exit_code != 0
    checkpoint.rollback()
    assert forkd_vm.exec(["python3", "-c", "print(40 + 2)"]).stdout == "42\\n"
"""
README = "a Debian image for forkd tests"
FORKD_YAML = """
settings:
  snapshot: app
snapshots:
  app:
    from: {source}
    env: {{APP_MODE: test}}
    setup:
      - python3 -c "open('/work/setup-done', 'w').write('ran\\\\n')"
"""


def test_a_suite_runs_on_a_registry_image_named_in_forkd_yaml(
    pytester: pytest.Pytester, run_forkd: Callable[..., pytest.RunResult], debian_image: str, tmp_path: Path
) -> None:
    (pytester.path / "forkd.yaml").write_text(FORKD_YAML.format(source=debian_image))
    pytester.makepyfile(test_on_image=SUITE.format(readme=README))
    result = run_forkd("-p", "no:randomly", store=tmp_path / "store")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines([f"*building snapshot 'app' from image '{debian_image}'*"])


def _podman_problem() -> str | None:
    if shutil.which("podman") is None:
        return "podman is not installed (apt-get install podman, or scripts/setup.sh --test-tools)"
    probe = subprocess.run(["podman", "info"], capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        return f"podman does not work here: {(probe.stderr.strip().splitlines() or ['?'])[-1]}"
    return None


def test_the_same_suite_passes_on_an_image_built_from_a_dockerfile_with_podman(
    pytester: pytest.Pytester,
    run_forkd: Callable[..., pytest.RunResult],
    debian_image: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    problem = _podman_problem()
    if problem:
        pytest.skip(problem)
    base = debian_image.removeprefix("docker://")
    # podman reads a plain-HTTP registry's FROM only where registries.conf says it is insecure.
    registries = tmp_path / "registries.conf"
    registries.write_text(f'[[registry]]\nlocation = "{base.split("/", 1)[0]}"\ninsecure = true\n')
    monkeypatch.setenv("CONTAINERS_REGISTRIES_CONF", str(registries))
    (pytester.path / "image").mkdir()
    (pytester.path / "image" / "Dockerfile").write_text(
        f"FROM {base}\nENV APP_BUILT=yes\nRUN echo built > /etc/built-by-podman\n"
    )
    (pytester.path / "forkd.yaml").write_text(FORKD_YAML.format(source="dockerfile:image/Dockerfile"))
    suite = SUITE.format(readme=README) + (
        "\ndef test_the_build_ran(forkd_vm):\n"
        "    assert forkd_vm.exec('cat /etc/built-by-podman; echo $APP_BUILT').stdout == 'built\\nyes\\n'\n"
    )
    pytester.makepyfile(test_on_image=suite)
    result = run_forkd("-p", "no:randomly", store=tmp_path / "store")
    result.assert_outcomes(passed=5)


def test_forkd_image_runs_a_suite_on_an_image_with_no_forkd_yaml(
    pytester: pytest.Pytester, run_forkd: Callable[..., pytest.RunResult], debian_image: str, tmp_path: Path
) -> None:
    pytester.makepyfile(
        test_plain="""
def test_runs_in_the_image(forkd_vm):
    assert forkd_vm.exec("echo $FORKD_IMAGE; pwd").stdout == "debian\\n/work\\n"
"""
    )
    result = run_forkd(f"--forkd-image={debian_image}", store=tmp_path / "store")
    result.assert_outcomes(passed=1)
    both = run_forkd(f"--forkd-image={debian_image}", "--forkd-snapshot=base", store=tmp_path / "store")
    assert both.ret == pytest.ExitCode.USAGE_ERROR
    both.stderr.fnmatch_lines(["*--forkd-image*--forkd-snapshot*give one*"])


def test_a_moved_tag_pulled_again_rebuilds_the_snapshots_built_on_it(
    pytester: pytest.Pytester,
    run_forkd: Callable[..., pytest.RunResult],
    registry: Registry,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from oci_images import push, write_busybox_image

    reference = registry.reference("forkd-tests/moving:1")
    push(write_busybox_image(tmp_path / "first", tag="1"), reference)
    (pytester.path / "forkd.yaml").write_text(
        f"settings:\n  snapshot: moving\nsnapshots:\n  moving:\n    from: {reference}\n"
    )
    pytester.makepyfile(
        test_user="""
import os

def test_user(forkd_vm):
    assert forkd_vm.exec("id -u").stdout == os.environ["EXPECTED_UID"] + "\\n"
"""
    )
    monkeypatch.setenv("EXPECTED_UID", "0")
    first = run_forkd("-s", store=tmp_path / "store")
    first.assert_outcomes(passed=1)

    push(write_busybox_image(tmp_path / "second", tag="1", user="app"), reference)  # the tag moves
    cached = run_forkd("-s", store=tmp_path / "store")  # policy missing: the image pulled before, offline
    cached.assert_outcomes(passed=1)
    cached.stdout.fnmatch_lines(["*using cached snapshot 'moving'*"])

    monkeypatch.setenv("EXPECTED_UID", "1000")
    moved = run_forkd("-s", "--forkd-pull=always", store=tmp_path / "store")
    moved.assert_outcomes(passed=1)
    moved.stdout.fnmatch_lines(["*building snapshot 'moving'*"])
