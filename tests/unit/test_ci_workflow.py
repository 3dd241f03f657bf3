"""The GitHub Actions workflow users copy (examples/ci/forkd-latency.yml) against what the plugin really uses.

Ubuntu runners cannot be run here, so everything that can be checked without
one is: the runner image, the /dev/kvm udev rule, the QEMU package, the cache
path and its key's inputs, every ``--forkd-*`` option, the ``forkd`` commands,
and that baselines are downloaded to, and uploaded from, the folder where the
plugin reads and writes them.
"""

from __future__ import annotations

import glob
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from _pytest.config.argparsing import Parser

from pytest_forkd import paths, plugin
from pytest_forkd.cli import build_parser, doctor_cmd
from pytest_forkd.engine.qemu.host import QEMU_PACKAGE
from pytest_forkd.latency import compare as comparing
from pytest_forkd.latency import runs

REPO = Path(__file__).resolve().parents[2]
WORKFLOW_FILE = REPO / "examples" / "ci" / "forkd-latency.yml"


@pytest.fixture(scope="module")
def workflow() -> dict[str, Any]:
    return yaml.safe_load(WORKFLOW_FILE.read_text())


@pytest.fixture(scope="module")
def job(workflow: dict[str, Any]) -> dict[str, Any]:
    (only,) = workflow["jobs"].values()
    return only


def step(job: dict[str, Any], name_part: str) -> dict[str, Any]:
    matches = [s for s in job["steps"] if name_part.lower() in s.get("name", "").lower()]
    assert len(matches) == 1, f"one step named like {name_part!r} expected, found {len(matches)}"
    return matches[0]


def uses(job: dict[str, Any], action: str) -> list[dict[str, Any]]:
    return [s for s in job["steps"] if s.get("uses", "").startswith(action + "@")]


def command_words(script: str) -> list[list[str]]:
    """The shell commands of a ``run:`` script, line continuations joined, split into words."""
    joined = script.replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in joined.splitlines() if line.strip()]


def plugin_options() -> set[str]:
    parser = Parser(_ispytest=True)
    plugin.pytest_addoption(parser)
    return {name for group in parser._groups for option in group.options for name in option.names()}


def test_it_runs_on_ubuntu_24_04_on_pushes_to_main_and_pull_requests(workflow: dict[str, Any], job: dict) -> None:
    triggers = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as true
    assert set(triggers) == {"push", "pull_request"}
    assert job["runs-on"] == "ubuntu-24.04"
    assert job["timeout-minutes"] <= 60


def test_the_runner_user_gets_dev_kvm_through_a_udev_rule(job: dict) -> None:
    script = step(job, "/dev/kvm")["run"]
    rule = re.search(r"'(KERNEL==\"kvm\"[^']*)'", script)
    assert rule, "a udev rule for the kvm node"
    fields = dict(re.findall(r'(\w+)\+?=+"([^"]*)"', rule.group(1)))
    assert fields["KERNEL"] == "kvm" and fields["GROUP"] == "kvm"
    assert int(fields["MODE"], 8) & 0o006 == 0o006, "the runner user is not in group kvm: others need rw"
    assert "/etc/udev/rules.d/" in script
    assert "udevadm control --reload-rules" in script and "udevadm trigger --name-match=kvm" in script


def test_qemu_is_installed_from_the_package_the_plugin_names(job: dict) -> None:
    words = [w for line in command_words(step(job, "Install QEMU")["run"]) for w in line]
    assert QEMU_PACKAGE in words
    assert "qemu-system-x86_64" in step(job, "Install QEMU")["run"]


