"""Which of the host's pytest settings the guest's pytest gets: command line, options by name, plugins, environment.

The host parses the command line, ``PYTEST_ADDOPTS`` and the ini file's
``addopts`` as always; the guest gets what that parse produced rather than
the text, so an ``addopts`` line that names a host-only option (``-n 4``,
``--junitxml``) cannot stop the guest's pytest, and nothing is applied
twice (the guest runs with ``-o addopts=``):

- on its command line, what pytest reads before any plugin is configured:
  the rootdir and ini file, ``-p NAME`` and ``-p no:NAME`` (from anywhere:
  ``addopts = -p pytester`` loads pytester in the guest too), capture,
  import mode, assertion mode, ``--confcutdir``, ``--noconftest``, ``-o``
  overrides and ``-W`` filters;
- by name, set before any ``pytest_configure`` runs: every option a plugin
  or a ``conftest.py`` registered, in any group, whose value differs from
  its default (``--timeout``, ``--asyncio-mode``, a conftest's
  ``--flavour``), a few of pytest's own that change how tests run
  (:data:`PYTEST_OPTIONS`), and the report options of the terminal plugin
  (``-v``, ``--tb``, ``-l``...), which shape assertion messages and
  tracebacks although the guest has no terminal. Options of the plugins
  that act on the host alone (:data:`HOST_PLUGINS`) stay here;
- the environment variables pytest and its plugins read (``PYTEST_*``)
  and ``PYTHONPATH``.

An option the guest's plugins do not know stops the run with one line
naming it and the plugin the guest lacks (:func:`explain_refused`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

import pytest

from pytest_forkd.guest import isolate_pytest

#: Plugins the guest's pytest never loads: the host runs them (or they make no sense in a child VM).
GUEST_BLOCKED_PLUGINS: Final = ("cacheprovider", "xdist", "terminal", "forkd")
#: Plugins that act on the host alone (distribution, reporting): their options are not passed on.
HOST_PLUGINS: Final = frozenset(
    {*GUEST_BLOCKED_PLUGINS, "xdist.looponfail", "html", "pytest_html", "metadata", "pytest_metadata"}
)
#: Options of the terminal plugin (not loaded in the guest) that shape a report's text, set by name there.
REPORT_OPTIONS: Final = ("verbose", "tbstyle", "showlocals", "fulltrace", "showcapture")
#: pytest's own options that change how a test runs, passed on by name (the rest act on the host's loop).
PYTEST_OPTIONS: Final = frozenset(
    {
        "runxfail",
        "strict_markers",
        "doctestmodules",
        "doctestglob",
        "doctestreport",
        "doctest_ignore_import_errors",
        "doctest_continue_on_failure",
        "log_level",
        "log_format",
        "log_date_format",
        "log_auto_indent",
        "lsof",
        "runpytest",
    }
)
#: Environment variables of pytest's that are not passed on: applied on the host, or the host's own.
HOST_ENVIRONMENT: Final = ("PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST", "PYTEST_VERSION", "PYTEST_XDIST_", "PYTEST_FORKD_")


def command_line(config: pytest.Config, files: list[str]) -> list[str]:
    """The guest pytest's command line: what pytest reads before it configures, and the test files."""
    option = config.option
    args = ["--rootdir", str(config.rootpath)]
    if config.inipath is not None:
        args += ["-c", str(config.inipath)]
    args += ["-o", "addopts="]
    for name in GUEST_BLOCKED_PLUGINS:
        args += ["-p", f"no:{name}"]
    for plugin in getattr(option, "plugins", None) or ():
        name = plugin[3:] if plugin.startswith("no:") else plugin
        if name not in HOST_PLUGINS:
            args += ["-p", plugin]
    for dest, flag in (
        ("capture", "--capture"),
        ("importmode", "--import-mode"),
        ("assertmode", "--assert"),
        ("confcutdir", "--confcutdir"),
    ):
        value = getattr(option, dest, None)
        if value is not None and str(value) and value != _default_of(config, dest):
            args.append(f"{flag}={value}")
    for dest, flag in (
        ("doctestmodules", "--doctest-modules"),
        ("noconftest", "--noconftest"),
    ):
        if getattr(option, dest, False) is True:
            args.append(flag)
    for override in getattr(option, "override_ini", None) or ():
        if not override.split("=", 1)[0].strip() == "addopts":
            args += ["-o", override]
    for warning_filter in getattr(option, "pythonwarnings", None) or ():
        args += ["-W", warning_filter]
    return [*args, *files]


def _default_of(config: pytest.Config, dest: str) -> Any:
    for argument in isolate_pytest.registered_options(config):
        if argument.dest == dest:
            return isolate_pytest.option_default(argument)
    return None


def report_options(config: pytest.Config) -> dict[str, Any]:
    """The terminal plugin's options that shape a report's text (``-v``, ``--tb``, ``-l``...)."""
    forwarded: dict[str, Any] = {}
    for name in REPORT_OPTIONS:
        value = getattr(config.option, name, None)
        if isinstance(value, (bool, int, str)):
            forwarded[name] = value
    return forwarded


