"""Reference pages of the docs generated from the code, so they cannot drift from it.

The docs build (``make docs``, ``mkdocs build``) loads this file as a MkDocs
hook (``hooks:`` in mkdocs.yml): :func:`on_files` adds these pages, which are
never written to disk:

- ``reference/options.md``: every ``--forkd-*`` option the plugin registers
  (recorded by calling the plugin's own ``pytest_addoption``), every ini key
  and ``PYTEST_FORKD_*`` variable of :data:`pytest_forkd.project.settings.OPTIONS`,
  and the ``FORKD_*`` environment variables the package reads;
- ``reference/markers.md``: the markers, as the plugin declares them to pytest;
- ``reference/forkd-yaml.md``: the keys forkd.yaml's loader accepts;
- ``reference/cli.md``: the ``--help`` of ``forkd`` and of each of its
  commands, from the argparse parsers.

``python scripts/docs_reference.py DIR`` writes the same pages into DIR, to
read them without building the site. tests/unit/test_docs.py checks the
pages against the code.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parent.parent

# The FORKD_* variables the package reads (besides one PYTEST_FORKD_* per setting), and what each does.
# tests/unit/test_docs.py fails when the package reads a FORKD_* variable that is neither here nor in INTERNAL_ENV.
ENVIRONMENT: dict[str, str] = {
    "FORKD_STORE": "The snapshot store directory, for the plugin and every `forkd` command "
    "(the plugin's `--forkd-store` and `PYTEST_FORKD_STORE` take precedence). Default: `<cache>/snapshots`.",
    "FORKD_CACHE_DIR": "Root of everything persistent (images, .deb cache, accelerator verdict, snapshots). "
    "Default: `$XDG_CACHE_HOME/pytest-forkd`, else `~/.cache/pytest-forkd`. Share it to share guest images too.",
    "FORKD_SHM_DIR": "The runtime directory holding guest RAM files, sockets and console logs. "
    "Default: `/dev/shm/pytest-forkd-<uid>`.",
    "FORKD_QEMU": "Path of the `qemu-system-x86_64` binary to use instead of the one on `PATH`.",
    "FORKD_DEBUG": "`1`: every `forkd` command prints the traceback and the whole message of an error "
    "(like `--debug`).",
    "FORKD_DEBIAN_MIRROR": "Debian mirror guest images are built from (the archive root holding `dists/` and "
    "`pool/`); see [Guest images](../guides/images.md).",
    "FORKD_DEBIAN_SECURITY_MIRROR": "Debian security archive read with the mirror; `none` turns it off.",
    "FORKD_DEBIAN_KEYRING": "Keyring the mirror's Release file must be signed with. Default: "
    "`/usr/share/keyrings/debian-archive-keyring.gpg`.",
    "FORKD_MAX_MEMORY_MIB": "Raises the cap on a VM's `memory_mib` (default: half the host's RAM).",
    "FORKD_MAX_VCPUS": "Raises the cap on a VM's `vcpus` (default: the host's CPU count).",
    "FORKD_ZSTD": "`binary` or `module`: which zstd snapshot archives use (default: the `zstd` tool when it is "
    "on `PATH`, else the `zstandard` module of the `archive` extra).",
}
# Read by the package but set by the package itself for a child process it starts (FORKD_RUNTIME: by the
# guest's /init for the agent in a container image): not a user setting.
INTERNAL_ENV: frozenset[str] = frozenset({"FORKD_BENCH_COMMAND", "FORKD_RUNTIME"})


# What each key of forkd.yaml means, by section. tests/unit/test_docs.py fails when pytest_forkd.project.config
# accepts a key that is not described here (settings: keys are described by the settings table when they are
# settings of the run; SETTINGS_ONLY_IN_YAML describes the others).
YAML_SECTIONS: dict[str, str] = {
    "settings": "Defaults for the run's settings, the lowest precedence (see the table below and "
    "[Options](options.md)).",
    "images": "Guest images built for this project: `images: {NAME: {...}}`, used as `from: image:NAME`.",
    "snapshots": "Named snapshots built once and cached: `snapshots: {NAME: {...}}`, used with "
    "`--forkd-snapshot=NAME` or `@pytest.mark.forkd(snapshot=NAME)`.",
    "budgets": "Suite-wide latency budgets: `budgets: {OPERATION: {STAT_ms: LIMIT, backends: {BACKEND: {...}}}}`.",
}
YAML_SNAPSHOT_KEYS: dict[str, str] = {
    "from": "What it starts from: another snapshot's name, `image:NAME` to boot a guest image, or a container "
    "image: `docker://REF`, `dockerfile:PATH`, `oci:DIR[:TAG]`, `oci-archive:FILE[:TAG]`, `docker-archive:FILE` "
    "(paths relative to forkd.yaml; see [Container images](../guides/container-images.md)) (default: `base`; "
    "for a project's own `base`, `image:default`).",
    "memory_mib": "Guest memory in MiB (default: that of `from`; 256 when booting an image; at least what the "
    "image needs to boot).",
    "vcpus": "Virtual CPUs (default: that of `from`).",
    "env": "Environment variables exported to the setup commands and to every command of every VM forked from "
    "it; snapshots built `from:` it may add to them.",
    "workdir": "Working directory (created) of the setup commands and of every command of its VMs.",
    "files": "Host file or directory (relative to forkd.yaml) -> guest path, or `{to: PATH, exclude: [GLOB...]}` "
    "for a tree; a changed file rebuilds the snapshot.",
    "setup": "Shell commands run in the guest in order; the first failure stops the build.",
    "shared": "`true`: one snapshot for every project of the store instead of one per project.",
    "network": "`none`, `outbound`, `host`, a list of host ports, or `{mode, allow, forward}` (default: that of "
    "`from`; none when booting an image); see "
    "[Guest networking](../guides/networking.md).",
}
YAML_IMAGE_KEYS: dict[str, str] = {
    "recipe": "`default` (the built-in recipe) or a recipe file relative to forkd.yaml.",
    "packages": "Extra Debian packages, with their dependencies.",
    "files": "Host file -> guest path, put into the image's initramfs.",
    "setup": "Commands run in the guest after it boots, before a snapshot's own setup.",
}
SETTINGS_ONLY_IN_YAML: dict[str, str] = {
    "debian_mirror": "Debian mirror guest images are built from (after `--mirror` and `FORKD_DEBIAN_MIRROR`).",
    "insecure_registries": "Registries (`HOST[:PORT]`) container images may be pulled from over plain HTTP, "
    "beyond localhost and 127.0.0.0/8, which always may.",
}


class _Recorder:
    """Stands in for pytest's Parser and OptionGroup: records what the plugin registers."""

    def __init__(self) -> None:
        self.options: list[tuple[tuple[str, ...], dict[str, Any]]] = []
        self.ini: list[tuple[str, str, dict[str, Any]]] = []

    def getgroup(self, name: str, description: str = "", **kwargs: Any) -> _Recorder:
        return self

    def addoption(self, *names: str, **kwargs: Any) -> None:
        self.options.append((names, kwargs))

    def _addoption(self, *names: str, **kwargs: Any) -> None:
        self.options.append((names, kwargs))

    def addini(self, name: str, help: str, type: Any = None, default: Any = None, **kwargs: Any) -> None:  # noqa: A002
        self.ini.append((name, help, {"type": type, "default": default, **kwargs}))


