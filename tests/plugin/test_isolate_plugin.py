"""``pytest --forkd-isolate`` without a VM (pytester): its settings and marker, what goes into the guest, its reports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pytest_forkd.errors import ConfigError
from pytest_forkd.isolate import forwarding
from pytest_forkd.isolate import plan as isolate_plan
from pytest_forkd.isolate import reports as isolate_reports
from pytest_forkd.isolate.imports import project_imports
from pytest_forkd.isolate.options import DEFAULT_TIMEOUT_S, IsolateSettings, isolated_test, parse_timeout

pytest_plugins = ["pytester"]


# -- settings and marker -------------------------------------------------------------------------
def collect(pytester: pytest.Pytester, *args: str, source: str = "def test_x():\n    pass\n") -> list[pytest.Item]:
    pytester.makepyfile(test_x=source)
    items, _ = pytester.inline_genitems(*args)
    return items


def resolved(pytester: pytest.Pytester, *args: str, environ: dict[str, str] | None = None) -> IsolateSettings:
    from pytest_forkd.isolate.options import resolve

    config = pytester.parseconfigure(*args)
    return resolve(config, environ or {})


def test_isolation_is_off_unless_asked(pytester: pytest.Pytester) -> None:
    assert resolved(pytester) == IsolateSettings(enabled=False, timeout=DEFAULT_TIMEOUT_S)


def test_the_command_line_wins_over_env_which_wins_over_ini(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nforkd_isolate = false\nforkd_isolate_timeout = 30\n")
    assert resolved(pytester).enabled is False
    assert resolved(pytester).timeout == 30
    assert resolved(pytester, environ={"PYTEST_FORKD_ISOLATE": "1"}).enabled is True
    assert resolved(pytester, environ={"PYTEST_FORKD_ISOLATE_TIMEOUT": "12.5"}).timeout == 12.5
    assert resolved(pytester, "--forkd-isolate", environ={"PYTEST_FORKD_ISOLATE": "0"}).enabled is True
    assert resolved(pytester, "--forkd-isolate-timeout=7", environ={"PYTEST_FORKD_ISOLATE_TIMEOUT": "9"}).timeout == 7


def test_ini_turns_it_on_and_lists_paths_and_exclusions(pytester: pytest.Pytester) -> None:
    pytester.makeini(
        "[pytest]\nforkd_isolate = true\nforkd_isolate_paths = src\n  tests\nforkd_isolate_exclude = *.log\n"
    )
    assert resolved(pytester) == IsolateSettings(enabled=True, paths=("src", "tests"), exclude=("*.log",))


def test_a_bad_value_names_where_it_was_set(pytester: pytest.Pytester) -> None:
    with pytest.raises(ConfigError, match="PYTEST_FORKD_ISOLATE: expected one of"):
        resolved(pytester, environ={"PYTEST_FORKD_ISOLATE": "perhaps"})
    with pytest.raises(ConfigError, match="--forkd-isolate-timeout: expected a number of seconds > 0"):
        resolved(pytester, "--forkd-isolate-timeout=-1")
    with pytest.raises(ConfigError, match="forkd_isolate_timeout"):
        parse_timeout("soon", "ini forkd_isolate_timeout")


def test_the_marker_selects_a_test_and_sets_fresh_and_timeout(pytester: pytest.Pytester) -> None:
    source = (
        "import pytest\n\n"
        "def test_plain():\n    pass\n\n"
        "@pytest.mark.forkd_isolate\ndef test_marked():\n    pass\n\n"
        "@pytest.mark.forkd_isolate(fresh=True, timeout=30)\ndef test_fresh():\n    pass\n\n"
        "def test_drives_vms(forkd_vm):\n    pass\n"
    )
    items = {item.name: item for item in collect(pytester, source=source)}
    off = IsolateSettings()
    assert isolated_test(items["test_plain"], off) is None
    marked = isolated_test(items["test_marked"], off)
    assert marked is not None and (marked.fresh, marked.timeout, marked.file) == (False, DEFAULT_TIMEOUT_S, "test_x.py")
    fresh = isolated_test(items["test_fresh"], off)
    assert fresh is not None and (fresh.fresh, fresh.timeout) == (True, 30)
    on = IsolateSettings(enabled=True)
    assert isolated_test(items["test_plain"], on) is not None
    assert isolated_test(items["test_drives_vms"], on) is None  # forkd's own fixtures run on the host


@pytest.mark.parametrize(
    ("marker", "message"),
    [
        ("forkd_isolate(True)", "takes keyword arguments only"),
        ("forkd_isolate(fast=True)", "unknown argument(s) fast; valid arguments: fresh, timeout"),
        ("forkd_isolate(fresh='yes')", "fresh: expected True or False"),
        ("forkd_isolate(timeout=0)", "timeout: expected a number of seconds > 0"),
    ],
)
def test_a_bad_marker_is_a_usage_error_naming_the_test(pytester: pytest.Pytester, marker: str, message: str) -> None:
    pytester.makepyfile(test_bad=f"import pytest\n\n@pytest.mark.{marker}\ndef test_it():\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*forkd_isolate marker on test_bad.py::test_it: *{message}*"])


def test_pytest_help_lists_the_options_in_the_vms_group(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--help")
    text = result.stdout.str()
    group = text.index("pytest-forkd: VMs and snapshots")
    assert group < text.index("--forkd-isolate ") < text.index("--forkd-isolate-timeout")
    assert "forkd_isolate_paths" in text and "forkd_isolate_exclude" in text


def test_the_marker_is_registered(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.forkd_isolate(fresh=False, timeout=None):*"])


# -- what goes into the guest ----------------------------------------------------------------------
def test_the_rootdir_is_copied_without_vcs_virtualenvs_and_caches(tmp_path: Path) -> None:
    (tmp_path / "env").mkdir()
    (tmp_path / "env" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (tmp_path / "tools" / "venv2").mkdir(parents=True)
    (tmp_path / "tools" / "venv2" / "pyvenv.cfg").write_text("")
    (tmp_path / "src").mkdir()
    (copy,) = isolate_plan.copies(isolate_plan.copied_paths(tmp_path, (), None), ["*.log"])
    assert copy.path == tmp_path
    assert {".git", ".venv", "__pycache__", "*.pyc", ".tox", ".pytest_cache", "*.log"} <= set(copy.exclude)
    assert {"env", "tools/venv2"} <= set(copy.exclude)
    assert "src" not in copy.exclude


def test_configured_paths_are_copied_and_the_ini_file_goes_along(tmp_path: Path) -> None:
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "tests").mkdir()
    ini = tmp_path / "pytest.ini"
    assert isolate_plan.copied_paths(project, ["src", "tests"], ini) == [project / "src", project / "tests", ini]
    with pytest.raises(ConfigError, match="'docs' does not exist under the rootdir"):
        isolate_plan.copied_paths(project, ["docs"], None)


@pytest.mark.parametrize("path", ["/", "/usr/src/app", "/etc/project", "/opt", "/proc/1"])
def test_a_project_on_the_guests_own_system_paths_is_refused(path: str) -> None:
    with pytest.raises(ConfigError, match="is the guest system's own"):
        isolate_plan.check_guest_path(Path(path), "pytest --forkd-isolate")


def test_a_test_file_outside_the_copies_is_refused(tmp_path: Path) -> None:
    copies = isolate_plan.copies([tmp_path / "src"], [])
    with pytest.raises(ConfigError, match="add it to ini forkd_isolate_paths"):
        isolate_plan.test_files([tmp_path / "tests" / "test_x.py"], copies)
    inside = tmp_path / "src" / "test_y.py"
    assert isolate_plan.test_files([inside, inside], copies) == [str(inside)]


def test_the_guest_gets_the_settings_that_shape_reports_not_the_host_only_ones(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        "def pytest_addoption(parser):\n"
        "    parser.addoption('--run-slow', action='store_true', default=False)\n"
        "    parser.getgroup('flavours').addoption('--flavour', default='mild')\n"
    )
    pytester.makeini("[pytest]\naddopts = -p no:cacheprovider -p pytester\n")
    config = pytester.parseconfigure(
        "-vv", "--tb=short", "-l", "-x", "-k", "expr", "--junitxml=out.xml", "-o", "xfail_strict=true",
        "-W", "ignore::DeprecationWarning", "--doctest-modules", "-p", "no:randomly", "--run-slow",
        "--flavour=spicy", "--runxfail", "-p", "xdist", "-n", "2",
    )  # fmt: skip
    args = forwarding.command_line(config, ["/p/test_x.py"])
    assert args[:2] == ["--rootdir", str(config.rootpath)]
    assert ["-o", "addopts="] == args[4:6]
    for expected in (
        ["-o", "xfail_strict=true"],
        ["-W", "ignore::DeprecationWarning"],
        ["-p", "no:randomly"],
        ["-p", "no:terminal"],
        ["-p", "pytester"],  # from the ini's addopts
    ):
        assert any(args[i : i + 2] == expected for i in range(len(args))), (expected, args)
    assert "--doctest-modules" in args and args[-1] == "/p/test_x.py"
    assert not {"-x", "-k", "expr", "--junitxml=out.xml", "xdist"} & set(args)
    report_options = forwarding.report_options(config)
    assert report_options["verbose"] == 2 and report_options["tbstyle"] == "short"
    assert report_options["showlocals"] is True
    by_name = forwarding.options_by_name(config)
    # a conftest's options in any group, pytest's own that change how tests run; not the host's loop and reports
    assert by_name["run_slow"] is True and by_name["flavour"] == "spicy" and by_name["runxfail"] is True
    assert not {"keyword", "maxfail", "xmlpath", "numprocesses", "verbose", "tbstyle"} & set(by_name), by_name


def test_an_option_the_guest_lacks_is_named_with_its_plugin_in_one_line(pytester: pytest.Pytester) -> None:
    pytester.makeconftest("def pytest_addoption(parser):\n    parser.addoption('--flavour', default='mild')\n")
    config = pytester.parseconfigure("--flavour=spicy", "-p", "pytester", "--runpytest=subprocess")
    line = forwarding.explain_refused(config, ["flavour", "runpytest"])
    assert "\n" not in line
    assert "--flavour=spicy" in line and "conftest.py" in line
    assert "--runpytest=subprocess (from plugin 'pytester'" in line
    assert "forkd.yaml" in line


def test_the_environment_passes_pytests_own_variables_not_the_hosts(tmp_path: Path) -> None:
    environ = {
        "PYTEST_TIMEOUT": "5",
        "PYTEST_ADDOPTS": "-x",
        "PYTEST_XDIST_WORKER": "gw0",
        "PYTEST_FORKD_ISOLATE": "1",
        "PYTHONPATH": "src",
        "HOME": "/root",
    }
    assert forwarding.environment(environ) == {"PYTEST_TIMEOUT": "5", "PYTHONPATH": "src"}


def test_the_plan_puts_the_projects_imports_first_and_names_its_packages(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\n")
    test_file = pytester.makepyfile(test_x="def test_x():\n    pass\n")
    config = pytester.parseconfigure()
    plan = isolate_plan.plan(config, [test_file], configured_paths=(), exclude=(), environ={"PYTHONPATH": "src"})
    assert plan.cwd == str(pytester.path)
    assert plan.env == {"PYTHONPATH": "src"}
    assert plan.command() == ["python3", isolate_plan.RUNNER_PATH, isolate_plan.SPEC_PATH]
    assert set(plan.spec) >= {"args", "options", "report_options", "sys_path", "editable", "project_modules"}
    assert "junit_family" not in plan.spec  # no --junitxml on the host: the record_* fixtures write nowhere


def test_the_projects_imports_are_the_hosts_entries_in_the_copied_tree(tmp_path: Path) -> None:
    """src/ from a .pth file, an editable finder's mapping, the modules imported from the tree; not a venv's."""
    import types

    project = tmp_path / "project"
    (project / "src" / "mypkg").mkdir(parents=True)
    (project / "src" / "mypkg" / "__init__.py").write_text("")
    (project / "flat.py").write_text("")
    (project / "tests").mkdir()
    (project / "tests" / "test_a.py").write_text("")
    venv = project / ".venv" / "lib" / "site-packages"
    (venv / "other").mkdir(parents=True)
    (project / ".venv" / "pyvenv.cfg").write_text("")
    copies = isolate_plan.copies([project], [])
    finder_module = types.ModuleType("__editable___flat_0_1_finder")
    finder_module.MAPPING = {"flat": str(project / "flat.py"), "elsewhere": "/opt/elsewhere"}  # type: ignore[attr-defined]

    class Finder:
        __module__ = "__editable___flat_0_1_finder"

    def module(name: str, file: Path, package: bool = False) -> types.ModuleType:
        made = types.ModuleType(name)
        made.__file__ = str(file)
        if package:
            made.__path__ = [str(file.parent)]
        return made

    modules = {
        "mypkg": module("mypkg", project / "src" / "mypkg" / "__init__.py", package=True),
        "mypkg.sub": module("mypkg.sub", project / "src" / "mypkg" / "sub.py"),
        "test_a": module("test_a", project / "tests" / "test_a.py"),
        "other": module("other", venv / "other" / "__init__.py", package=True),
        "json": module("json", Path("/usr/lib/python3.11/json/__init__.py"), package=True),
        "__editable___flat_0_1_finder": finder_module,
    }
    found = project_imports(
        copies,
        [project / "tests" / "test_a.py"],
        path=[str(project / "src"), str(venv), "/usr/lib/python3.11", str(project / "tests")],
        meta_path=[Finder],
        modules=modules,
        cwd=str(project),
    )
    assert found.sys_path == (str(project / "src"), str(project / "tests"))
    assert found.editable == {"flat": str(project / "flat.py")}
    assert found.modules == {"mypkg": str(project / "src" / "mypkg")}


# -- reports -----------------------------------------------------------------------------------
def phases(reports: list[pytest.TestReport]) -> list[tuple[str, str]]:
    return [(report.when, report.outcome) for report in reports]


@pytest.fixture
def item(pytester: pytest.Pytester) -> pytest.Item:
    (found,) = collect(pytester)
    return found


def test_a_report_from_the_guest_reads_back_as_the_hosts_own(item: pytest.Item) -> None:
    data: dict[str, Any] = item.config.hook.pytest_report_to_serializable(
        config=item.config, report=isolate_reports.made_here(item, "call", "failed", "assert 1 == 2")
    )
    data["nodeid"] = "elsewhere::test_x"
    report = isolate_reports.from_guest(item.config, item, data)
    assert (report.nodeid, report.location, report.outcome) == (item.nodeid, item.location, "failed")
    assert report.longreprtext == "assert 1 == 2"


def test_a_test_whose_vm_died_fails_in_the_phase_it_reached(item: pytest.Item) -> None:
    setup = isolate_reports.made_here(item, "setup", "passed")
    assert phases(isolate_reports.completed(item, [setup], "GuestCrashed: kernel panic")) == [
        ("setup", "passed"),
        ("call", "failed"),
        ("teardown", "passed"),
    ]
    assert phases(isolate_reports.completed(item, [], "RunnerFailed: boom")) == [
        ("setup", "failed"),
        ("teardown", "passed"),
    ]
    call = isolate_reports.made_here(item, "call", "passed")
    completed = isolate_reports.completed(item, [setup, call], "GuestCrashed: died in teardown")
    assert phases(completed)[-1] == ("teardown", "failed")
    assert completed[-1].longreprtext == "GuestCrashed: died in teardown"
    assert isolate_reports.completed(item, [setup, call], None) == [setup, call]


def test_the_parents_teardown_joins_the_tests_teardown_report(item: pytest.Item) -> None:
    teardown = isolate_reports.made_here(item, "teardown", "passed", sections=[("Captured stdout teardown", "a")])
    parent = isolate_reports.made_here(
        item, "teardown", "failed", "module fixture teardown broke", [("Captured stdout teardown", "b")]
    )
    (joined,) = isolate_reports.with_parent_teardown([teardown], parent)
    assert joined.outcome == "failed" and joined.longreprtext == "module fixture teardown broke"
    assert joined.sections == [
        ("Captured stdout teardown", "a"),
        ("Captured stdout teardown (in the parent VM)", "b"),
    ]
    quiet = isolate_reports.made_here(item, "teardown", "passed")
    untouched = isolate_reports.made_here(item, "teardown", "passed")
    assert isolate_reports.with_parent_teardown([untouched], quiet)[0].sections == []


def test_a_warning_from_the_guest_is_recorded_on_the_host(item: pytest.Item) -> None:
    recorded: list[Any] = []

    class Recorder:
        def pytest_warning_recorded(self, warning_message: Any, when: str, nodeid: str, location: Any) -> None:
            if nodeid == item.nodeid:  # not pytest's own warnings, which a historic hook replays
                recorded.append((warning_message.category, str(warning_message.message), nodeid))

    item.config.pluginmanager.register(Recorder(), "recorder")
    isolate_reports.replay_warning(
        item.config, item, {"category": "DeprecationWarning", "message": "old", "filename": "x.py", "lineno": 3}
    )
    isolate_reports.replay_warning(item.config, item, {"category": "SomeLibraryWarning", "message": "odd"})
    assert recorded == [(DeprecationWarning, "old", item.nodeid), (UserWarning, "odd", item.nodeid)]


def test_a_skip_read_back_from_json_keeps_the_tuple_junitxml_asserts(item: pytest.Item) -> None:
    import json

    skipped = isolate_reports.made_here(item, "call", "skipped")
    skipped.longrepr = (str(item.path), 3, "Skipped: not here")
    skipped.user_properties = [("answer", 42)]
    skipped.sections = [("Captured stdout call", "out")]
    data = json.loads(json.dumps(item.config.hook.pytest_report_to_serializable(config=item.config, report=skipped)))
    report = isolate_reports.from_guest(item.config, item, data)
    assert report.longrepr == (str(item.path), 3, "Skipped: not here")
    assert report.user_properties == [("answer", 42)] and report.sections == [("Captured stdout call", "out")]


def test_under_a_load_schedule_the_parent_prepares_only_for_the_tests_known_to_come(pytester: pytest.Pytester) -> None:
    """xdist's load schedules hand a worker its tests one by one: the group is the next test, if it shares the
    scope; with the whole schedule known (no xdist, loadfile, loadscope) it is the rest of the scope."""
    from pytest_forkd.isolate.hooks import ISOLATED, IsolationHooks

    pytester.makepyfile(test_x="def test_a():\n    pass\n\ndef test_b():\n    pass\n\ndef test_c():\n    pass\n")
    items, _ = pytester.inline_genitems()
    settings = IsolateSettings(enabled=True)
    for item in items:
        test = isolated_test(item, settings)
        assert test is not None
        item.stash[ISOLATED] = test
    hooks = IsolationHooks.__new__(IsolationHooks)
    hooks.items = items
    hooks.index = {item.nodeid: position for position, item in enumerate(items)}
    first = items[0].stash[ISOLATED]
    assert first.scope == "test_x.py"
    hooks.schedule_known = True
    assert hooks._group(items[0], first, items[1]) == ["test_x.py::test_b", "test_x.py::test_c"]
    hooks.schedule_known = False
    assert hooks._group(items[0], first, items[2]) == ["test_x.py::test_c"]
    assert hooks._group(items[0], first, None) == []


def test_a_class_with_class_scoped_set_up_is_a_scope_of_its_own(pytester: pytest.Pytester) -> None:
    source = (
        "import unittest\n\nimport pytest\n\n"
        "class TestPlain:\n    def test_a(self):\n        pass\n\n"
        "class TestSetUp:\n    @classmethod\n    def setup_class(cls):\n        pass\n\n"
        "    def test_b(self):\n        pass\n\n"
        "class TestFixture:\n    @pytest.fixture(scope='class')\n    def thing(self):\n        return 1\n\n"
        "    def test_c(self, thing):\n        pass\n\n"
        "class TestCase(unittest.TestCase):\n    def test_d(self):\n        pass\n"
    )
    items = {item.name: item for item in collect(pytester, source=source)}
    on = IsolateSettings(enabled=True)
    scopes = {name: test.scope for name, item in items.items() if (test := isolated_test(item, on)) is not None}
    assert scopes == {
        "test_a": "test_x.py",  # nothing class-scoped: its module's branch, no branch of its own
        "test_b": "test_x.py::TestSetUp",
        "test_c": "test_x.py::TestFixture",
        "test_d": "test_x.py::TestCase",  # unittest's setUpClass is a class-scoped fixture of pytest's
    }