def options_by_name(config: pytest.Config, owners: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Every option passed on by name: a plugin's or conftest.py's, or one of :data:`PYTEST_OPTIONS`, set
    to something else than its default. Only values JSON can carry (a plugin that parses an option into an
    object of its own gets its default in the guest)."""
    owners = option_owners(config) if owners is None else owners
    defaults: dict[str, list[Any]] = {}
    for argument in isolate_pytest.registered_options(config):
        dest = getattr(argument, "dest", None)
        if isinstance(dest, str):  # several flags may share one (--cov and --cov-reset): any default counts
            defaults.setdefault(dest, []).append(isolate_pytest.option_default(argument))
    forwarded: dict[str, Any] = {}
    for dest, dest_defaults in defaults.items():
        if dest.startswith("forkd") or dest in REPORT_OPTIONS:
            continue
        owner = owners.get(dest, "")
        if owner in HOST_PLUGINS or (_is_pytests_own(config, owner) and dest not in PYTEST_OPTIONS):
            continue
        value = getattr(config.option, dest, None)
        if value in dest_defaults:
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        forwarded[dest] = value
    return forwarded


def _is_pytests_own(config: pytest.Config, plugin_name: str) -> bool:
    plugin = config.pluginmanager.get_plugin(plugin_name) if plugin_name else None
    return str(getattr(plugin, "__name__", "")).startswith("_pytest.")


class _Recorder:
    """A parser (and group, and plugin manager) that only notes the options added to it."""

    def __init__(self, dests: list[str]) -> None:
        self.dests = dests

    def addoption(self, *names: str, **attrs: Any) -> None:
        dest = attrs.get("dest")
        if not dest:
            long_names = [name for name in names if name.startswith("--")]
            chosen = long_names[0][2:] if long_names else (names[0].lstrip("-") if names else "")
            dest = chosen.replace("-", "_")
        self.dests.append(str(dest))

    _addoption = addoption

    def getgroup(self, *args: Any, **kwargs: Any) -> _Recorder:
        return self

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def option_owners(config: pytest.Config) -> dict[str, str]:
    """Option dest -> the name of the plugin (or conftest.py) that registered it.

    pytest does not record it, so each ``pytest_addoption`` is called again
    with a parser that only notes the options added to it.
    """
    owners: dict[str, str] = {}
    for implementation in config.pluginmanager.hook.pytest_addoption.get_hookimpls():
        dests: list[str] = []
        recorder = _Recorder(dests)
        given = {"parser": recorder, "pluginmanager": recorder}
        try:
            implementation.function(**{name: given[name] for name in implementation.argnames if name in given})
        except Exception:  # a plugin that needs more than a parser: its options count as a plugin's
            continue
        for dest in dests:
            owners.setdefault(dest, implementation.plugin_name)
    return owners


def environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The host's ``PYTEST_*`` variables the guest's plugins read (``PYTEST_TIMEOUT``...) and ``PYTHONPATH``."""
    passed = {
        name: value
        for name, value in environ.items()
        if name.startswith("PYTEST_") and not any(name.startswith(host) for host in HOST_ENVIRONMENT)
    }
    if environ.get("PYTHONPATH"):
        passed["PYTHONPATH"] = environ["PYTHONPATH"]
    return passed


def _distribution_of(config: pytest.Config, plugin_name: str) -> str:
    plugin = config.pluginmanager.get_plugin(plugin_name)
    for candidate, dist in config.pluginmanager.list_plugin_distinfo():
        if candidate is plugin:
            name = getattr(dist, "project_name", None) or dist.metadata["name"]
            return f"{name} {dist.version}"
    return ""


def explain_refused(config: pytest.Config, dests: list[str]) -> str:
    """One line naming the options the guest's pytest does not know and the plugins they come from."""
    owners = option_owners(config)
    names = {argument.dest: argument.names() for argument in isolate_pytest.registered_options(config)}
    parts = []
    packages = []
    for dest in dests:
        flag = (names.get(dest) or [dest])[-1]
        value = getattr(config.option, dest, None)
        given = flag if value is True else f"{flag}={value}"
        owner = owners.get(dest, "")
        if owner and not owner.endswith("conftest.py"):
            distribution = _distribution_of(config, owner)
            source = f"plugin {owner!r}" + (f" ({distribution})" if distribution else "")
            if distribution:
                packages.append("python3-" + distribution.split()[0].lower().replace("_", "-"))
        else:
            source = f"{owner or 'a conftest.py'}"
        parts.append(f"{given} (from {source})")
    fix = "add the plugin to the guest image in forkd.yaml"
    if packages:
        fix += f" (images: NAME: packages: [{', '.join(packages)}], as Debian names it)"
    return (
        f"pytest --forkd-isolate: the guest's pytest does not know {', '.join(parts)}, which the host passes on; "
        f"{fix}, or leave the option out"
    )