def test_the_cache_holds_the_plugin_cache_dir_keyed_by_recipe_and_qemu(
    job: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    (cache,) = uses(job, "actions/cache")
    monkeypatch.setenv("HOME", "/home/runner")
    for name in ("FORKD_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    assert Path(cache["with"]["path"].replace("~", "/home/runner")) == paths.cache_dir()
    key = cache["with"]["key"]
    assert "steps.qemu.outputs.version" in key  # snapshots are only valid for one QEMU version
    patterns = re.findall(r"'([^']+)'", re.search(r"hashFiles\(([^)]*)\)", key).group(1))
    assert "pytest_forkd/image/**" in patterns  # the recipe (default.yaml) and the builder
    assert "examples/forkd.yaml" in patterns  # the suite's snapshot recipes
    for pattern in patterns:
        assert glob.glob(str(REPO / pattern), recursive=True), f"hashFiles pattern {pattern!r} matches nothing"
    assert (REPO / "pytest_forkd" / "image" / "default.yaml").is_file()


def test_setup_uses_a_make_target_that_exists(job: dict) -> None:
    words = command_words(step(job, "Set up")["run"])
    assert words == [["make", "setup"]]
    assert re.search(r"^setup:", (REPO / "Makefile").read_text(), re.M)


def test_the_suite_runs_in_the_examples_rootdir_with_real_options(job: dict) -> None:
    suite = step(job, "regression gate")
    assert suite["working-directory"] == "examples"
    assert (REPO / "examples" / "pytest.ini").is_file(), "examples/ must be its own rootdir"
    (command,) = command_words(suite["run"])
    assert command[0] == "../.venv/bin/pytest"
    known = plugin_options()
    used = [word.split("=", 1)[0] for word in command if word.startswith("--")]
    assert {"--forkd-snapshot", "--forkd-autosave", "--forkd-compare", "--forkd-compare-fail"} <= set(used)
    assert set(used) <= known, f"options the plugin does not have: {set(used) - known}"
    for word in command:
        if word.startswith("--forkd-compare-fail="):
            comparing.parse_compare_fail(word.split("=", 1)[1])
        if word.startswith("--forkd-budget="):
            pytest.fail("budgets belong in examples/forkd.yaml, where they are set for TCG")


def test_baselines_are_restored_and_saved_where_the_plugin_keeps_them(job: dict) -> None:
    plugin_dir = runs.storage_dir(REPO / "examples").parent  # <rootdir>/.forkd/benchmarks
    expected = plugin_dir.relative_to(REPO).as_posix()
    (download,) = uses(job, "dawidd6/action-download-artifact")
    uploads = {s["with"]["name"]: s for s in uses(job, "actions/upload-artifact")}
    assert download["with"]["path"] == expected
    assert download["with"]["workflow"] == WORKFLOW_FILE.name
    assert download.get("continue-on-error") is True  # the very first run has no baseline
    saved = uploads[download["with"]["name"]]
    assert saved["with"]["path"] == expected
    assert saved["with"].get("include-hidden-files") is True  # .forkd is a hidden folder
    assert saved["if"] == "github.ref == 'refs/heads/main'"


def test_baselines_are_kept_per_accelerator_from_forkd_doctor(job: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """A TCG run is never compared with a KVM baseline: the artifact is named after the accelerator used."""
    (download,) = uses(job, "dawidd6/action-download-artifact")
    assert download["with"]["name"].endswith("${{ steps.accel.outputs.accel }}")
    accel_step = step(job, "accelerator")
    assert accel_step["id"] == "accel"
    assert ".venv/bin/forkd doctor --json" in accel_step["run"] and '["accel"]' in accel_step["run"]
    args = build_parser().parse_args(["doctor", "--json"])
    assert args.json is True
    monkeypatch.setattr(
        doctor_cmd,
        "collect",
        lambda accel: [
            doctor_cmd.Check("qemu", True, "qemu 8.2.2"),
            doctor_cmd.Check("accel", True, "kvm: probe ok", value="kvm"),
        ],
    )
    assert doctor_cmd.as_json(doctor_cmd.collect("auto"))["accel"] == "kvm"


def test_the_json_report_is_written_where_it_is_uploaded(job: dict) -> None:
    (command,) = command_words(step(job, "regression gate")["run"])
    (report,) = [w.split("=", 1)[1] for w in command if w.startswith("--forkd-json=")]
    uploads = {s["with"]["name"]: s for s in uses(job, "actions/upload-artifact")}
    assert uploads["forkd-report"]["with"]["path"] == f"examples/{report}"
    assert uploads["forkd-report"]["if"] == "always()"


def test_the_mirror_variable_is_the_one_the_image_builder_reads(job: dict) -> None:
    mirror = pytest.importorskip("pytest_forkd.image.mirror", reason="image builder without mirror settings")
    assert mirror.MIRROR_ENV in job["env"]
    assert "://" not in job["env"][mirror.MIRROR_ENV], "no mirror host name in the example; it is a variable"


def test_the_budgets_the_workflow_relies_on_exist_in_forkd_yaml() -> None:
    budgets = yaml.safe_load((REPO / "examples" / "forkd.yaml").read_text())["budgets"]
    assert {"fork", "exec"} <= set(budgets)
    # Set for TCG on a busy host (exec p95 reached 3.1 s there, with cold Python starts in the guest).
    assert budgets["fork"]["p95_ms"] >= 5000 and budgets["exec"]["p95_ms"] >= 10000


def test_the_host_report_runs_quick_after_the_accelerator_probe_and_is_uploaded(job: dict) -> None:
    """`forkd bench --report DIR --quick` on the runner's own accelerator, its DIR uploaded per accelerator."""
    names = [s.get("name", "") for s in job["steps"]]
    report_step = step(job, "Bench report of this runner")
    assert names.index(report_step["name"]) > names.index(step(job, "find the accelerator")["name"])
    (command,) = command_words(report_step["run"])
    assert command[:2] == [".venv/bin/forkd", "bench"]
    args = build_parser().parse_args(command[1:])
    assert args.report is not None and args.quick is True
    assert args.accel == "auto", "the report measures the accelerator the runner really has"
    uploads = {s["with"]["name"]: s for s in uses(job, "actions/upload-artifact")}
    upload = uploads["forkd-bench-report-${{ steps.accel.outputs.accel }}"]
    assert upload["with"]["path"] == str(args.report)
    assert upload["if"] == "always()"
