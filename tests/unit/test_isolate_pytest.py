"""The door to pytest's internals (``pytest_forkd/guest/isolate_pytest.py``) against the pytests it must fit.

The isolate runner reaches pytest's private parts (the session's
``SetupState``, an item's ``_fixtureinfo``, ``_request`` and
``_initrequest``, fixture caches, junitxml's stash key, the parser's
options) through that one module. Here it runs against the host's pytest
and against Debian bookworm's 7.2 (the guest's, installed from PyPI at the
versions Debian ships), each in a pytest session of its own: its shape
check must find nothing, and every door must work on real objects. When a
pytest release moves one of them, this test fails with the door's own
sentence saying which.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from isolate_support import guest_pytest, guest_python

from pytest_forkd.guest import GUEST_DIR, isolate_pytest

#: Runs in a pytest session of the pytest under test: the shape check and each door on real objects.
PROBE = """
import json, sys
import pytest
import isolate_pytest as door

SUITE = '''
import unittest

import pytest

EVENTS = []


class TestCaseWithSetUpClass(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        EVENTS.append("setUpClass")

    def test_it(self):
        pass

@pytest.fixture(scope="module")
def shared():
    EVENTS.append("shared up")
    yield 42
    EVENTS.append("shared down")

@pytest.fixture(params=[1, 2])
def numbered(request):
    return request.param

class TestThings:
    def test_uses_shared(self, shared, numbered):
        pass
'''


class Probe:
    def pytest_collection_finish(self, session):
        case, item = session.items[0], session.items[1]
        found = {"problems": door.problems(session, item), "version": pytest.__version__}
        door.set_up(session, case.parent)  # the unittest class: its setUpClass warmed ahead, as the parent does
        with door.counted_as_active(session, case), door.test_case_instance(case):
            for name, defs in door.fixture_definitions(case).items():
                if door.fixture_scope(defs[-1]) == "class":
                    door.request_of(case).getfixturevalue(name)
        door.reset_request(case)
        door.tear_down_to(session, None)
        module = item.module
        scope = item.parent  # the class
        door.set_up(session, scope)
        found["set_up"] = door.is_set_up(session, scope)
        definitions = door.fixture_definitions(item)
        shared = definitions["shared"][-1]
        found["scopes"] = {name: door.fixture_scope(defs[-1]) for name, defs in definitions.items()
                           if name in ("shared", "numbered")}
        found["parametrized"] = door.is_parametrized(definitions["numbered"][-1])
        with door.counted_as_active(session, item):
            found["value"] = door.request_of(item).getfixturevalue("shared")
        found["cached"] = door.is_cached(shared)
        door.reset_request(item)
        door.clear_report_sections(item)
        with door.item_capture(session.config, "teardown", item):
            print("captured")
        door.tear_down_to(session, None)
        found["events"] = list(module.EVENTS)
        found["torn_down"] = not door.is_set_up(session, scope)
        found["outcomes"] = [kind.__name__ for kind in door.outcome_exceptions()]
        found["options"] = sorted(a.dest for a in door.registered_options(session.config) if a.dest == "keyword")
        door.set_junitxml(session.config, "writer")
        found["junitxml"] = door.junitxml(session.config)
        print("PROBE " + json.dumps(found))
        session.shouldstop = "probed"


if __name__ == "__main__":
    with open(sys.argv[1] + "/test_things.py", "w") as suite:
        suite.write(SUITE)
    sys.exit(pytest.main(["-p", "no:cacheprovider", "-q", "-s", sys.argv[1]], plugins=[Probe()]))
"""


def probe(command: list[str], env: dict[str, str], tmp_path: Path) -> dict[str, Any]:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    (tmp_path / "suite").mkdir()
    result = subprocess.run(
        [*command, str(script), str(tmp_path / "suite")], env=env, capture_output=True, text=True, timeout=300
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("PROBE ")]
    assert lines, result.stdout + result.stderr
    found: dict[str, Any] = json.loads(lines[0][len("PROBE ") :])
    return found


def check(found: dict[str, Any]) -> None:
    assert found["problems"] == [], isolate_pytest.describe(found["problems"], found["version"])
    assert found["set_up"] is True and found["torn_down"] is True
    assert found["scopes"] == {"shared": "module", "numbered": "function"}
    assert found["parametrized"] is True
    assert found["value"] == 42 and found["cached"] is True
    assert found["events"] == ["setUpClass", "shared up", "shared down"]
    assert found["outcomes"] == ["OutcomeException", "Exception"]
    assert found["options"] == ["keyword"]
    assert found["junitxml"] == "writer"


def test_the_door_fits_the_hosts_pytest(tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(GUEST_DIR), "PATH": "/usr/bin:/bin"}
    found = probe([sys.executable], env, tmp_path)
    assert found["version"] == pytest.__version__
    check(found)


@pytest.mark.slow
def test_the_door_fits_debian_bookworms_pytest_7_2_the_guests(tmp_path: Path) -> None:
    command, env = guest_python(guest_pytest())
    env["PYTHONPATH"] += f":{GUEST_DIR}"
    found = probe(command, env, tmp_path)
    assert found["version"] == "7.2.1"
    check(found)


def test_a_moved_internal_is_named_in_a_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the runner says (and this test prints) when a pytest release changes the private shape."""
    real = isolate_pytest._private

    class SetupState:  # a release whose SetupState lost teardown_exact
        stack: dict[object, object] = {}

        def setup(self, node: object) -> None: ...

    class Function:  # and whose items lost _initrequest
        pass

    changed = {"SetupState": SetupState, "Function": Function}
    monkeypatch.setattr(isolate_pytest, "_private", lambda module, name: changed.get(name) or real(module, name))
    item = types.SimpleNamespace(_fixtureinfo=None, _report_sections=[])
    found = isolate_pytest.problems(item=item)
    assert "_pytest.python.Function._initrequest() is gone" in found
    assert "_pytest.runner.SetupState.teardown_exact() is gone" in found
    assert "SimpleNamespace._fixtureinfo is gone" in found and "SimpleNamespace._request is gone" in found
    message = isolate_pytest.describe(found, "99.0")
    assert message.startswith("pytest 99.0 changed internals that pytest --forkd-isolate runs tests with: ")
    assert "_initrequest() is gone" in message and "update pytest-forkd" in message
