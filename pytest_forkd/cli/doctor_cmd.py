"""``forkd doctor``: is this host ready? One line per check, and the fix for each failure.

What the first run does by itself (build the default image, probe KVM with
it, boot it once to store snapshot ``base``) is not a failure: doctor says it
will happen and what it costs, and ``forkd doctor --build`` does it now.
Running under TCG (no usable KVM) is a ``[warn]``: everything works, slower.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from pytest_forkd.engine import host
from pytest_forkd.engine.host import ACCELS
from pytest_forkd.errors import ForkdError

if TYPE_CHECKING:
    from pytest_forkd.image import Image

MIN_SHM_FREE = 1 << 30
#: What building the default image costs, measured with an empty cache (2 vCPUs, Debian bookworm, 2026-12):
#: 9.2 MB of package indexes and 40.8 MB of packages downloaded, 8.4 s in all, 229 MiB left in the cache.
FIRST_BUILD_COST = "about 50 MB of Debian downloads and 10 s of work, 230 MiB in"
#: What a check the first run does says to do it now instead.
DO_IT_NOW = "forkd doctor --build"
#: The RAM of a parent VM at the default size: what its shared RAM file may grow to.
PARENT_MEMORY_MIB = 256
#: What doctor says about running under TCG, QEMU's emulator: nothing is wrong, VMs are slower.
TCG_FIX = (
    "none needed: VMs work under TCG, several times slower; KVM needs a host with hardware virtualization "
    "(or nested virtualization) and /dev/kvm for this user (see the kvm line)"
)
#: The snapshot every run starts from unless told otherwise, which the first run stores.
BASE = "base"


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True
    value: str = ""  # the machine-readable answer where there is one (the accelerator: kvm or tcg)
    first_run: bool = False
    """Not done yet, and nothing wrong: the first run does it (build the default image, probe KVM with it)."""

    @property
    def mark(self) -> str:
        if self.ok:
            return "ok  "
        if self.first_run:
            return "next"
        return "FAIL" if self.required else "warn"


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="check that this host can run pytest-forkd VMs",
        description="Check QEMU, the accelerator, userfaultfd, /dev/shm, the default image "
        "and the storage backends. Exit status 1 when a required check fails. A default image not built "
        "yet is no failure: the first run builds it (--build does it now).",
    )
    p.add_argument(
        "--build",
        action="store_true",
        help="build the default image now when it is missing, probe the accelerator with it and store "
        "snapshot base, instead of leaving all three to the first run",
    )
    p.add_argument("--accel", choices=ACCELS, default="auto", help="accelerator to resolve (default: %(default)s)")
    p.add_argument(
        "--json",
        action="store_true",
        help="print the checks as JSON ({ready, accel, checks: [...]}), e.g. to key CI baselines "
        "by the accelerator really used",
    )
    p.set_defaults(run=run)


def _check_qemu() -> Check:
    try:
        qemu = host.find_qemu()
    except ForkdError as exc:
        wanted = ".".join(map(str, host.MIN_QEMU_VERSION))
        return Check("qemu", False, str(exc), f"sudo apt-get install {host.QEMU_PACKAGE} (QEMU {wanted} or newer)")
    problem = host.machine_type_problem(qemu)
    if problem is not None:
        return Check(
            "qemu", False, problem, f"install a QEMU >= 4.2 built with {host.MACHINE_TYPE} ({host.QEMU_PACKAGE})"
        )
    return Check("qemu", True, f"{qemu.binary} version {qemu.version}, {host.MACHINE_TYPE} machine available")


def _check_image(build: bool = False) -> tuple[Check, Image | None]:
    """The default image; one not built yet is the first run's work (``build``: done now), not a failure."""
    from pytest_forkd.errors import UnknownImage
    from pytest_forkd.image import load_image

    try:
        image = load_image("default")
    except UnknownImage:
        if not build:
            return _first_build(), None
        try:
            image = _build_default_image()
        except ForkdError as exc:
            return Check("image", False, str(exc).splitlines()[0], "see the message, then retry"), None
        return Check("image", True, f"default image {image.key[:12]} built now at {image.path}"), image
    except ForkdError as exc:
        return Check("image", False, str(exc).splitlines()[0], "forkd image build"), None
    return Check("image", True, f"default image {image.key[:12]} at {image.path}"), image


def _first_build() -> Check:
    from pytest_forkd import paths

    return Check(
        "image",
        False,
        f"not built yet: the first run builds the default image ({FIRST_BUILD_COST} {paths.cache_dir()}), "
        "then boots it once to store snapshot base",
        DO_IT_NOW,
        first_run=True,
    )


