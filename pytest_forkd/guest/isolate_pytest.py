"""The one door through which ``pytest --forkd-isolate`` reaches pytest's private internals.

Running one test of an already collected session in a forked child, with
the session- to class-scoped set-up done once in the parent, needs what
pytest keeps private: the session's ``SetupState`` (its ``setup``,
``teardown_exact`` and ``stack``), an item's ``_fixtureinfo``, ``_request``
and ``_initrequest``, a fixture definition's ``cached_result`` and
``params``, an item's ``_report_sections``, the capture manager's
``item_capture``, junitxml's stash key, and the parser's registered
options. Every use goes through a function here, so a pytest release that
changes one of them breaks this module alone, and :func:`problems` says
which, in words (the runner checks it before it serves a test, and
tests/unit/test_isolate_pytest.py runs it against the host's pytest and
Debian bookworm's pytest 7.2, the guest's).

Plain Python that imports nothing of pytest-forkd: it is copied into the
guest beside the runner (``isolate_runner.py``), and the host's side of
the isolation mode uses it too. It sticks to what pytest 7.2 to 9 share.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

#: pytest's private modules and the names this door takes from them.
PRIVATE_NAMES = (
    ("_pytest.outcomes", "OutcomeException"),
    ("_pytest.runner", "SetupState"),
    ("_pytest.junitxml", "xml_key"),
    ("_pytest.python", "Function"),
)


def _private(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


# -- outcomes ------------------------------------------------------------------------------------
def outcome_exceptions() -> tuple[type[BaseException], ...]:
    """What pytest treats as a test's outcome (skip, fail, xfail and every Exception), not an interruption."""
    return (_private("_pytest.outcomes", "OutcomeException"), Exception)


# -- the session's set-up stack -----------------------------------------------------------------
def setup_state(session: Any) -> Any:
    """The session's ``SetupState``: the stack of nodes set up and their finalizers."""
    return session._setupstate


def set_up(session: Any, node: Any) -> None:
    """Set up ``node``'s collectors down to it (an item's, a class's or a module's chain), as pytest does."""
    setup_state(session).setup(node)


def tear_down_to(session: Any, node: Any) -> None:
    """Tear down what ``node`` (None: nothing) does not descend from, as pytest does before the next test."""
    setup_state(session).teardown_exact(node)


def is_set_up(session: Any, node: Any) -> bool:
    return node in setup_state(session).stack


@contextlib.contextmanager
def counted_as_active(session: Any, item: Any) -> Iterator[None]:
    """``item`` counts as set up meanwhile (without its own set-up), so its fixtures can be requested.

    pytest 9 refuses a fixture requested for a test that is not on the
    stack; nothing is pushed when the item is already there.
    """
    stack = setup_state(session).stack
    pushed = item not in stack
    if pushed:
        stack[item] = ([], None)
    try:
        yield
    finally:
        if pushed:
            stack.pop(item, None)


@contextlib.contextmanager
def test_case_instance(item: Any) -> Iterator[None]:
    """A unittest item has its ``TestCase`` instance meanwhile, made as pytest 7 makes it in the item's setup.

    pytest 7 binds unittest's class-scoped ``setUpClass`` fixture to that
    instance, so computing the fixture before the item's own setup (as the
    parent does) needs one; it is dropped afterwards, as pytest 7's teardown
    drops it. pytest 8 and later make the instance on demand (``_testcase``
    is a property there): nothing to do.
    """
    missing = object()
    attribute = next((vars(kind)["_testcase"] for kind in type(item).__mro__ if "_testcase" in vars(kind)), missing)
    if attribute is missing or isinstance(attribute, property) or getattr(item, "_testcase", None) is not None:
        yield  # not a unittest item, or a pytest that makes the instance itself, or one already made
        return
    item._testcase = item.parent.obj(item.name)
    item._obj = getattr(item._testcase, item.name)
    try:
        yield
    finally:
        item._testcase = None
        item._obj = None


# -- fixtures of an item ------------------------------------------------------------------------
def fixture_definitions(item: Any) -> dict[str, Any] | None:
    """The item's fixture definitions by name (each a list, the closest last), None for items without any."""
    info = getattr(item, "_fixtureinfo", None)
    return None if info is None else dict(info.name2fixturedefs)


def request_of(item: Any) -> Any:
    """The item's own fixture request (None for items without one, such as some doctests)."""
    return getattr(item, "_request", None)


def reset_request(item: Any) -> None:
    """Give the item a fresh fixture request, as pytest does when it sets up the item."""
    reset = getattr(item, "_initrequest", None)
    if reset is not None:
        reset()


def fixture_scope(fixturedef: Any) -> str:
    """``"session"``, ``"package"``, ``"module"``, ``"class"`` or ``"function"``."""
    scope = fixturedef.scope
    return str(getattr(scope, "value", scope))


def is_parametrized(fixturedef: Any) -> bool:
    return fixturedef.params is not None


def is_cached(fixturedef: Any) -> bool:
    """Whether the fixture holds a value (or the error its set-up raised) for the current scope."""
    return fixturedef.cached_result is not None


# -- reports ------------------------------------------------------------------------------------
def clear_report_sections(item: Any) -> None:
    """Forget the captured output sections of earlier phases (the parent never ran the item itself)."""
    item._report_sections = []


