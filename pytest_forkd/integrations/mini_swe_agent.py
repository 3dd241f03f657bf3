"""forkd as a mini-swe-agent environment: an agent's bash actions run in a forked microVM of the task's image.

Install with ``pip install "pytest-forkd[mini-swe-agent]"`` and name the
class where a config names ``docker``::

    environment:
      environment_class: pytest_forkd.integrations.mini_swe_agent.ForkdEnvironment
      image: swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest
      cwd: /testbed
      timeout: 60

or in code, ``get_environment({"environment_class": "pytest_forkd.integrations.mini_swe_agent.ForkdEnvironment",
"image": ...})``. The config keeps the names of mini-swe-agent's
``DockerEnvironmentConfig`` (``image`` as a bare reference read as Docker
reads it, or any forkd reference: ``docker://``, ``oci:``, ``dockerfile:``...;
``cwd``, ``env``, ``forward_env``, ``timeout``, ``interpreter``), plus
forkd's own: ``snapshot`` and ``config`` (a forkd.yaml) instead of an image,
and ``pool``.

Every environment of an image is a copy-on-write child of one warm parent per
image and process: the image is pulled (or built) and booted once into a
snapshot kept in forkd's store, and each environment costs a fork of it
(taken from a pool restored ahead of demand while environments of the image
are alive). When the last environment of an image is cleaned up, its session
closes and no VM is left; the next environment of that image forks the
stored snapshot again, without pulling or booting.

:meth:`ForkdEnvironment.execute` answers as ``DockerEnvironment.execute``
does: ``{"output", "returncode", "exception_info"}`` with stdout and stderr
interleaved, ``Submitted`` raised when the output's first line is
``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``, a timeout reported as
``TimeoutExpired`` with ``returncode`` -1 (and, unlike Docker, the command
killed in the guest with everything it started). :meth:`ForkdEnvironment.cleanup`
kills the VM. What no container gives stays reachable: :attr:`ForkdEnvironment.vm`
(checkpoints, rollbacks) and :meth:`ForkdEnvironment.fork` (new environments
from this one's state mid-run).
"""

from __future__ import annotations

import logging
import os
import platform
import subprocess
import threading
from collections.abc import Hashable
from pathlib import Path
from typing import Any

from minisweagent.exceptions import Submitted
from minisweagent.utils.serialize import recursive_merge
from pydantic import BaseModel, model_validator

from pytest_forkd.core.vm import VM
from pytest_forkd.errors import ConfigError, ExecTimeout, ForkdError
from pytest_forkd.guest.client import GuestOSError
from pytest_forkd.guest.exec_result import ExecResult as GuestResult
from pytest_forkd.integrations.sessions import SESSIONS, ImageGuest, open_image_session
from pytest_forkd.project.session import ForkdSession

__all__ = ["SUBMIT_SENTINEL", "ForkdEnvironment", "ForkdEnvironmentConfig"]

log = logging.getLogger(__name__)

#: The first output line with which an action hands in the agent's work (mini-swe-agent's convention).
SUBMIT_SENTINEL = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
#: Runs the interpreter with its stderr into its stdout, as ``docker exec`` into one pipe gives them.
MERGE_STREAMS = 'exec "$@" 2>&1'


