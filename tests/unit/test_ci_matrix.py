"""examples/ci/forkd-matrix.yml: its stages fit together and its commands are ones forkd really accepts.

Every ``forkd`` command line of the workflow is parsed by the real ``forkd``
argument parser, every ``--forkd-*`` option of its pytest runs must be one
the plugin registers, and the files one job writes are the files the next
job reads.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from pytest_forkd import plugin
from pytest_forkd.archives.archive import SUFFIX
from pytest_forkd.cli import build_parser
from pytest_forkd.project.config import BASE_SNAPSHOT, load_project

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / "examples" / "ci" / "forkd-matrix.yml"
SHELL_BREAKS = {";", "&&", "||", "|", ">", ">>", "<", "do", "done", "then", "fi"}


@pytest.fixture(scope="module")
def workflow() -> dict[str, Any]:
    return yaml.safe_load(WORKFLOW.read_text())


def steps(workflow: dict[str, Any], job: str) -> list[dict[str, Any]]:
    return workflow["jobs"][job]["steps"]


def scripts(workflow: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(job, working directory, script) of every ``run:`` step."""
    found = []
    for name, job in workflow["jobs"].items():
        for step in job["steps"]:
            if "run" in step:
                found.append((name, step.get("working-directory", "."), step["run"]))
    return found


def command_lines(script: str, env: dict[str, str]) -> list[list[str]]:
    """The script's simple commands as argument lists, ``$(...)`` included, variables filled in."""
    text = script.replace("\\\n", " ")
    text = re.sub(r"\$\{\{[^}]*\}\}", "0", text)
    for variable, value in env.items():
        text = text.replace(f"${variable}", value)
    text = text.replace("$name", "base").replace('"$archive"', "../forkd-archives/base" + SUFFIX)
    lines = []
    for line in text.splitlines():
        pieces = [line] + re.findall(r"\$\(([^()]*)\)", line)
        for piece in pieces:
            try:
                words = shlex.split(piece, comments=True)
            except ValueError:
                continue
            current: list[str] = []
            for word in words + [";"]:
                if word in SHELL_BREAKS or word.endswith(";"):
                    if word.endswith(";") and word != ";":
                        current.append(word[:-1])
                    if current:
                        lines.append(current)
                    current = []
                else:
                    current.append(word)
    return lines


def invocations(workflow: dict[str, Any], program: str) -> list[tuple[str, str, list[str]]]:
    """(job, working directory, arguments) of every run of ``program`` (forkd or pytest)."""
    env = {key: str(value) for key, value in workflow.get("env", {}).items()}
    found = []
    for job, directory, script in scripts(workflow):
        for words in command_lines(script, env):
            for index, word in enumerate(words):
                if word == program or word.endswith(f"/{program}"):
                    found.append((job, directory, words[index + 1 :]))
                    break
    return found


def plugin_options() -> set[str]:
    """Every command-line option pytest-forkd's plugin registers."""
    names: set[str] = set()

    class Recorder:
        def getgroup(self, *args: Any, **kwargs: Any) -> Recorder:
            return self

        def addoption(self, *flags: str, **kwargs: Any) -> None:
            names.update(flags)

        def addini(self, *args: Any, **kwargs: Any) -> None:
            pass

    plugin.pytest_addoption(Recorder())  # type: ignore[arg-type]
    return names


def test_three_stages_build_once_shard_then_gate(workflow: dict[str, Any]) -> None:
    jobs = workflow["jobs"]
    assert set(jobs) == {"snapshots", "shard", "gate"}
    assert jobs["shard"]["needs"] == "snapshots" and jobs["gate"]["needs"] == "shard"
    shards = jobs["shard"]["strategy"]["matrix"]["shard"]
    assert shards == list(range(int(workflow["env"]["SHARDS"])))
    assert jobs["shard"]["strategy"]["fail-fast"] is False


def test_every_forkd_command_parses_with_the_real_cli(workflow: dict[str, Any]) -> None:
    runs = invocations(workflow, "forkd")
    parser = build_parser()
    for job, _directory, args in runs:
        try:
            parser.parse_args(args)
        except SystemExit:
            pytest.fail(f"job {job}: `forkd {' '.join(args)}` is not accepted by forkd")
    used = {tuple(args[:2]) for _job, _directory, args in runs}
    assert {
        ("snapshots", "key"),
        ("snapshots", "build"),
        ("snapshots", "export"),
        ("snapshots", "import"),
        ("merge", "forkd-shards"),
        ("compare", "forkd-baseline/forkd-merged.json"),
    } <= used


