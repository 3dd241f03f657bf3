"""The ``forkd`` command line.

Each sub-command lives in its own module of this package
and exposes ``add_parser(subparsers)`` and ``run(args) -> int``; this module
only wires them together and is the error boundary: every exception becomes
a one-line error (the traceback with ``--debug``) and an exit status as
pytest's: 4 for bad input, 1 for a failure, 2 for a bug, so no user ever
sees a traceback for bad input. Sub-command modules are imported
only when their command runs. A command with actions (``forkd snapshots``,
``forkd image``) lists when no action is named and takes ``list`` for ``ls``
(:class:`CommandParser`).

Layer 7 of docs/ARCHITECTURE.md, beside plugin. May import: every layer
below it. Nothing imports it (the ``forkd`` script's entry point is
:func:`main`); checked by tests/unit/test_layers.py.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
import warnings
from typing import Any, NoReturn, Sequence

from pytest_forkd.errors import ConfigError, ForkdError
from pytest_forkd.version import __version__

COMMAND_MODULES = ("image", "exec", "shell", "cp", "doctor", "snapshots", "bench", "compare", "merge", "bisect", "e2b")

#: The action a command with actions (``forkd snapshots``, ``forkd image``) runs when none is named.
DEFAULT_ACTION = "ls"
#: Other names every command with actions accepts for an action of its own.
ACTION_ALIASES: dict[str, tuple[str, ...]] = {"ls": ("list",)}


class CommandParser(argparse.ArgumentParser):
    """The parser of ``forkd`` and of each of its commands (argparse makes sub-parsers of the parent's class).

    A command with actions takes :data:`DEFAULT_ACTION` when none is named, so
    ``forkd snapshots`` and ``forkd snapshots --all`` list as ``forkd snapshots ls``
    does, and every action gets its :data:`ACTION_ALIASES`. Both are applied to
    whatever actions a command's module adds, so a new action needs nothing more.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", _Actions)

    def error(self, message: str) -> NoReturn:
        """A command line argparse cannot read is a usage error: exit status 4, as pytest's."""
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE_ERROR, f"{self.prog}: error: {message}\n")

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if args is not None:
            args = self._with_default_action(list(args))
        return super().parse_known_args(args, namespace)

    def _with_default_action(self, words: list[str]) -> list[str]:
        """``words`` with the default action put first when they name no action (and ask for no help)."""
        actions = next((action for action in self._actions if isinstance(action, _Actions)), None)
        if actions is None or DEFAULT_ACTION not in actions.choices:
            return words
        if not words or (words[0].startswith("-") and words[0] not in ("-h", "--help")):
            return [DEFAULT_ACTION, *words]
        return words