class _MarkerConfig:
    """Stands in for pytest's Config in the plugin's ``add_markers``."""

    def __init__(self) -> None:
        self.markers: list[str] = []

    def addinivalue_line(self, name: str, line: str) -> None:
        if name == "markers":
            self.markers.append(line)


def _cell(text: object) -> str:
    """Text for a table cell: no line break, no column separator, no raw HTML (``failed-<test>``)."""
    parts = str(text).replace("|", "\\|").replace("\n", " ").split("`")
    return "`".join(part if index % 2 else part.replace("<", "&lt;") for index, part in enumerate(parts))


def _default(value: object) -> str:
    if value is None or value == "" or value == []:
        return ""
    return f"`{value}`"


def options_page() -> str:
    """The command-line options, ini keys and environment variables, from the code that registers them."""
    from pytest_forkd.plugin.options import pytest_addoption
    from pytest_forkd.project.config import SETTING_KEYS
    from pytest_forkd.project.settings import ENV_PREFIX, INI_PREFIX, OPTIONS

    recorder = _Recorder()
    pytest_addoption(recorder)  # type: ignore[arg-type]
    settings_flags = {option.flag for option in OPTIONS}
    lines = [
        "# Options, ini keys and environment variables",
        "",
        "Generated from the plugin's option registration (`pytest_forkd.plugin.options`) and the settings "
        "table (`pytest_forkd.project.settings.OPTIONS`) when the docs are built. `pytest --help` lists the same "
        "options in three `pytest-forkd` groups: VMs and snapshots; timings, budgets and baselines; reports.",
        "",
        "## Settings",
        "",
        f"Each setting is a command-line option, an ini key (`{INI_PREFIX}*` in pytest.ini, tox.ini or the "
        f"`[tool.pytest.ini_options]` table of pyproject.toml), an environment variable (`{ENV_PREFIX}*`) and, "
        "except the project file's own path, a key under `settings:` in forkd.yaml. Precedence: a test's "
        "marker, then the command line, then the environment, then the ini file, then forkd.yaml.",
        "",
        "| option | also set as (ini key, environment variable, forkd.yaml) | what |",
        "|---|---|---|",
    ]
    for option in OPTIONS:
        flag = option.flag if option.is_flag else f"{option.flag}={option.metavar or 'VALUE'}"
        also = f"`{option.ini_key}`<br>`{option.env_var}`"
        if option.name in SETTING_KEYS:
            also += f"<br>`settings: {option.name}`"
        lines.append(f"| `{flag}` | {also} | {_cell(option.help)} |")
    lines += [
        "",
        "## Run options",
        "",
        "Latency budgets, timing files, baselines and transcripts of one run: command line only "
        "(budgets can also be written in forkd.yaml, see [Budgets and baselines](../guides/budgets.md)).",
        "",
        "| option | what |",
        "|---|---|",
    ]
    for names, kwargs in recorder.options:
        if set(names) & settings_flags:
            continue
        metavar = kwargs.get("metavar")
        shown = ", ".join(f"`{name}={metavar}`" if metavar else f"`{name}`" for name in names)
        help_text = str(kwargs.get("help", "")).replace("%%", "%")
        lines.append(f"| {shown} | {_cell(help_text)} |")
    lines += [
        "",
        "## Ini keys",
        "",
        "| ini key | type | what |",
        "|---|---|---|",
    ]
    for name, help_text, extra in recorder.ini:
        kind = extra.get("type") or "string"
        lines.append(f"| `{name}` | {_cell(kind)} | {_cell(help_text)} |")
    lines += [
        "",
        "## Environment variables",
        "",
        f"Besides one `{ENV_PREFIX}*` variable per setting (above), the package reads:",
        "",
        "| variable | what |",
        "|---|---|",
    ]
    for name, text in sorted(ENVIRONMENT.items()):
        lines.append(f"| `{name}` | {_cell(text)} |")
    return "\n".join(lines) + "\n"


