"""A compose service's main process, started once in the parent VM: every sample's VM inherits it running.

Docker starts a container's main process (its ENTRYPOINT and CMD, or the
service's ``entrypoint``/``command``) before anything else runs in it; a task
whose service starts a server the agent must reach relies on that. forkd
starts it in the parent VM, after the snapshot's setup and before the
snapshot is taken (the recipe's ``main_process``, see
:class:`pytest_forkd.project.config.MainProcess`), so every child restored
from the snapshot has it running already, listening where it listened: the
forkd way to start a daemon once, not once per sample.

How it runs, as in Docker: as the service's user (else the image's ``User``),
in its working directory, with its environment; stdin is ``/dev/null`` unless
the service asks for a terminal (``tty``/``stdin_open``). Its stdout and
stderr go to :data:`LOG_FILE` in the guest, where a sample (or ``forkd
shell``) can read them. A process that ends within :data:`SETTLE_S` seconds
fails the snapshot with its exit status and the end of that log, as a
container whose process ends stops. With a ``healthcheck``, the snapshot is
taken once the check passes, as ``docker compose up --wait`` waits for it
(probed more often than Docker does, so it is ready sooner; it fails after
as long as Docker's ``start_period`` and ``retries`` allow).

The process is started by the runtime's own static busybox (``sh``), which
every forkd guest has whatever the image: it opens the log and ``exec``\\ s
the program, found on the service's ``PATH`` as Docker finds it (never one
of busybox's own applets).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from pytest_forkd.errors import CommandNotFound, ExecTimeout, ForkdError, ProcessTimeout, SnapshotError
from pytest_forkd.integrations.compose_commands import ServiceProcess
from pytest_forkd.waiting import poll_until

if TYPE_CHECKING:
    from pytest_forkd.core.process import GuestProcess
    from pytest_forkd.core.vm import VM

__all__ = ["LOG_FILE", "SETTLE_S", "ServiceStarter"]

#: Where the main process's stdout and stderr go, in every VM of the snapshot.
LOG_FILE: Final = "/tmp/forkd-service.log"
#: A main process that ends within this many seconds of starting fails the snapshot ("exits at once").
SETTLE_S: Final = 2.0
#: The static busybox of forkd's runtime: at /.forkd in a container image's guest, at / in forkd's own image.
BUSYBOXES: Final = ("/.forkd/usr/bin/busybox", "/usr/bin/busybox")
#: Characters of the log an error quotes.
LOG_TAIL_CHARS: Final = 2000
#: Opens the log, keeps stdin a terminal or makes it /dev/null, finds the program on PATH (busybox's sh would
#: run its own applet for a bare name such as ``tail``), then becomes it.
LAUNCHER: Final = r"""log=$1; keep_stdin=$2; shift 2
exec >>"$log" 2>&1
[ "$keep_stdin" = 1 ] || exec </dev/null
case $1 in
*/*) ;;
*)
  found=
  IFS=:
  for dir in $PATH; do
    [ -n "$dir" ] || dir=.
    if [ -f "$dir/$1" ] && [ -x "$dir/$1" ]; then found=$dir/$1; break; fi
  done
  unset IFS
  if [ -z "$found" ]; then echo "forkd: $1: not found in PATH=$PATH"; exit 127; fi
  shift
  set -- "$found" "$@"
  ;;
esac
exec "$@"
"""


@dataclass(frozen=True)
class ServiceStarter:
    """The main process of a compose service's image: a snapshot recipe's ``main_process``.

    ``reference`` names the image in the local store, where its ENTRYPOINT
    and CMD are read when the process starts (the image is pulled or built
    by then).
    """

    process: ServiceProcess
    reference: str
    user: str | None = None
    """``user:`` of the service; None: the image's ``User``."""
    origin: str = "compose.yaml: services.default"

    def describe(self) -> Mapping[str, object]:
        return {"process": self.process.describe(), "user": self.user}

    def start(self, vm: VM, progress: Callable[[str], None]) -> None:
        """Start the process in ``vm``; return once it runs (and its healthcheck passes); SnapshotError if not."""
        from pytest_forkd.image.oci.store import lookup

        pulled = lookup(self.reference)
        entrypoint, cmd = (pulled.config.entrypoint, pulled.config.cmd) if pulled is not None else ((), ())
        argv = self.process.argv(entrypoint, cmd)
        if not argv:
            progress(f"forkd: {self.origin}: no main process to start (the image's own is a shell, or there is none)")
            return
        shown = " ".join(argv)
        progress(f"forkd: {self.origin}: starting its main process `{shown}` (output in {LOG_FILE})")
        handle = self._spawn(vm, argv)
        try:
            code = handle.wait(timeout=SETTLE_S)
        except ProcessTimeout:
            code = None
        if code is not None:
            raise self._ended(vm, shown, code, f"within {SETTLE_S:g} s of starting (a container would stop)")
        health = self.process.healthcheck
        if health is not None:
            self._wait_healthy(vm, handle, shown, progress)
        if handle.poll() is not None:
            raise self._ended(vm, shown, handle.poll(), "before the snapshot was taken")

    def _spawn(self, vm: VM, argv: tuple[str, ...]) -> GuestProcess:
        keep_stdin = "1" if self.process.interactive else "0"
        for busybox in BUSYBOXES:
            try:
                return vm.spawn(
                    [busybox, "sh", "-c", LAUNCHER, "forkd-service", LOG_FILE, keep_stdin, *argv],
                    user=self.user,
                    pty=self.process.interactive,
                )
            except CommandNotFound:
                continue
        raise SnapshotError(
            f"{self.origin}: cannot start the main process: the guest has no busybox at {' or '.join(BUSYBOXES)}"
        )

    def _wait_healthy(self, vm: VM, handle: GuestProcess, shown: str, progress: Callable[[str], None]) -> None:
        health = self.process.healthcheck
        assert health is not None
        last: list[str] = []

        def healthy() -> bool:
            if handle.poll() is not None:
                raise self._ended(vm, shown, handle.poll(), "before its healthcheck passed")
            try:
                result = vm.exec(list(health.test), timeout=health.timeout_s, user=self.user)
            except ExecTimeout:
                last[:] = [f"the check ran past its timeout of {health.timeout_s:g} s"]
                return False
            if result.exit_code == 0:
                return True
            output = (result.stderr or result.stdout).strip()
            last[:] = [f"the check exited with status {result.exit_code}" + (f": {output[-500:]}" if output else "")]
            return False

        def unhealthy(message: str) -> ForkdError:
            why = f" ({last[0]})" if last else ""
            return SnapshotError(
                f"{self.origin}: the main process `{shown}` is not healthy after {health.deadline_s:g} s "
                f"(start_period, then {health.retries} retries of interval + timeout){why}; "
                f"its output is in {LOG_FILE}:\n{self._log_tail(vm)}"
            )

        progress(f"forkd: {self.origin}: waiting for its healthcheck `{' '.join(health.test)}`")
        ceiling = max(0.25, min(health.interval_s, health.start_interval_s, 2.0))
        poll_until(
            healthy, timeout=health.deadline_s, what="the healthcheck", interval=0.25, backoff=ceiling, error=unhealthy
        )
        progress(f"forkd: {self.origin}: healthy")

    def _ended(self, vm: VM, shown: str, code: int | None, when: str) -> SnapshotError:
        status = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with status {code}"
        return SnapshotError(
            f"{self.origin}: the main process `{shown}` {status} {when}; its output ({LOG_FILE}):\n"
            f"{self._log_tail(vm)}\nFix the service's command, entrypoint or image"
        )

    def _log_tail(self, vm: VM) -> str:
        try:
            text = vm.read_file(LOG_FILE).decode(errors="replace").strip()
        except (ForkdError, OSError) as exc:
            return f"(cannot read it: {exc})"
        if not text:
            return "(nothing)"
        return text if len(text) <= LOG_TAIL_CHARS else "..." + text[-LOG_TAIL_CHARS:]