def test_every_pytest_option_is_one_the_plugin_or_pytest_xdist_accepts(workflow: dict[str, Any]) -> None:
    known = plugin_options()
    runs = invocations(workflow, "pytest")
    assert runs, "the workflow runs no pytest"
    for job, _directory, args in runs:
        for word in args:
            if word.startswith("--forkd"):
                assert word.split("=", 1)[0] in known, f"job {job}: pytest-forkd has no option {word}"
    shard_run = next(args for job, _directory, args in runs if job == "shard" and "-n" in args)
    assert "xdist" in shard_run  # -p xdist: installed by the dev extra the shards install
    assert "pytest-xdist" in (ROOT / "pyproject.toml").read_text()


def test_snapshots_named_exist_in_the_project_file(workflow: dict[str, Any]) -> None:
    names = workflow["env"]["FORKD_SNAPSHOTS"].split()
    for job, directory, args in invocations(workflow, "forkd"):
        if args[:2] in (["snapshots", "key"], ["snapshots", "build"]):
            config = ROOT / directory / args[args.index("--config") + 1]
            project = load_project(config)
            assert set(names) <= {BASE_SNAPSHOT, *project.snapshots}, f"job {job}: undeclared snapshot"


def test_files_flow_from_job_to_job(workflow: dict[str, Any]) -> None:
    build_steps = steps(workflow, "snapshots")
    shard_steps = steps(workflow, "shard")
    gate_steps = steps(workflow, "gate")

    def action(job_steps: list[dict[str, Any]], uses: str) -> list[dict[str, Any]]:
        return [step["with"] for step in job_steps if step.get("uses", "").startswith(uses)]

    # archives: export writes forkd-archives/<name>.forkd.tar.zst, cached, uploaded, downloaded, imported
    exports = [args for job, directory, args in invocations(workflow, "forkd") if args[:2] == ["snapshots", "export"]]
    assert exports and all(args[args.index("-o") + 1] == f"../forkd-archives/base{SUFFIX}" for args in exports)
    cache = action(build_steps, "actions/cache")[-1]
    upload = action(build_steps, "actions/upload-artifact")[0]
    assert cache["path"] == upload["path"] == "forkd-archives" and cache["key"] == "${{ steps.key.outputs.key }}"
    download = action(shard_steps, "actions/download-artifact")[0]
    assert download == {"name": upload["name"], "path": "forkd-archives"}
    imports = [
        (directory, args)
        for job, directory, args in invocations(workflow, "forkd")
        if args[:2] == ["snapshots", "import"]
    ]
    # imported from the project's directory, so its own snapshots land in its namespace
    assert imports == [("examples", ["snapshots", "import", f"../forkd-archives/base{SUFFIX}"])]
    exporting = {
        directory for job, directory, args in invocations(workflow, "forkd") if args[:2] == ["snapshots", "export"]
    }
    assert exporting == {"examples"}
    # shard timings: written by --forkd-json, uploaded per shard, downloaded together, merged and compared
    shard_run = next(
        args for job, directory, args in invocations(workflow, "pytest") if job == "shard" and "-n" in args
    )
    report = next(word.split("=", 1)[1] for word in shard_run if word.startswith("--forkd-json="))
    assert report == "../forkd-shard-0.json"  # examples/ is the working directory: the file is at the root
    shard_upload = action(shard_steps, "actions/upload-artifact")[0]
    assert shard_upload["path"] == "forkd-shard-${{ matrix.shard }}.json"
    assert shard_upload["name"] == "forkd-shard-${{ matrix.shard }}"
    gathered = action(gate_steps, "actions/download-artifact")[0]
    assert gathered["pattern"] == "forkd-shard-*" and gathered["merge-multiple"] is True
    assert gathered["path"] == "forkd-shards"
    # the baseline: main uploads the merged run, later runs compare with it
    baseline_upload = action(gate_steps, "actions/upload-artifact")[0]
    baseline_download = action(gate_steps, "dawidd6/action-download-artifact")[0]
    assert baseline_upload["name"] == baseline_download["name"] == "forkd-baseline"
    assert baseline_download["workflow"] == WORKFLOW.name
    merge = next(args for job, directory, args in invocations(workflow, "forkd") if args[0] == "merge")
    assert merge[merge.index("-o") + 1] == baseline_upload["path"]


def test_working_directories_and_referenced_files_exist(workflow: dict[str, Any]) -> None:
    for _job, directory, _script in scripts(workflow):
        assert (ROOT / directory).is_dir()
    assert (ROOT / "scripts" / "setup.sh").is_file()
    for job in workflow["jobs"].values():
        for step in job["steps"]:
            key = step.get("with", {}).get("key", "")
            for pattern in re.findall(r"hashFiles\(([^)]*)\)", key):
                for glob in re.findall(r"'([^']+)'", pattern):
                    assert list(ROOT.glob(glob)), f"hashFiles pattern {glob} matches nothing"
