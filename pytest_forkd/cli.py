"""The ``forkd`` command line.

Each sub-command lives in its own module under :mod:`pytest_forkd.commands`
and exposes ``add_parser(subparsers)`` and ``run(args) -> int``; this module
only wires them together and turns :class:`ForkdError` into a one-line error
and exit status 2, so no user ever sees a traceback for bad input.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Sequence

from .errors import ForkdError

COMMAND_MODULES = ("image", "exec", "shell", "doctor", "snapshots", "bench", "compare")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="forkd", description="Real microVMs as cheap as fork(): images, VMs, snapshots, benchmarks."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"pytest_forkd.commands.{name}_cmd")
        except ModuleNotFoundError as exc:  # a command not shipped in this build
            if exc.name != f"pytest_forkd.commands.{name}_cmd":
                raise
            continue
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except ForkdError as exc:
        print(f"forkd: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("forkd: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
