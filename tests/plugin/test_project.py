"""forkd.yaml parsing and validation (no VM)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pytest_forkd.errors import ConfigError
from pytest_forkd.project.config import EMPTY_PROJECT, FileCopy, load_project, parse_project


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "forkd.yaml"
    path.write_text(text)
    return path


def parse(tmp_path: Path, data: object):
    return parse_project(data, path=tmp_path / "forkd.yaml")


def test_full_project_is_parsed(tmp_path):
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "lint.sh").write_text("#!/bin/sh\n")
    project = load_project(
        write(
            tmp_path,
            """
settings: {snapshot: web, pool: 2, keep_failed: true, store: snaps}
snapshots:
  tools:
    env: {LEVEL: 3}
    files: {tools/lint.sh: /usr/local/bin/lint}
    setup: [chmod +x /usr/local/bin/lint]
  web:
    from: tools
    memory_mib: 512
  raw:
    from: image:minimal
    vcpus: 2
budgets:
  fork: {p95_ms: 300}
""",
        )
    )
    tools, web, raw = project.snapshots["tools"], project.snapshots["web"], project.snapshots["raw"]
    assert tools.source == "base" and tools.source_image is None
    assert dict(tools.env) == {"LEVEL": "3"}
    assert tools.files == (FileCopy((tmp_path / "tools" / "lint.sh").absolute(), "/usr/local/bin/lint"),)
    assert tools.setup == ("chmod +x /usr/local/bin/lint",)
    assert web.source == "tools" and web.memory_mib == 512
    assert raw.source_image == "minimal" and raw.vcpus == 2
    assert dict(project.settings) == {
        "snapshot": "web",
        "pool": 2,
        "keep_failed": True,
        "store": (tmp_path / "snaps").absolute(),
    }
    assert [(b.op, b.stat, b.limit_ms) for b in project.budgets] == [("fork", "p95", 300.0)]
    assert project.snapshot_names() == ["base", "raw", "tools", "web"]


def test_empty_file_is_an_empty_project(tmp_path):
    project = load_project(write(tmp_path, ""))
    assert project.snapshots == {} and project.settings == {} and project.budgets == ()
    assert EMPTY_PROJECT.snapshot_names() == ["base"]


@pytest.mark.parametrize(
    "data, message",
    [
        ({"snapshots": {"web": {"setup": ["ok", "fine", 3]}}}, "forkd.yaml: snapshots.web.setup[2]: expected a string"),
        (
            {"snapshots": {"web": {"setup": "make"}}},
            "forkd.yaml: snapshots.web.setup: expected a list of shell commands",
        ),
        ({"snapshots": {"web": {"colour": "red"}}}, "forkd.yaml: snapshots.web.colour: unknown key; valid keys: from,"),
        (
            {"snapshots": {"web": {"memory_mib": "lots"}}},
            "forkd.yaml: snapshots.web.memory_mib: expected a whole number",
        ),
        (
            {"snapshots": {"web": {"from": "nope"}}},
            "forkd.yaml: snapshots.web.from: unknown snapshot 'nope'; declared snapshots: base, web",
        ),
        ({"snapshots": {"web": {"from": "image:no/pe"}}}, "forkd.yaml: snapshots.web.from: invalid image name"),
        (
            {"snapshots": {"base": {"from": "base"}}},
            "forkd.yaml: snapshots.base.from: snapshots start from each other in a loop: base -> base",
        ),
        ({"snapshots": {"bad name": {}}}, "forkd.yaml: snapshots.bad name: invalid snapshot name"),
        (
            {"snapshots": {"a": {"from": "b"}, "b": {"from": "a"}}},
            "forkd.yaml: snapshots.a.from: snapshots start from each other in a loop: a -> b -> a",
        ),
        ({"snapshots": {"web": {"env": {"A": [1]}}}}, "forkd.yaml: snapshots.web.env.A: expected a string or number"),
        (
            {"snapshots": {"web": {"files": {"missing.txt": "/x"}}}},
            "forkd.yaml: snapshots.web.files.missing.txt: no such file",
        ),
        ({"settings": {"pool": -1}}, "forkd.yaml: settings.pool: expected a whole number >= 0"),
        ({"settings": {"keep_failed": "yes"}}, "forkd.yaml: settings.keep_failed: expected true or false"),
        ({"settings": {"speed": 1}}, "forkd.yaml: settings.speed: unknown key; valid keys: snapshot, backend"),
        ({"budgets": {"fork": {"p95_ms": "x"}}}, "forkd.yaml: budgets.fork.p95_ms: expected a positive number"),
        (
            {"snapshot": {}},
            "forkd.yaml: snapshot: unknown key; did you mean 'snapshots'? valid keys: settings, images, snapshots, budgets",
        ),
        (["a list"], "forkd.yaml: expected a mapping with keys settings, images, snapshots, budgets"),
    ],
)
def test_errors_name_the_field_path(tmp_path, data, message):
    with pytest.raises(ConfigError) as error:
        parse(tmp_path, data)
    assert str(error.value).startswith(message), str(error.value)


def test_guest_paths_must_be_absolute(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match=r"snapshots.web.files.f: expected an absolute guest path, got 'tmp/f'"):
        parse(tmp_path, {"snapshots": {"web": {"files": {"f": "tmp/f"}}}})


def test_yaml_syntax_errors_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="forkd.yaml: not valid YAML"):
        load_project(write(tmp_path, "snapshots: [unclosed"))


def test_missing_file_says_how_to_fix(tmp_path):
    with pytest.raises(ConfigError, match="cannot read .*--forkd-config"):
        load_project(tmp_path / "absent.yaml")


def test_example_project_is_valid():
    examples = Path(__file__).parents[2] / "examples"
    project = load_project(examples / "forkd.yaml")
    assert "tools" in project.snapshots
    assert yaml.safe_load((examples / "forkd.yaml").read_text())["snapshots"]["tools"]["from"] == "base"


# -- every mistake in one run -------------------------------------------------------------------------


def test_two_mistakes_are_reported_together_each_with_the_key_meant(tmp_path):
    """A misspelt top-level key and a misspelt budget field: one run, one error, a line for each."""
    path = write(tmp_path, "snapshot:\n  web: {}\nbudgets:\n  fork: {p95: 300}\n")
    with pytest.raises(ConfigError) as error:
        load_project(path)
    assert str(error.value).splitlines() == [
        "forkd.yaml: snapshot: unknown key; did you mean 'snapshots'? valid keys: settings, images, snapshots, budgets",
        "forkd.yaml: budgets.fork.p95: unknown key 'p95'; did you mean 'p95_ms'? "
        "valid keys: p50_ms, p95_ms, p99_ms, max_ms, mean_ms, backends",
    ]


def test_every_section_is_checked_after_a_mistake(tmp_path):
    data = {
        "settings": {"pool": -1, "backend": "full", "keep_faild": True},
        "images": {"tools": {"packages": ["jq", "Not A Package"], "setpu": ["true"]}},
        "snapshots": {
            "web": {"from": "tools-snap", "memory_mib": 0, "setup": "not a list", "env": {"A=B": "x"}},
            "tools-snap": {"vcpus": "two", "shared": "yes"},
        },
        "budgets": {"frok": {"p95_ms": 1}, "exec": {"max_ms": -3}},
    }
    with pytest.raises(ConfigError) as error:
        parse(tmp_path, data)
    lines = str(error.value).splitlines()
    expected = [
        "forkd.yaml: settings.keep_faild: unknown key; did you mean 'keep_failed'?",
        "forkd.yaml: settings.pool: expected a whole number >= 0",
        "forkd.yaml: images.tools.setpu: unknown key; did you mean 'setup'?",
        "forkd.yaml: images.tools.packages[1]: 'Not A Package' is not a Debian package name",
        "forkd.yaml: snapshots.web.memory_mib: expected a whole number >= 1",
        "forkd.yaml: snapshots.web.env.A=B: expected a variable name without '='",
        "forkd.yaml: snapshots.web.setup: expected a list of shell commands",
        "forkd.yaml: snapshots.tools-snap.vcpus: expected a whole number >= 1",
        "forkd.yaml: snapshots.tools-snap.shared: expected true or false",
        "forkd.yaml: budgets.frok: unknown operation 'frok'; did you mean 'fork'?",
        "forkd.yaml: budgets.exec.max_ms: expected a positive number",
    ]
    assert len(lines) == len(expected), lines
    for line, start in zip(lines, expected):
        assert line.startswith(start), (line, start)


def test_a_snapshot_starting_from_one_with_mistakes_is_not_reported_as_well(tmp_path):
    with pytest.raises(ConfigError) as error:
        parse(tmp_path, {"snapshots": {"tools": {"vcpus": 0}, "web": {"from": "tools"}}})
    assert str(error.value) == "forkd.yaml: snapshots.tools.vcpus: expected a whole number >= 1, got int 0"


def test_an_unknown_source_gets_the_declared_snapshot_meant(tmp_path):
    with pytest.raises(ConfigError, match=r"snapshots\.web\.from: unknown snapshot 'tool'; did you mean 'tools'\?"):
        parse(tmp_path, {"snapshots": {"tools": {}, "web": {"from": "tool"}}})


def test_a_loop_is_reported_once(tmp_path):
    with pytest.raises(ConfigError) as error:
        parse(tmp_path, {"snapshots": {"a": {"from": "b"}, "b": {"from": "a"}, "c": {"from": "a"}}})
    (line,) = str(error.value).splitlines()
    assert "snapshots start from each other in a loop: a -> b -> a" in line