def markers_page() -> str:
    """The markers, with the help text the plugin gives pytest (``pytest --markers``)."""
    from pytest_forkd.plugin.options import add_markers

    config = _MarkerConfig()
    add_markers(config)  # type: ignore[arg-type]
    lines = [
        "# Markers",
        "",
        "Generated from the plugin's marker declarations (`pytest --markers` prints the same). A marker's "
        "values win over every other setting for that test; a keyword the marker does not know fails the run "
        "before any VM starts.",
        "",
    ]
    for text in config.markers:
        signature, _, help_text = text.partition(": ")
        name = signature.split("(")[0]
        lines += [f"## `{name}`", "", "```python", f"@pytest.mark.{signature}", "```", "", help_text.strip(), ""]
    return "\n".join(lines)


@contextlib.contextmanager
def _columns(width: int) -> Iterator[None]:
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)
    try:
        yield
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous


def _commands(parser: argparse.ArgumentParser, prefix: str) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield prefix, parser
    for action in parser._actions:  # argparse keeps sub-commands only here
        if isinstance(action, argparse._SubParsersAction):
            seen: set[int] = set()
            for name, sub in action.choices.items():
                if id(sub) not in seen:  # an alias (`list` for `ls`) is the same parser under another name
                    seen.add(id(sub))
                    yield from _commands(sub, f"{prefix} {name}")