def _build_default_image() -> Image:
    """Build the default image as the first run would: ./forkd.yaml's Debian mirror applies, files are private."""
    from pathlib import Path

    from pytest_forkd.image import build_image
    from pytest_forkd.image.mirror import use_project_mirror
    from pytest_forkd.private import private_umask
    from pytest_forkd.project.config import PROJECT_FILE, load_project

    if Path(PROJECT_FILE).is_file():
        project = load_project(Path(PROJECT_FILE))
        use_project_mirror(project.settings.get("debian_mirror"), f"{project.origin} settings.debian_mirror")
    with private_umask():
        return build_image()


def _check_accel(requested: str, image: object) -> Check:
    from pytest_forkd.core.factory import VMFactory

    if image is None:
        return Check("accel", False, "cannot probe KVM without the default image", "forkd image build")
    factory = VMFactory(accel=requested)
    try:
        verdict = factory.accel_verdict(image)
    except ForkdError as exc:
        return Check("accel", False, str(exc).splitlines()[0], "see the message")
    except Exception as exc:  # noqa: BLE001 - doctor reports, it does not crash
        return Check("accel", False, f"{type(exc).__name__}: {exc}", "see the message; run forkd doctor --debug")
    finally:
        factory.close()
    cached = " (cached verdict)" if verdict.cached else ""
    detail = f"{verdict.accel}: {verdict.reason}{cached}"
    if verdict.accel == "tcg":  # everything works, emulated: slower, which is what a [warn] line says
        return Check("accel", False, detail, TCG_FIX, required=False, value=verdict.accel)
    return Check("accel", True, detail, value=verdict.accel)


def _check_base(build: bool) -> Check:
    """Snapshot ``base`` in the store runs use; ``build``: boot the default image and store it now.

    The store is the one a pytest run in this directory uses (``./forkd.yaml``'s
    settings, ``PYTEST_FORKD_*``, else ``$FORKD_STORE`` or the user cache), so
    ``forkd snapshots ls`` and the first run find what ``--build`` stored.
    """
    from pathlib import Path

    from pytest_forkd.private import private_umask
    from pytest_forkd.project.config import PROJECT_FILE
    from pytest_forkd.project.session import ForkdSession

    config = Path(PROJECT_FILE) if Path(PROJECT_FILE).is_file() else None
    try:
        with ForkdSession.open(config=config, progress=_progress) as session:
            store = session.shared_store
            if store.exists(BASE):
                return Check("snapshot", True, f"{BASE} stored in {store.root}")
            if not build:
                return Check(
                    "snapshot",
                    False,
                    f"{BASE} not stored yet: the first run boots the default image once and stores it in {store.root}",
                    DO_IT_NOW,
                    first_run=True,
                )
            with private_umask():
                snapshot = session.snapshot_for(BASE)
            return Check("snapshot", True, f"{BASE} stored now in {snapshot.path.parent} (forkd snapshots ls lists it)")
    except ForkdError as exc:
        return Check("snapshot", False, str(exc).splitlines()[0], "see the message, then retry")


def _progress(line: str) -> None:
    """Progress of what --build does, on stderr: stdout is the checks (or their JSON)."""
    print(line, file=sys.stderr, flush=True)


def _check_problem(name: str, probe: Callable[[], str | None], ok_text: str, required: bool) -> Check:
    problem = probe()
    if problem:
        return Check(name, False, problem, "see the message; only the backends that need it are affected", required)
    return Check(name, True, ok_text, required=required)


def _check_kvm() -> Check:
    """/dev/kvm access for this user: without it VMs run under TCG (slower, still correct)."""
    problem = host.kvm_access_problem()
    if problem:
        fix = problem.split("fix: ", 1)[1] if "fix: " in problem else "none needed: VMs run under TCG"
        return Check("kvm", False, problem.split("; fix: ")[0] + "; VMs run under TCG", fix, required=False)
    return Check(
        "kvm",
        True,
        f"{host.KVM_DEVICE} is readable and writable by this user (whether KVM really works is the accel check)",
        required=False,
    )


def _check_userfaultfd() -> Check:
    """userfaultfd for QEMU's live branch (uffd backend); the other backends do not need it."""
    problem = host.userfaultfd_problem()
    if problem:
        fix = problem.split("fix: ", 1)[1] if "fix: " in problem else "use the full or diff backend"
        return Check(
            "userfaultfd", False, problem.split("; fix: ")[0] + "; the uffd backend is unavailable", fix, required=False
        )
    return Check("userfaultfd", True, "available to this user (uffd backend usable)", required=False)