class _Actions(argparse._SubParsersAction):  # type: ignore[type-arg]
    """A command's actions: each is added with its aliases, and an alias runs as its action's own name."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        aliases = [*kwargs.pop("aliases", ()), *ACTION_ALIASES.get(name, ())]
        if name == DEFAULT_ACTION and kwargs.get("help"):
            kwargs["help"] = f"{kwargs['help']} (the default)"
        return super().add_parser(name, aliases=aliases, **kwargs)  # type: ignore[no-any-return]

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        names = {alias: name for name, aliases in ACTION_ALIASES.items() for alias in aliases}
        chosen = self._name_parser_map.get(values[0]) if values else None
        name = names.get(values[0]) if values else None
        if chosen is not None and name is not None and self._name_parser_map.get(name) is chosen:
            values = [name, *values[1:]]  # `forkd snapshots list` runs as `ls`: the command reads its own name
        super().__call__(parser, namespace, values, option_string)


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="forkd", description="Real microVMs as cheap as fork(): images, VMs, snapshots, benchmarks."
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help=f"print the traceback of an error, not just its one line (also {DEBUG_ENV}=1)",
    )
    parser.add_argument(
        "--version", action="version", version=f"forkd (pytest-forkd) {__version__}", help="print the version and exit"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"pytest_forkd.cli.{name}_cmd")
        except ModuleNotFoundError as exc:  # a command not shipped in this build
            if exc.name != f"pytest_forkd.cli.{name}_cmd":
                raise
            continue
        module.add_parser(subparsers)
    return parser


DEBUG_ENV = "FORKD_DEBUG"


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``forkd`` command; returns the exit status.

    The error boundary of the command line: any exception a command lets
    out becomes one line on stderr and an exit status (a ForkdError says what
    to do; anything else is reported as an internal error). ``--debug`` (or
    ``FORKD_DEBUG=1``) prints the traceback too.
    """
    words, debug = _take_debug_flag(list(sys.argv[1:] if argv is None else argv))
    debug = debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    parser = build_parser()
    args = parser.parse_args(words)
    from pytest_forkd.engine import cancel

    cancel.install()  # SIGTERM and SIGHUP stop a command as Ctrl-C does: its VMs killed, nothing half-written
    warnings.formatwarning = _one_line_warning
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("forkd: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as exc:  # noqa: BLE001 - the boundary: nothing leaves as a traceback
        if debug:
            traceback.print_exc()
        text = error_line(exc, debug=debug)
        for line in text.splitlines() if isinstance(exc, ConfigError) else [text]:  # a mistake a line, each an error
            print(f"forkd: error: {line}", file=sys.stderr)
        return exit_status(exc)


#: Exit statuses, as pytest's: bad input (a usage error) is 4, a failure 1, a bug of forkd's own 2.
EXIT_FAILURE = 1
EXIT_INTERNAL_ERROR = 2
EXIT_USAGE_ERROR = 4


def exit_status(exc: BaseException) -> int:
    """The exit status of a command that raised ``exc``: 4 for bad input, 1 for a failure, 2 for a bug."""
    if isinstance(exc, ConfigError):
        return EXIT_USAGE_ERROR
    if isinstance(exc, (ForkdError, OSError)):
        return EXIT_FAILURE
    return EXIT_INTERNAL_ERROR


def _one_line_warning(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
) -> str:
    """Warnings as the command line prints them: ``forkd: warning: ...``, without the source line."""
    return f"forkd: warning: {message}\n"


def error_line(exc: BaseException, *, debug: bool = False) -> str:
    """One line describing ``exc`` for the terminal, ending with what to do about it.

    A ConfigError listing several mistakes (a forkd.yaml with more than one) is
    one line per mistake, and each is shown: ``main`` prints every one as an error.
    """
    if isinstance(exc, ForkdError):
        text = str(exc).strip() or type(exc).__name__
        if debug or isinstance(exc, ConfigError):
            return text
        first, _, rest = text.partition("\n")
        if rest:
            more = len(rest.splitlines())
            first += f" ({more} more line{'s' if more != 1 else ''} of detail with --debug)"
        return first
    if isinstance(exc, OSError):
        where = f" {exc.filename}" if exc.filename else ""
        return f"{exc.strerror or exc}:{where}; check that the path exists and that you may use it" + (
            "" if debug else " (traceback with --debug)"
        )
    hint = "" if debug else "; rerun with --debug for the traceback"
    return f"unexpected {type(exc).__name__}: {exc}{hint}, and please report it as a pytest-forkd bug"


def _take_debug_flag(words: list[str]) -> tuple[list[str], bool]:
    """Remove ``--debug`` from the command line wherever it stands before the command's own arguments.

    ``forkd exec`` passes everything after ``--`` (or after ``exec`` when
    there is no ``--``) to the guest command untouched.
    """
    if "--" in words:
        limit = words.index("--")
    elif "exec" in words:
        limit = words.index("exec") + 1
    else:
        limit = len(words)
    head = [word for word in words[:limit] if word != "--debug"]
    return head + words[limit:], len(head) != limit


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
