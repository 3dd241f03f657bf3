"""``forkd e2b serve``: an E2B-compatible server whose sandboxes are forked microVMs.

This module only reads the command line; the server is :mod:`pytest_forkd.e2b`
(:func:`pytest_forkd.e2b.command.serve_until_stopped`).
"""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "e2b",
        help="serve E2B's sandbox API, its sandboxes forked microVMs",
        description="Serve E2B's API so that code written against E2B's SDKs (from e2b import Sandbox) runs "
        "unchanged on forkd VMs. Needs the e2b extra: pip install 'pytest-forkd[e2b]'.",
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = actions.add_parser(
        "ls",
        help="list the templates a server started here would serve",
        description="List the template names `forkd e2b serve` would serve with these options, and what each is.",
    )
    _template_options(listing)
    listing.set_defaults(run=run_ls)
    serve = actions.add_parser(
        "serve",
        help="serve until Ctrl-C or SIGTERM; prints the environment the SDKs need",
        description="Serve the sandbox API and every sandbox's in-sandbox API on one URL. Prints "
        "`export E2B_API_URL=... E2B_SANDBOX_URL=... E2B_API_KEY=...` lines on stdout once the default template "
        "and every --template mapping are ready, then serves until SIGINT or SIGTERM; its sandboxes end with it. "
        "Example: forkd e2b serve --port 0 > e2b.env & ... . ./e2b.env; python agent.py",
    )
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: %(default)s, loopback only; 0.0.0.0 serves every interface)",
    )
    serve.add_argument("--port", type=int, default=0, help="port to listen on (default: 0, any free port)")
    serve.add_argument("--api-key", default=None, metavar="KEY", help="the API key clients must send (default: random)")
    _template_options(serve)
    serve.add_argument(
        "--debug-ports",
        action="store_true",
        help="also serve the SDKs' E2B_DEBUG=true ports on 127.0.0.1 (3000 the API, 49983 envd, 49999 the code "
        "interpreter), for the one sandbox debug mode talks to",
    )
    serve.add_argument(
        "--timeout", type=int, default=300, metavar="S", help="sandbox timeout when a client sets none (default: 300)"
    )
    serve.set_defaults(run=run)


def _template_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--template",
        action="append",
        default=[],
        metavar="NAME=REF",
        help="map a template name to a forkd.yaml or stored snapshot, or to an image reference "
        "(docker://python:3.12-slim); repeatable. Without a mapping, `base` is the session's snapshot, "
        "`code-interpreter-v1` forkd's code-interpreter image (numpy, Pillow; built on first use) unless "
        "forkd.yaml declares a snapshot of that name, and other names are looked up as snapshots",
    )
    parser.add_argument(
        "--config", metavar="PATH", default=None, help="the forkd.yaml to read (default: ./forkd.yaml if any)"
    )
    parser.add_argument(
        "--snapshot", metavar="NAME", default=None, help="the snapshot template `base` stands for (default: base)"
    )


def run_ls(args: argparse.Namespace) -> int:
    from pytest_forkd.e2b.command import list_templates

    return list_templates(templates=args.template, config=args.config, snapshot=args.snapshot)


def run(args: argparse.Namespace) -> int:
    from pytest_forkd.e2b.command import serve_until_stopped

    return serve_until_stopped(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        templates=args.template,
        debug_ports=args.debug_ports,
        config=args.config,
        snapshot=args.snapshot,
        default_timeout_s=args.timeout,
    )
