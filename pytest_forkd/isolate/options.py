"""The isolation mode's options, ini keys and marker, and how each test runs under them.

``--forkd-isolate`` (ini ``forkd_isolate``, env ``PYTEST_FORKD_ISOLATE``) and
``--forkd-isolate-timeout`` (ini ``forkd_isolate_timeout``, env
``PYTEST_FORKD_ISOLATE_TIMEOUT``) resolve command line > env > ini > default,
as forkd's other settings do; ini ``forkd_isolate_paths`` and
``forkd_isolate_exclude`` say what is copied into the guest. The marker
``forkd_isolate(fresh=False, timeout=None)`` selects a test (class, module)
and sets how it runs. Registering the options is on every pytest start-up
path, so this module imports nothing heavy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Final

import pytest

from pytest_forkd.errors import ConfigError
from pytest_forkd.project.settings import ENV_PREFIX, INI_PREFIX, OPTION_PREFIX, parse_flag

MARKER: Final = "forkd_isolate"
MARKER_HELP: Final = (
    "forkd_isolate(fresh=False, timeout=None): run this test (class, module) in its own child VM of a parent "
    "where the suite is collected and session/module fixtures are set up (pytest --forkd-isolate: every test); "
    "fresh=True: set up its fixtures itself instead of inheriting the parent's; timeout: seconds before its VM "
    "is killed"
)
MARKER_ARGS: Final = ("fresh", "timeout")
#: Seconds an isolated test may take in its VM unless it says otherwise.
DEFAULT_TIMEOUT_S: Final = 600.0


@dataclass(frozen=True)
class IsolateSettings:
    """The isolation settings of a run, each resolved command line > env > ini > default."""

    enabled: bool = False
    timeout: float = DEFAULT_TIMEOUT_S
    paths: tuple[str, ...] = ()
    """Paths (relative to the rootdir) copied into the guest; empty: the rootdir."""
    exclude: tuple[str, ...] = ()
    """Glob patterns left out of the copy, besides the defaults."""
    timeout_given: bool = False
    """Whether the timeout was set (command line, env, ini) rather than the default."""


@dataclass(frozen=True)
class IsolatedTest:
    """How one selected test runs in isolation."""

    fresh: bool
    timeout: float
    file: str
    """Node id of its file (module)."""
    scope: str = ""
    """Node id of what its children inherit set up: its class, else its file (tests of one scope share it)."""
    plugin_timeout: float | None = None
    """pytest-timeout's limit for it (marker, ``--timeout``, env, ini), when the host has that plugin."""
    timeout_given: bool = False
    """Whether ``timeout`` was set for forkd (its marker, option, env or ini): it then holds even when the
    guest's pytest-timeout would wait longer."""


def add_options(group: pytest.OptionGroup, parser: pytest.Parser) -> None:
    """Register ``--forkd-isolate`` and ``--forkd-isolate-timeout`` (in ``group``) and their ini keys."""
    group.addoption(
        f"{OPTION_PREFIX}isolate",
        action="store_true",
        default=None,
        dest="forkd_isolate",
        help="run every test in its own child VM of a parent where the suite is collected and session/module "
        "fixtures are set up once (the project is copied in; its test dependencies go in the image via "
        f"forkd.yaml). Also ini {INI_PREFIX}isolate, env {ENV_PREFIX}ISOLATE",
    )
    group.addoption(
        f"{OPTION_PREFIX}isolate-timeout",
        default=None,
        dest="forkd_isolate_timeout",
        metavar="SECONDS",
        help=f"seconds an isolated test may take before its VM is killed (default: {DEFAULT_TIMEOUT_S:g}). "
        f"Also ini {INI_PREFIX}isolate_timeout, env {ENV_PREFIX}ISOLATE_TIMEOUT",
    )
    parser.addini(f"{INI_PREFIX}isolate", help="run every test in its own child VM (--forkd-isolate)", type="bool")
    parser.addini(f"{INI_PREFIX}isolate_timeout", help="seconds an isolated test may take (--forkd-isolate-timeout)")
    parser.addini(
        f"{INI_PREFIX}isolate_paths",
        help="paths (relative to the rootdir) copied into the guest for --forkd-isolate (default: the rootdir)",
        type="linelist",
    )
    parser.addini(
        f"{INI_PREFIX}isolate_exclude",
        help="glob patterns left out of what --forkd-isolate copies into the guest, besides .git, virtualenvs, "
        "caches and __pycache__",
        type="linelist",
    )


def parse_timeout(value: object, where: str) -> float:
    """A timeout in seconds (> 0); ConfigError naming ``where`` otherwise."""
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        seconds = -1.0
    if isinstance(value, bool) or not seconds > 0:
        raise ConfigError(f"{where}: expected a number of seconds > 0, e.g. 600, got {value!r}")
    return seconds


def _ini(config: pytest.Config, key: str) -> Any:
    try:
        return config.getini(key)
    except (pytest.UsageError, ValueError, TypeError) as exc:
        raise ConfigError(f"ini {key}: {exc}; fix it in the pytest ini file") from None


