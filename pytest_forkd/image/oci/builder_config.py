"""The configuration podman and buildah build with: one that works for the user running forkd, root or not.

A ``RUN`` step needs the builder's OCI runtime to start a container. On a
host whose cgroups are v1 or hybrid (v1 controllers with a v2 hierarchy
beside them, as on Debian 12 machines of this kind), crun refuses to start
one ("cgroups in hybrid mode not supported") and every build with a ``RUN``
step fails, while runc works. An administrator fixes that for everyone in
``/etc/containers/containers.conf`` (``[engine]``, ``runtime = "runc"``,
``cgroup_manager = "cgroupfs"``); a user who cannot edit /etc has only their
own ``~/.config/containers/containers.conf``, or ``CONTAINERS_CONF``.

For its own builds forkd does what that user would: when the builder says
(``podman info``, ``buildah info``) that it would run crun on cgroups v1,
and runc is installed, forkd writes that configuration under its cache
(:func:`forkd_containers_conf`) and points ``CONTAINERS_CONF`` at it for
the builder's commands only. A ``CONTAINERS_CONF`` the user set is always
left as it is, and nothing outside forkd's cache is written. Where runc is
missing too, the build fails with the builder's message, and
:func:`builder_fix` says what to install or write (``forkd doctor`` prints
it after trying a one-line ``RUN`` build with each builder).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Final

from ... import private
from .store import store_dir

__all__ = ["builder_environment", "builder_fix", "forkd_containers_conf", "needs_runc"]

#: What forkd's builds of podman and buildah run with where crun cannot run.
CONTAINERS_CONF: Final = (
    "# Written by pytest-forkd for its own podman and buildah builds: this host's cgroups are v1 or hybrid,\n"
    "# where crun cannot start a build's RUN steps, so they run with runc and cgroupfs. forkd uses it only\n"
    "# when CONTAINERS_CONF is not set; set it to choose another file.\n"
    '[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\n'
)
CONF_NAME: Final = "containers.conf"
INFO_TIMEOUT: Final = 60
#: What the builders say when their runtime cannot use this host's cgroups.
CGROUP_FAILURES: Final = ("cgroups in hybrid mode", "hybrid mode not supported", "cgroup")
_lock = threading.Lock()
_decided: dict[str, bool] = {}


def _info(name: str) -> dict[str, Any] | None:
    """``podman info`` / ``buildah info`` as JSON, with the user's own configuration; None if it fails."""
    program = shutil.which(name)
    if program is None:
        return None
    command = [program, "info", "--format", "json"] if name == "podman" else [program, "info"]
    try:
        answer = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, timeout=INFO_TIMEOUT)
        document = json.loads(answer.stdout) if answer.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None
    return document if isinstance(document, dict) else None


def runtime_facts(name: str) -> tuple[str, str] | None:
    """The OCI runtime ``name`` would run and the cgroup version it sees (``crun``, ``v1``); None if unknown."""
    info = _info(name)
    host = info.get("host") if info is not None else None
    if not isinstance(host, dict):
        return None
    if name == "podman":
        runtime = host.get("ociRuntime", {}).get("name") if isinstance(host.get("ociRuntime"), dict) else None
        version = host.get("cgroupVersion")
    else:
        runtime, version = host.get("OCIRuntime"), host.get("CgroupVersion")
    if not isinstance(runtime, str) or not isinstance(version, str):
        return None
    return os.path.basename(runtime), version


def needs_runc(name: str) -> bool:
    """Whether ``name``'s own configuration runs crun on cgroups v1 (or hybrid), where its RUN steps fail."""
    facts = runtime_facts(name)
    return facts is not None and facts[0] == "crun" and facts[1] == "v1"


def forkd_containers_conf() -> Path:
    """forkd's containers.conf (runc, cgroupfs) under its cache, written once (privately, atomically)."""
    folder = private.make_dir(store_dir())
    path = folder / CONF_NAME
    try:
        if path.read_text() == CONTAINERS_CONF:
            return path
    except OSError:
        pass
    fd, temporary = tempfile.mkstemp(prefix=".containers-", suffix=".conf", dir=folder)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(CONTAINERS_CONF)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def builder_environment(name: str) -> dict[str, str]:
    """The environment to run builder ``name`` in: the process's, with forkd's ``CONTAINERS_CONF`` where needed.

    Decided once per process and builder; only podman and buildah read
    containers.conf, and a ``CONTAINERS_CONF`` already set is kept.
    """
    environ = dict(os.environ)
    if name not in ("podman", "buildah") or "CONTAINERS_CONF" in environ:
        return environ
    with _lock:
        use = _decided.get(name)
        if use is None:
            use = needs_runc(name) and shutil.which("runc") is not None
            _decided[name] = use
    if use:
        environ["CONTAINERS_CONF"] = str(forkd_containers_conf())
    return environ


def builder_fix(name: str, problem: str) -> str:
    """What to do when builder ``name`` cannot run a RUN step (``problem``: the last line it printed)."""
    lowered = problem.lower()
    if name in ("podman", "buildah") and ("crun" in lowered or any(text in lowered for text in CGROUP_FAILURES)):
        if shutil.which("runc") is None:
            return "install runc (apt-get install runc): crun cannot run builds on this host's cgroups"
        return (
            'run it with runc and cgroupfs: [engine] runtime = "runc", cgroup_manager = "cgroupfs" in '
            "/etc/containers/containers.conf (as root), in ~/.config/containers/containers.conf, or in a file "
            "named by CONTAINERS_CONF (forkd uses its own when CONTAINERS_CONF is not set)"
        )
    if "subuid" in lowered or "newuidmap" in lowered or "user namespace" in lowered:
        return f"rootless {name} needs /etc/subuid and /etc/subgid entries for this user (usermod --add-subuids)"
    return f"see `{name} build` on this host; forkd builds dockerfile: images with it"