def item_capture(config: Any, when: str, item: Any) -> contextlib.AbstractContextManager[Any]:
    """Capture output as pytest does around a phase of ``item`` (a no-op without the capture plugin)."""
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is None:
        return contextlib.nullcontext()
    context: contextlib.AbstractContextManager[Any] = capture.item_capture(when, item)
    return context


def junitxml(config: Any) -> Any:
    """The run's junitxml writer (``LogXML``), None without ``--junitxml``."""
    return config.stash.get(_private("_pytest.junitxml", "xml_key"), None)


def set_junitxml(config: Any, writer: Any) -> None:
    """Make ``writer`` the run's junitxml writer, which the ``record_*`` fixtures write to."""
    config.stash[_private("_pytest.junitxml", "xml_key")] = writer


# -- options ------------------------------------------------------------------------------------
def registered_options(config: Any) -> list[Any]:
    """Every option the run's parser knows (``Argument`` objects with ``dest``, ``names()``, ``attrs()``).

    Options in named groups and those added without a group (a conftest.py's
    ``parser.addoption``) alike.
    """
    parser = config._parser
    options = list(parser._anonymous.options)
    for group in parser._groups:
        options += group.options
    return options


def option_default(argument: Any) -> Any:
    return argument.attrs().get("default")


# -- checking the shape -------------------------------------------------------------------------
def problems(session: Any = None, item: Any = None) -> list[str]:
    """What of the above this pytest no longer offers, one sentence each (empty: the door fits).

    Without arguments only the module-level names are checked; with a
    session and one of its collected test functions, the objects' own
    attributes too.
    """
    found: list[str] = []
    for module, name in PRIVATE_NAMES:
        try:
            _private(module, name)
        except (ImportError, AttributeError) as exc:
            found.append(f"{module}.{name} is gone ({exc})")
    setup_state_class = None
    with contextlib.suppress(ImportError, AttributeError):
        setup_state_class = _private("_pytest.runner", "SetupState")
    if setup_state_class is not None:
        for method in ("setup", "teardown_exact"):
            if not callable(getattr(setup_state_class, method, None)):
                found.append(f"_pytest.runner.SetupState.{method}() is gone")
        stack = getattr(setup_state_class(), "stack", None)
        if not isinstance(stack, dict):
            found.append(f"SetupState().stack is a {type(stack).__name__}, not a dict of node to entry")
    function_class = None
    with contextlib.suppress(ImportError, AttributeError):
        function_class = _private("_pytest.python", "Function")
    if function_class is not None and not callable(getattr(function_class, "_initrequest", None)):
        found.append("_pytest.python.Function._initrequest() is gone")
    if session is not None:
        found += _session_problems(session)
    if item is not None:
        found += _item_problems(item)
    return found


def _session_problems(session: Any) -> list[str]:
    found: list[str] = []
    state = getattr(session, "_setupstate", None)
    if state is None:
        return ["Session._setupstate is gone"]
    if not isinstance(getattr(state, "stack", None), dict):
        found.append("Session._setupstate.stack is not a dict")
    config = session.config
    parser = getattr(config, "_parser", None)
    if parser is None:
        found.append("Config._parser is gone")
    else:
        if not hasattr(getattr(parser, "_anonymous", None), "options"):
            found.append("Parser._anonymous.options is gone")
        groups = getattr(parser, "_groups", None)
        if not isinstance(groups, list) or not all(hasattr(group, "options") for group in groups):
            found.append("Parser._groups is not a list of groups with .options")
        else:
            for argument in registered_options(config)[:1]:
                if not (hasattr(argument, "dest") and callable(getattr(argument, "attrs", None))):
                    found.append("a parser option has no .dest or .attrs()")
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None and not callable(getattr(capture, "item_capture", None)):
        found.append("CaptureManager.item_capture() is gone")
    return found


def _item_problems(item: Any) -> list[str]:
    found: list[str] = []
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        found.append(f"{type(item).__name__}._fixtureinfo is gone")
    elif not isinstance(getattr(info, "name2fixturedefs", None), dict):
        found.append("FuncFixtureInfo.name2fixturedefs is not a dict")
    else:
        for definitions in list(info.name2fixturedefs.values())[:3]:
            fixturedef = definitions[-1]
            for attribute in ("scope", "params", "cached_result"):
                if not hasattr(fixturedef, attribute):
                    found.append(f"FixtureDef.{attribute} is gone")
    request = getattr(item, "_request", None)
    if request is None:
        found.append(f"{type(item).__name__}._request is gone")
    elif not callable(getattr(request, "getfixturevalue", None)):
        found.append("the item's _request has no getfixturevalue()")
    if not callable(getattr(item, "_initrequest", None)):
        found.append(f"{type(item).__name__}._initrequest() is gone")
    if not isinstance(getattr(item, "_report_sections", None), list):
        found.append(f"{type(item).__name__}._report_sections is not a list")
    return found


def describe(found: list[str], version: str) -> str:
    """The message for a pytest whose private shape moved: what changed and what to do."""
    return (
        f"pytest {version} changed internals that pytest --forkd-isolate runs tests with: "
        + "; ".join(found)
        + ". Use a pytest that forkd supports in the guest image (Debian bookworm's 7.2 up to 9.x) "
        "or update pytest-forkd."
    )