def cli_commands() -> list[tuple[str, str]]:
    """Every ``forkd`` command and sub-command with its ``--help`` text."""
    from pytest_forkd.cli import build_parser

    with _columns(100):
        return [(name, sub.format_help()) for name, sub in _commands(build_parser(), "forkd")]


def cli_page() -> str:
    """The ``forkd`` command line, from its argparse parsers."""
    lines = [
        "# Command line",
        "",
        "Generated from the `forkd` command's argparse parsers (`forkd COMMAND --help` prints the same). "
        "Every command is one error boundary: whatever goes wrong prints one line, `forkd: error: ...`, saying "
        "what to do, and exits with status 2; `--debug` (anywhere before the command's own arguments, or "
        "`FORKD_DEBUG=1`) adds the traceback and the whole message. `forkd --version` prints the version.",
        "",
        '--8<-- "docs/_parts/cli-overview.md"',
        "",
    ]
    for name, help_text in cli_commands():
        lines += [f"## `{name}`", "", "```text", help_text.rstrip(), "```", ""]
    return "\n".join(lines)


BENCH_MARKER = re.compile(r"^<!-- forkd-bench: (?P<path>\S+) -->$", re.MULTILINE)


def _ms(value: object) -> str:
    return f"{value:.1f}" if isinstance(value, (int, float)) else str(value)