def resolve(config: pytest.Config, environ: dict[str, str] | None = None) -> IsolateSettings:
    """The run's isolation settings; ConfigError names a bad value and where it was set."""
    environ = dict(os.environ) if environ is None else environ
    enabled: bool = False
    if config.getoption("forkd_isolate", None):
        enabled = True
    elif environ.get(f"{ENV_PREFIX}ISOLATE", "") != "":
        enabled = parse_flag(environ[f"{ENV_PREFIX}ISOLATE"], f"{ENV_PREFIX}ISOLATE")
    else:
        enabled = bool(_ini(config, f"{INI_PREFIX}isolate"))
    timeout = DEFAULT_TIMEOUT_S
    cli_timeout = config.getoption("forkd_isolate_timeout", None)
    ini_timeout = _ini(config, f"{INI_PREFIX}isolate_timeout")
    if cli_timeout is not None:
        timeout = parse_timeout(cli_timeout, f"{OPTION_PREFIX}isolate-timeout")
    elif environ.get(f"{ENV_PREFIX}ISOLATE_TIMEOUT", "") != "":
        timeout = parse_timeout(environ[f"{ENV_PREFIX}ISOLATE_TIMEOUT"], f"{ENV_PREFIX}ISOLATE_TIMEOUT")
    elif ini_timeout:
        timeout = parse_timeout(ini_timeout, f"ini {INI_PREFIX}isolate_timeout")
    return IsolateSettings(
        enabled=enabled,
        timeout=timeout,
        timeout_given=cli_timeout is not None or bool(environ.get(f"{ENV_PREFIX}ISOLATE_TIMEOUT")) or bool(ini_timeout),
        paths=tuple(_ini(config, f"{INI_PREFIX}isolate_paths") or ()),
        exclude=tuple(_ini(config, f"{INI_PREFIX}isolate_exclude") or ()),
    )


def _file_nodeid(item: pytest.Item) -> str:
    node: Any = item.parent
    while node is not None and not isinstance(node, pytest.File):
        node = node.parent
    return str(node.nodeid if node is not None else item.nodeid.split("::")[0])


def scope_nodeid(item: pytest.Item) -> str:
    """Node id of the scope the item's children inherit set up: its class when the test uses class-scoped set-up
    (a class-scoped fixture, ``setup_class``, ``setUpClass``: pytest makes each a class-scoped fixture), else
    its file.

    A class without any runs in its module's branch: each scope of its own
    costs a branch of the parent and a child restored afresh for its first
    test.
    """
    from pytest_forkd.guest import isolate_pytest

    node: Any = item.parent
    while node is not None and not isinstance(node, (pytest.Class, pytest.File)):
        node = node.parent
    if not isinstance(node, pytest.Class):
        return _file_nodeid(item)
    definitions = isolate_pytest.fixture_definitions(item) or {}
    for name in getattr(item, "fixturenames", ()):
        found = definitions.get(name)
        if found and isolate_pytest.fixture_scope(found[-1]) == "class":
            return str(node.nodeid)
    return _file_nodeid(item)


def pytest_timeout_seconds(item: pytest.Item, environ: dict[str, str] | None = None) -> float | None:
    """pytest-timeout's limit for ``item`` as that plugin reads it (marker, option, env, ini); None without it."""
    config = item.config
    if not config.pluginmanager.hasplugin("timeout"):
        return None
    marker = item.get_closest_marker("timeout")
    candidates: list[object] = []
    if marker is not None:
        candidates += [marker.args[0]] if marker.args else [marker.kwargs.get("timeout")]
    environ = dict(os.environ) if environ is None else environ
    candidates += [config.getoption("timeout", None), environ.get("PYTEST_TIMEOUT")]
    try:
        candidates.append(config.getini("timeout"))
    except (ValueError, pytest.UsageError):
        pass
    for candidate in candidates:
        if candidate is None or candidate == "":
            continue
        try:
            seconds = float(candidate)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return None
        return seconds if seconds > 0 else None
    return None


def runs_on_host(item: pytest.Item) -> bool:
    """Whether the test drives forkd VMs itself (a forkd fixture): then it stays on the host."""
    return any(name.startswith(("forkd", "_forkd")) for name in getattr(item, "fixturenames", ()))


def isolated_test(item: pytest.Item, settings: IsolateSettings) -> IsolatedTest | None:
    """How ``item`` runs in isolation, or None when it runs on the host; ConfigError for a bad marker."""
    marker = item.get_closest_marker(MARKER)
    if (marker is None and not settings.enabled) or runs_on_host(item):
        return None
    kwargs = dict(marker.kwargs) if marker is not None else {}
    where = f"forkd_isolate marker on {item.nodeid}"
    if marker is not None and marker.args:
        raise ConfigError(f"{where}: takes keyword arguments only, e.g. forkd_isolate(fresh=True, timeout=60)")
    unknown = sorted(set(kwargs) - set(MARKER_ARGS))
    if unknown:
        raise ConfigError(
            f"{where}: unknown argument(s) {', '.join(unknown)}; valid arguments: {', '.join(MARKER_ARGS)}"
        )
    fresh = kwargs.get("fresh", False)
    if not isinstance(fresh, bool):
        raise ConfigError(f"{where}: fresh: expected True or False, got {fresh!r}")
    timeout = settings.timeout
    given = settings.timeout_given
    if kwargs.get("timeout") is not None:
        timeout = parse_timeout(kwargs["timeout"], f"{where}: timeout")
        given = True
    else:
        timeout_marker = item.get_closest_marker("timeout")  # pytest-timeout's, when the suite uses it
        if timeout_marker is not None and timeout_marker.args:
            try:
                timeout = parse_timeout(timeout_marker.args[0], f"timeout marker on {item.nodeid}")
            except ConfigError:
                pass
    return IsolatedTest(
        fresh=fresh,
        timeout=timeout,
        file=_file_nodeid(item),
        scope=scope_nodeid(item),
        plugin_timeout=pytest_timeout_seconds(item),
        timeout_given=given,
    )