def _check_runtime_dir() -> Check:
    """The per-user runtime directory: this user's own, mode 0700 (or not created yet)."""
    import os
    import stat

    from pytest_forkd.engine.rundir import choose_root

    root = choose_root(warn=False)[0]
    try:
        info = os.lstat(root)
    except FileNotFoundError:
        return Check("runtime dir", True, f"{root} (created with mode 0700 on the first run)")
    except OSError as exc:
        return Check("runtime dir", False, f"{root}: {exc.strerror}", "set FORKD_SHM_DIR to a directory on tmpfs")
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        return Check(
            "runtime dir",
            False,
            f"{root} is not a directory of this user (uid {info.st_uid})",
            "remove it (as its owner) or set FORKD_SHM_DIR to a directory of your own",
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode != 0o700:
        return Check("runtime dir", True, f"{root} has mode {mode:04o}; the next run narrows it to 0700")
    return Check("runtime dir", True, f"{root}, mode 0700")


def _check_runtime_space(memory_mib: int = PARENT_MEMORY_MIB) -> Check:
    """Room for guest RAM on the filesystem that will hold the run directory (FORKD_SHM_DIR or the default).

    A parent VM's RAM is a shared file there; a guest that touches more than
    the filesystem holds is killed by SIGBUS. Containers give /dev/shm 64 MiB.
    """
    from pytest_forkd.engine import space
    from pytest_forkd.engine.rundir import choose_root

    root, moved = choose_root(warn=False)
    try:
        filesystem = space.filesystem_of(root)
    except OSError as exc:
        return Check("runtime space", False, f"{root}: {exc.strerror}", "set FORKD_SHM_DIR to a writable directory")
    need = memory_mib * space.MIB
    detail = f"{root} is on {filesystem.describe()}"
    if filesystem.free < need:
        return Check(
            "runtime space",
            False,
            f"{detail}: a parent VM with {memory_mib} MiB of RAM needs up to {memory_mib} MiB there",
            space.RUNTIME_FIX,
        )
    if moved:
        return Check("runtime space", False, moved, space.RUNTIME_FIX, required=False)
    if filesystem.free < MIN_SHM_FREE:
        return Check(
            "runtime space",
            False,
            f"{detail}: room for {filesystem.free // need} parent VM(s) of {memory_mib} MiB",
            space.RUNTIME_FIX,
            required=False,
        )
    return Check("runtime space", True, detail)


def _check_memory_limit() -> Check:
    """The memory this process may use: the host's, or its cgroup's limit (a container, a CI job).

    Pools and parallel forks size themselves from it; below two default
    parent VMs' worth, a suite runs but keeps few children ready.
    """
    from pytest_forkd.core.pool import RESERVE_MIB, host_available_mib
    from pytest_forkd.engine import cgroup

    limit = cgroup.memory_limit()
    host = host_available_mib()
    host_text = f"host: {host} MiB available" if host is not None else "host: MemAvailable unreadable"
    if limit is None:
        return Check("memory", True, f"no cgroup memory limit; {host_text}", required=False)
    detail = f"{limit.describe()}; {host_text}; pools keep children ready only while {RESERVE_MIB} MiB stay free"
    if limit.free_mib < 2 * PARENT_MEMORY_MIB:
        return Check(
            "memory",
            False,
            detail,
            "give the container or job more memory (docker run --memory=4g; a larger CI runner), "
            "or use smaller VMs (memory_mib)",
            required=False,
        )
    return Check("memory", True, detail, required=False)


def _check_cores() -> Check:
    """The cores this process may use: its CPUs (affinity), within its cgroup's CPU quota (a container's --cpus).

    The pool's parallel restores, fork(n)'s threads and the summary's CPU
    bound count these cores; a quota below the CPUs is the binding one.
    """
    from pytest_forkd.core.cores import affinity_cpus, usable_cores
    from pytest_forkd.engine import cgroup

    quota = cgroup.cpu_quota()
    where = (
        f"cgroup v{quota.version} {quota.cgroup}: CPU quota {quota.cores:g} cores"
        if quota is not None
        else "no cgroup CPU quota"
    )
    return Check("cores", True, f"{usable_cores(quota)} usable ({affinity_cpus()} CPUs; {where})", required=False)


def _backend_checks() -> list[Check]:
    try:
        from pytest_forkd.core.runtime import Runtime
    except ImportError:
        return []
    checks = []
    for backend in Runtime().backends.all():
        problem = backend.unavailable_reason()
        fix = "" if problem is None or "fix:" in problem else "see the message"
        checks.append(
            Check(f"backend {backend.id}", problem is None, problem or backend.description, fix, required=False)
        )
    return checks


def collect(accel: str, *, build: bool = False) -> list[Check]:
    """Every check; ``build`` builds a missing default image first, so the accelerator is probed now."""
    checks = [_check_qemu()]
    image_check, image = _check_image(build)
    checks.append(image_check)
    if checks[0].ok:
        if image_check.first_run:
            checks.append(
                Check(
                    "accel",
                    False,
                    "probed on the first run, with the default image: KVM when it really works, else TCG",
                    DO_IT_NOW,
                    first_run=True,
                )
            )
        else:
            checks.append(_check_accel(accel, image))
            if image is not None and checks[-1].value:  # the default image boots here: base can be stored
                checks.append(_check_base(build))
    checks.append(_check_kvm())
    checks.append(_check_userfaultfd())
    checks.append(
        _check_problem("pagemap_scan", host.pagemap_scan_problem, "PAGEMAP_SCAN ioctl available", required=False)
    )
    checks.append(_check_runtime_space())
    checks.append(_check_memory_limit())
    checks.append(_check_cores())
    checks.append(_check_runtime_dir())
    checks.extend(_backend_checks())
    checks.extend(_check_builders())
    return checks


def _check_builders() -> list[Check]:
    """The Dockerfile builders ``dockerfile:`` references would use (none is needed otherwise), each tried.

    Each one found builds a one-line ``RUN`` image ``FROM scratch`` (the
    builders in parallel, a second or two each): a builder whose RUN steps
    fail (crun on this host's cgroups, no subuids) is a ``[warn]`` with the fix.
    """
    from concurrent.futures import ThreadPoolExecutor

    from pytest_forkd.image.oci.builder_config import builder_fix
    from pytest_forkd.image.oci.builders import available_builders, probe_builder

    found = available_builders()
    if not found:
        fix = "only dockerfile: images need one: apt-get install podman (or buildah, or docker)"
        return [Check("builders", False, "none found", fix, required=False)]
    with ThreadPoolExecutor(max_workers=len(found)) as pool:
        problems = list(pool.map(probe_builder, found))
    checks = []
    for index, (name, problem) in enumerate(zip(found, problems)):
        role = "builds dockerfile: images" if index == 0 else "found (the first one found builds)"
        if problem is None:
            checks.append(Check(f"builder {name}", True, f"{role}; a RUN step works", required=False))
        else:
            detail = f"{role}, but a one-line RUN build fails: {problem}"
            checks.append(Check(f"builder {name}", False, detail, builder_fix(name, problem), required=False))
    return checks


def as_json(checks: list[Check]) -> dict[str, object]:
    """The checks as one JSON document: ``ready``, ``accel`` (kvm, tcg or null) and each check.

    ``ready`` is true when no required check failed; a check the first run
    does (``first_run``: the default image, the accelerator probe) is not ok
    yet and no failure either, so ``accel`` is null until it is done.
    """
    accel = next((check.value for check in checks if check.name == "accel" and check.value), None)
    return {
        "ready": not _failed(checks),
        "accel": accel,
        "first_run": [check.name for check in checks if check.first_run],
        "checks": [
            {
                "name": c.name,
                "ok": c.ok,
                "required": c.required,
                "first_run": c.first_run,
                "detail": c.detail,
                "fix": c.fix,
            }
            for c in checks
        ],
    }


def _first_run_work(checks: list[Check]) -> str:
    """What the first run does by itself, as doctor's last line says it."""
    names = {check.name for check in checks if check.first_run}
    if "image" in names:
        return "builds the default image"
    return f"stores snapshot {BASE}" if "snapshot" in names else "probes the accelerator"


def _failed(checks: list[Check]) -> list[Check]:
    """The required checks that failed: what is wrong, as against what the first run does."""
    return [check for check in checks if check.required and not check.ok and not check.first_run]


def run(args: argparse.Namespace) -> int:
    checks = collect(args.accel, build=getattr(args, "build", False))
    if getattr(args, "json", False):
        document = as_json(checks)
        print(json.dumps(document, indent=2))
        return 0 if document["ready"] else 1
    for check in checks:
        print(f"[{check.mark}] {check.name:<16} {check.detail}")
        if not check.ok and check.fix:
            print(f"       {'to do it now' if check.first_run else 'fix'}: {check.fix}")
    failed = _failed(checks)
    if failed:
        print(f"not ready: {len(failed)} required check(s) failed")
    elif any(check.first_run for check in checks):
        print(f"ready: nothing is wrong; the first run {_first_run_work(checks)} ({DO_IT_NOW} does it now)")
    else:
        print("ready")
    return 1 if failed else 0