class ForkdEnvironmentConfig(BaseModel):
    """The config of :class:`ForkdEnvironment`: ``DockerEnvironmentConfig``'s names, and forkd's own.

    ``image`` or ``snapshot`` (with ``config``, a forkd.yaml) says where the
    VM comes from; with neither, forkd's built-in ``base`` (Debian with bash
    and Python). Keys of Docker's config with no meaning for a VM
    (``executable``, ``run_args``, ``container_timeout``, ``pull_timeout``)
    are ignored, so a config written for Docker runs unchanged.
    """

    image: str | None = None
    """A container image: a bare reference means Docker Hub or REGISTRY/NAME (``python:3.12``), as in Docker."""
    cwd: str = "/"
    """Working directory of every command (created in the image's snapshot if missing, as ``docker run -w``)."""
    env: dict[str, str] = {}
    """Variables set in every command, over the image's ``Env``."""
    forward_env: list[str] = []
    """Host variables forwarded when set on the host; ``env`` wins over them."""
    timeout: int = 30
    """Seconds a command may run; then it is killed with everything it started."""
    interpreter: list[str] = ["bash", "-lc"]
    """What runs each action's command (appended as the last argument)."""
    snapshot: str | None = None
    """A forkd snapshot instead of an image: ``base``, or one declared in ``config``."""
    config: str | None = None
    """A forkd.yaml whose settings and snapshots apply (relative paths resolve from the working directory)."""
    pool: int | None = None
    """Children kept restored ahead of demand (default: the settings' ``pool``, 1)."""

    @model_validator(mode="after")
    def _one_origin(self) -> ForkdEnvironmentConfig:
        if self.image is not None and (self.snapshot is not None or self.config is not None):
            raise ValueError("give image or snapshot/config, not both: a VM starts from one of them")
        if self.config is not None:
            self.config = str(Path(os.path.expanduser(self.config)).absolute())
        return self


def _session_key(config: ForkdEnvironmentConfig) -> Hashable:
    """Which warm parent an environment of ``config`` forks from (equal keys share one)."""
    if config.image is not None:
        workdir = config.cwd if config.cwd not in ("", "/") else None
        guest = ImageGuest.of_reference(
            config.image, origin="ForkdEnvironment image", workdir=workdir, network="outbound", pool=config.pool
        )
        return ("mini-swe-agent", guest)
    return ("mini-swe-agent", config.config, config.snapshot or "base", config.pool)


def _open(key: Hashable, config: ForkdEnvironmentConfig) -> ForkdSession:
    """Open the session ``key`` names and make its snapshot (pull, boot, pool): blocking, once per key."""
    assert isinstance(key, tuple)
    guest = key[1]
    if isinstance(guest, ImageGuest):
        session = open_image_session(guest, progress=log.info)
    else:
        session = ForkdSession.open(config=config.config, snapshot=config.snapshot or "base", pool=config.pool)
    try:
        session.snapshot  # noqa: B018 - builds or restores the snapshot and starts the pool
    except BaseException:
        session.close()
        raise
    return session


