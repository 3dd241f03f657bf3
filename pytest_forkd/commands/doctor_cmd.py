"""``forkd doctor``: is this host ready? One line per check, and the fix for each failure."""

from __future__ import annotations

import argparse
import subprocess
from dataclasses import dataclass
from typing import Callable

from ..engine import host
from ..engine.accel import ACCELS
from ..errors import ForkdError

MIN_SHM_FREE = 1 << 30


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("doctor", help="check that this host can run pytest-forkd VMs",
                              description="Check QEMU, the accelerator, userfaultfd, /dev/shm, the default image "
                                          "and the storage backends. Exit status 1 when a required check fails.")
    p.add_argument("--accel", choices=ACCELS, default="auto", help="accelerator to resolve (default: %(default)s)")
    p.set_defaults(run=run)


def _check_qemu() -> Check:
    try:
        qemu = host.find_qemu()
    except ForkdError as exc:
        return Check("qemu", False, str(exc), f"sudo apt-get install {host.QEMU_PACKAGE}")
    machines = subprocess.run([qemu.binary, "-M", "help"], capture_output=True, text=True).stdout
    if "microvm" not in machines:
        return Check("qemu", False, f"{qemu.binary} {qemu.version} has no microvm machine",
                     f"install a QEMU >= 4.2 built with microvm ({host.QEMU_PACKAGE})")
    return Check("qemu", True, f"{qemu.binary} version {qemu.version}, microvm machine available")


def _check_image() -> tuple[Check, object]:
    from ..image import load_image

    try:
        image = load_image("default")
    except ForkdError as exc:
        return Check("image", False, str(exc).splitlines()[0], "forkd image build"), None
    return Check("image", True, f"default image {image.key[:12]} at {image.path}"), image


def _check_accel(requested: str, image: object) -> Check:
    from ..factory import VMFactory

    if image is None:
        return Check("accel", False, "cannot probe KVM without the default image", "forkd image build")
    factory = VMFactory(accel=requested)
    try:
        verdict = factory.accel_verdict(image)  # type: ignore[arg-type]
    except ForkdError as exc:
        return Check("accel", False, str(exc), "see the message")
    finally:
        factory.close()
    cached = " (cached verdict)" if verdict.cached else ""
    return Check("accel", True, f"{verdict.accel}: {verdict.reason}{cached}")


def _check_problem(name: str, probe: Callable[[], str | None], ok_text: str, required: bool) -> Check:
    problem = probe()
    if problem:
        return Check(name, False, problem, "see the message; only the backends that need it are affected", required)
    return Check(name, True, ok_text, required=required)


def _check_shm() -> Check:
    free = host.shm_free_bytes()
    detail = f"{free >> 20} MiB free on /dev/shm"
    if free < MIN_SHM_FREE:
        return Check("shm", False, detail, "free space on /dev/shm or enlarge it (mount -o remount,size=4G /dev/shm)")
    return Check("shm", True, detail)


def _backend_checks() -> list[Check]:
    try:
        from ..backend import registry
    except ImportError:
        return []
    checks = []
    for backend in registry().all():
        problem = backend.unavailable_reason()
        checks.append(Check(f"backend {backend.id}", problem is None, problem or backend.description,
                            "see the message", required=False))
    return checks


def collect(accel: str) -> list[Check]:
    checks = [_check_qemu()]
    image_check, image = _check_image()
    checks.append(image_check)
    if checks[0].ok:
        checks.append(_check_accel(accel, image))
    checks.append(_check_problem("userfaultfd", host.userfaultfd_problem, "available", required=False))
    checks.append(_check_problem("pagemap_scan", host.pagemap_scan_problem, "PAGEMAP_SCAN ioctl available",
                                 required=False))
    checks.append(_check_shm())
    checks.extend(_backend_checks())
    return checks


def run(args: argparse.Namespace) -> int:
    checks = collect(args.accel)
    for check in checks:
        mark = "ok  " if check.ok else ("FAIL" if check.required else "warn")
        print(f"[{mark}] {check.name:<16} {check.detail}")
        if not check.ok and check.fix:
            print(f"       fix: {check.fix}")
    failed = [c for c in checks if c.required and not c.ok]
    print("ready" if not failed else f"not ready: {len(failed)} required check(s) failed")
    return 1 if failed else 0