def bench_table(result: dict[str, Any]) -> str:
    """A Markdown table of a ``forkd bench --json`` result (or of a ``--sweep`` one).

    Figures (``{"n", "min", "p50", "p95", "max"}``) become rows; plain
    numbers a second table; the conditions of the run a line above them.
    """
    lines: list[str] = []
    conditions = result.get("conditions")
    if isinstance(conditions, dict):
        lines += ["Conditions: " + ", ".join(f"{key} `{value}`" for key, value in conditions.items()), ""]
    if isinstance(result.get("branch"), list) and isinstance(result.get("fork"), list):  # forkd bench --sweep
        lines += [
            "| backend | memory MiB | dirty MiB | pause p50 ms | pause p95 ms | total p50 ms |",
            "|---|---|---|---|---|---|",
        ]
        for row in result["branch"]:
            pause, total = row["pause_ms"], row["total_ms"]
            lines.append(
                f"| `{row['backend']}` | {row['memory_mib']} | {row['dirty_mib']} | {_ms(pause['p50'])} "
                f"| {_ms(pause['p95'])} | {_ms(total['p50'])} |"
            )
        lines += ["", "| memory MiB | fork p50 ms | fork p95 ms | n |", "|---|---|---|---|"]
        for row in result["fork"]:
            fork = row["fork_ms"]
            lines.append(f"| {row['memory_mib']} | {_ms(fork['p50'])} | {_ms(fork['p95'])} | {fork['n']} |")
        return "\n".join(lines) + "\n"
    figures = {k: v for k, v in result.items() if isinstance(v, dict) and "p50" in v}
    scalars = {k: v for k, v in result.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
    if figures:
        lines += ["| figure | n | p50 | p95 | max |", "|---|---|---|---|---|"]
        for name, fig in figures.items():
            lines.append(
                f"| `{name}` | {fig.get('n', '')} | {_ms(fig['p50'])} | {_ms(fig.get('p95', ''))} "
                f"| {_ms(fig.get('max', ''))} |"
            )
        lines.append("")
    if scalars:
        lines += ["| figure | value |", "|---|---|"]
        lines += [f"| `{name}` | {_cell(value)} |" for name, value in scalars.items()]
    return "\n".join(lines) + "\n"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs hook: replace each ``<!-- forkd-bench: FILE -->`` line by the table of that bench JSON file.

    FILE is relative to the docs directory; a missing or unreadable file fails the build.
    """
    docs_dir = Path(config["docs_dir"])

    def render(match: re.Match[str]) -> str:
        return bench_table(json.loads((docs_dir / match.group("path")).read_text()))

    return BENCH_MARKER.sub(render, markdown)


SPHINX_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|const):<code>(~?)([^<]*)</code>")


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs hook: docstrings use Sphinx roles (``:class:`VM```); show them as the code they name.

    ``:class:`~pytest_forkd.core.vm.VM``` reads as ``VM``, as Sphinx would show it.
    """

    def render(match: re.Match[str]) -> str:
        name = match.group(2)
        return f"<code>{name.rsplit('.', 1)[-1] if match.group(1) else name}</code>"

    return SPHINX_ROLE.sub(render, html)


def forkd_yaml_page() -> str:
    """The keys of forkd.yaml, from the keys its loader accepts."""
    from pytest_forkd.latency.budgets import BUDGET_STATS
    from pytest_forkd.latency.timings import KNOWN_OPS
    from pytest_forkd.project import config
    from pytest_forkd.project.settings import OPTIONS

    helps = {option.name: option.help for option in OPTIONS} | SETTINGS_ONLY_IN_YAML
    lines = [
        "# forkd.yaml",
        "",
        "The project file, next to the tests (or `--forkd-config=PATH`). Generated from the keys its loader "
        "(`pytest_forkd.project.config`) accepts; an unknown key, or a value of the wrong type, fails the run "
        "before any test with the file, the field path and the fix. Examples: "
        "[Tests with pytest](../guides/pytest.md#forkdyaml).",
        "",
        "```yaml",
        "settings: {pool: 2, max_output: 16MiB}",
        "images:",
        "  tools: {packages: [jq, git]}",
        "snapshots:",
        "  work:",
        "    from: image:tools",
        "    files: {src: {to: /srv/app, exclude: ['*.pyc']}}",
        "    setup: [cd /srv/app && make deps]",
        "budgets:",
        "  fork: {p95_ms: 2000, backends: {full: {p95_ms: 4000}}}",
        "```",
        "",
        "## Sections",
        "",
        "| key | what |",
        "|---|---|",
    ]
    lines += [f"| `{key}` | {_cell(YAML_SECTIONS[key])} |" for key in config._TOP_LEVEL_KEYS]
    lines += ["", "## `settings:`", "", "| key | what |", "|---|---|"]
    lines += [f"| `{key}` | {_cell(helps[key])} |" for key in config.SETTING_KEYS]
    lines += ["", "## `snapshots:` NAME", "", "| key | what |", "|---|---|"]
    lines += [f"| `{key}` | {_cell(YAML_SNAPSHOT_KEYS[key])} |" for key in config._SNAPSHOT_KEYS]
    lines += ["", "## `images:` NAME", "", "| key | what |", "|---|---|"]
    lines += [f"| `{key}` | {_cell(YAML_IMAGE_KEYS[key])} |" for key in config._IMAGE_KEYS]
    lines += [
        "",
        "## `budgets:` OPERATION",
        "",
        "Operations: "
        + ", ".join(f"`{op}`" for op in KNOWN_OPS)
        + ". Limits, in milliseconds: "
        + ", ".join(f"`{stat}_ms`" for stat in BUDGET_STATS)
        + "; `backends: {BACKEND: {...}}` gives a storage backend limits of its own. See "
        "[Budgets and baselines](../guides/budgets.md).",
        "",
    ]
    return "\n".join(lines)


PAGES = {
    "reference/options.md": options_page,
    "reference/markers.md": markers_page,
    "reference/forkd-yaml.md": forkd_yaml_page,
    "reference/cli.md": cli_page,
}


def on_files(files: Any, config: Any) -> Any:
    """MkDocs hook: add the generated pages to the site."""
    from mkdocs.structure.files import File

    for path, make in PAGES.items():
        files.append(File.generated(config, path, content=make()))
    return files


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/docs_reference.py OUTPUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    for path, make in PAGES.items():
        target = out / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(make())
        print(target)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main(sys.argv[1:]))
