"""The ``forkd`` command line.

Each sub-command lives in its own module of this package
and exposes ``add_parser(subparsers)`` and ``run(args) -> int``; this module
only wires them together and is the error boundary: every exception becomes
a one-line error and exit status 2 (the traceback with ``--debug``), so no
user ever sees a traceback for bad input. Sub-command modules are imported
only when their command runs.

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
from typing import Sequence

from pytest_forkd.errors import ForkdError
from pytest_forkd.version import __version__

COMMAND_MODULES = ("image", "exec", "shell", "cp", "doctor", "snapshots", "bench", "compare", "merge", "bisect")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    out becomes one line on stderr and exit status 2 (a ForkdError says what
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
        print(f"forkd: error: {error_line(exc, debug=debug)}", file=sys.stderr)
        return 2


def _one_line_warning(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
) -> str:
    """Warnings as the command line prints them: ``forkd: warning: ...``, without the source line."""
    return f"forkd: warning: {message}\n"


def error_line(exc: BaseException, *, debug: bool = False) -> str:
    """One line describing ``exc`` for the terminal, ending with what to do about it."""
    if isinstance(exc, ForkdError):
        text = str(exc).strip() or type(exc).__name__
        if debug:
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