class ForkdEnvironment:
    """One mini-swe-agent environment: a forked microVM of the config's image (see the module docstring)."""

    def __init__(
        self,
        *,
        config_class: type[ForkdEnvironmentConfig] = ForkdEnvironmentConfig,
        logger: logging.Logger | None = None,
        **kwargs: Any,
    ) -> None:
        """Fork the environment's VM; forkd's one-line error (a ForkdError) if its image cannot be had."""
        self.logger = logger or logging.getLogger("minisweagent.environment")
        self._vm: VM | None = None
        self._key: Hashable | None = None
        self._lock = threading.Lock()
        try:
            self.config = config_class(**kwargs)
        except ValueError as exc:
            raise ConfigError(f"ForkdEnvironment: {_first_error(exc)}") from None
        key = _session_key(self.config)
        config = self.config
        session = SESSIONS.acquire(key, lambda: _open(key, config))
        try:
            vm = session.fork(1)[0]
        except BaseException:
            SESSIONS.release(key)
            raise
        self._adopt(vm, key)

    @classmethod
    def _of_vm(cls, config: ForkdEnvironmentConfig, vm: VM, key: Hashable, logger: logging.Logger) -> ForkdEnvironment:
        """An environment around a VM forked elsewhere, holding one more user of the session ``key``."""
        environment = cls.__new__(cls)
        environment.logger = logger
        environment.config = config
        environment._vm = None
        environment._key = None
        environment._lock = threading.Lock()
        SESSIONS.acquire(key, lambda: _open(key, config))  # open: this environment's VM is its child
        environment._adopt(vm, key)
        return environment

    def _adopt(self, vm: VM, key: Hashable) -> None:
        self._vm = vm
        self._key = key
        self.logger.info(f"Started forkd VM {vm.name} of {_origin(self.config)}")

    # -- forkd's extras ----------------------------------------------------------------------------------------
    @property
    def vm(self) -> VM:
        """The environment's VM: ``checkpoint()``, ``restore()``, ``branch()``, ``changes()``..."""
        if self._vm is None:
            raise ConfigError("this ForkdEnvironment is cleaned up; make a new one")
        return self._vm

    def fork(self, n: int = 1) -> list[ForkdEnvironment]:
        """``n`` new environments whose VMs are copies of this one's as it is now; clean each up when done."""
        assert self._key is not None
        children = self.vm.fork(n)
        environments: list[ForkdEnvironment] = []
        try:
            for child in children:
                environments.append(type(self)._of_vm(self.config, child, self._key, self.logger))
        except BaseException:
            for child in children[len(environments) :]:
                child.close()
            for environment in environments:
                environment.cleanup()
            raise
        return environments

    # -- mini-swe-agent's environment interface ---------------------------------------------------------------
    def execute(self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Run the action's ``command`` with the interpreter; the same dict ``DockerEnvironment.execute`` returns."""
        command = str(action.get("command", ""))
        cwd = cwd or self.config.cwd
        seconds = timeout or self.config.timeout
        env = {key: value for key in self.config.forward_env if (value := os.getenv(key)) is not None}
        env.update(self.config.env)
        argv = ["/bin/sh", "-c", MERGE_STREAMS, "sh", *self.config.interpreter, command]
        try:
            result = self.vm.exec(argv, env=env, cwd=cwd, timeout=seconds, timing="workload")
            output: dict[str, Any] = {"output": result.stdout, "returncode": result.exit_status, "exception_info": ""}
        except ExecTimeout as exc:
            partial = exc.result.stdout if isinstance(exc.result, GuestResult) else ""
            output = _failure(subprocess.TimeoutExpired(command, seconds, output=partial), partial)
        except GuestOSError as exc:
            # As `docker exec -w` into a missing folder: the runtime says so and the command never starts.
            output = {
                "output": f"forkd: cannot run in {cwd}: {exc.strerror}\n",
                "returncode": 126,
                "exception_info": "",
            }
        except ForkdError as exc:
            output = _failure(exc, "")
        self._check_finished(output)
        return output

    def _check_finished(self, output: dict[str, Any]) -> None:
        """Raise Submitted when the output's first line is the sentinel and the command succeeded."""
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_SENTINEL and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted(
                {
                    "role": "exit",
                    "content": submission,
                    "extra": {"exit_status": "Submitted", "submission": submission},
                }
            )

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        merged: dict[str, Any] = recursive_merge(self.config.model_dump(), platform.uname()._asdict(), kwargs)
        return merged

    def serialize(self) -> dict[str, Any]:
        return {
            "info": {
                "config": {
                    "environment": self.config.model_dump(mode="json"),
                    "environment_type": f"{self.__class__.__module__}.{self.__class__.__name__}",
                }
            }
        }

    def cleanup(self) -> None:
        """Kill the VM (idempotent); the last environment of an image closes its session, leaving no VM."""
        with self._lock:
            vm, self._vm = self._vm, None
            key, self._key = self._key, None
        try:
            if vm is not None:
                vm.close()
        finally:
            if key is not None:
                SESSIONS.release(key)

    def __del__(self) -> None:
        try:
            self.cleanup()
        except Exception:  # noqa: BLE001 - nothing to report to at collection or exit
            pass


def _failure(exc: BaseException, partial: str) -> dict[str, Any]:
    """What Docker's environment returns when running the command raised: the exception, returncode -1."""
    return {
        "output": partial,
        "returncode": -1,
        "exception_info": f"An error occurred while executing the command: {exc}",
        "extra": {"exception_type": type(exc).__name__, "exception": str(exc)},
    }


def _origin(config: ForkdEnvironmentConfig) -> str:
    if config.image is not None:
        return f"image {config.image}"
    return f"snapshot {config.snapshot or 'base'}" + (f" of {config.config}" if config.config else "")


def _first_error(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        message = str(first.get("msg", exc)).removeprefix("Value error, ")
        return f"{where}: {message}" if where else message
    return str(exc).splitlines()[0]
