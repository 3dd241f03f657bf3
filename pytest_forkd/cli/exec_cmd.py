"""``forkd exec``: run one command in a fresh microVM and exit with its status."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import cast

from pytest_forkd.core import validate
from pytest_forkd.core.factory import VMFactory
from pytest_forkd.engine.host import ACCELS
from pytest_forkd.errors import ExecTimeout
from pytest_forkd.guest.exec_result import ExecResult
from pytest_forkd.image import ensure_container_image
from pytest_forkd.image.oci.reference import is_reference
from pytest_forkd.image.oci.store import PULL_POLICIES
from pytest_forkd.project.lifecycle import find_snapshot
from pytest_forkd.storage.store import SnapshotStore


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "exec",
        help="boot a VM (or fork a snapshot), run a command, exit with its status",
        description="Boot a microVM from an image (or fork a child of a snapshot), run CMD in it, copy its "
        "stdout/stderr to ours and exit with its exit code. Example: forkd exec -- python3 -c 'print(42)'",
    )
    p.add_argument(
        "--image",
        default="default",
        metavar="NAME|REF",
        help="guest image name, or a container image as --forkd-image takes it: REGISTRY/NAME[:TAG] or "
        "NAME:TAG (docker://), docker://REF, oci:DIR[:TAG], oci-archive:FILE[:TAG], docker-archive:FILE, "
        "dockerfile:PATH (default: %(default)s)",
    )
    p.add_argument(
        "--pull",
        choices=PULL_POLICIES,
        default="missing",
        help="when a container image is pulled: missing (a reference pulled before is used offline), always, "
        "never (default: %(default)s)",
    )
    p.add_argument(
        "--user", metavar="USER[:GROUP]", default=None, help="run CMD as this user (default: the image's User)"
    )
    p.add_argument("--snapshot", metavar="TAG", help="run in a child of this snapshot instead of a fresh boot")
    p.add_argument("--store", metavar="DIR", help="snapshot store (default: the user cache)")
    p.add_argument("--memory", type=int, default=256, metavar="MIB", help="guest memory (default: %(default)s)")
    p.add_argument("--vcpus", type=int, default=1, help="virtual CPUs (default: %(default)s)")
    p.add_argument("--accel", choices=ACCELS, default="auto", help="accelerator (default: %(default)s)")
    p.add_argument(
        "--network",
        default=None,
        metavar="MODE",
        help="network: none (default), outbound, host, or host ports PORT[,PORT...] the guest may reach at 10.0.2.100",
    )
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="kill the command after S seconds")
    p.add_argument(
        "--max-output",
        type=int,
        default=None,
        metavar="BYTES",
        help="bytes of stdout and of stderr kept (head and tail; default: 4 MiB)",
    )
    p.add_argument("--timings", action="store_true", help="print start-up and command timings (JSON) to stderr")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command and its arguments")
    p.set_defaults(run=run)


def exit_status(exit_code: int) -> int:
    """Shell convention: a command killed by signal N exits 128+N (see ExecResult.exit_status)."""
    return 128 - exit_code if exit_code < 0 else exit_code


def cli_network(text: str | None) -> str | list[int] | None:
    """``--network``: a mode name, or comma-separated host ports (mode host)."""
    if text is None or not text[:1].isdigit():
        return text
    try:
        return [int(port) for port in text.split(",") if port.strip()]
    except ValueError:
        raise validate.InvalidArgument(
            f"--network: expected a mode (none, host, outbound) or host ports such as 8080,9000, got {text!r}"
        ) from None


def run(args: argparse.Namespace) -> int:
    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("forkd exec: no command given; usage: forkd exec [OPTIONS] -- CMD [ARGS...]", file=sys.stderr)
        return 2
    if args.timeout is not None:
        validate.timeout(args.timeout, "--timeout")  # before a VM boots for nothing
    if args.max_output is not None:
        validate.max_output(args.max_output, "--max-output")
    factory = VMFactory(accel=args.accel, progress=lambda line: print(line, file=sys.stderr))
    try:
        started = time.perf_counter()
        if args.snapshot:
            store = SnapshotStore(args.store) if args.store else SnapshotStore.persistent()
            vm = factory.fork_snapshot(find_snapshot(store, args.snapshot), 1, network=cli_network(args.network))[0]
        else:
            validate.user(args.user)
            image: object = validate.image_name(args.image)  # a bare reference comes back as docker://...
            if is_reference(str(image)):
                image = ensure_container_image(
                    str(image), policy=args.pull, progress=lambda line: print(f"forkd: {line}", file=sys.stderr)
                )
            vm = factory.boot(image, memory_mib=args.memory, vcpus=args.vcpus, network=cli_network(args.network))
        ready_ms = (time.perf_counter() - started) * 1000
        try:
            result = vm.exec(command, timeout=args.timeout, max_output=args.max_output, user=args.user)
        except ExecTimeout as exc:
            # VM.exec's timeout always carries the partial output (errors.py cannot name the type).
            result = cast(ExecResult, exc.result)
            print(f"forkd exec: {exc}", file=sys.stderr)
        sys.stdout.buffer.write(result.stdout_bytes)
        sys.stdout.flush()
        sys.stderr.buffer.write(result.stderr_bytes)
        sys.stderr.flush()
        if args.timings:
            report = {
                "accel": factory.accel_verdict(vm.image).accel,
                "memory_mib": vm.memory_mib,
                "start_to_first_reply_ms": round(ready_ms, 1),
                "exec_ms": round(vm.transcript.entries[-1]["duration_ms"], 1),
                "exec_guest_ms": round(result.duration_ms, 1),
                "mode": "fork" if args.snapshot else "cold_boot",
            }
            print(json.dumps(report), file=sys.stderr)
        if result.truncated:
            print("forkd exec: the output was longer than --max-output; its middle was dropped", file=sys.stderr)
        return result.exit_status
    finally:
        factory.close()
