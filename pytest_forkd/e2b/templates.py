"""Templates: what ``Sandbox.create(template)`` names, and the warm snapshot its sandboxes are forked from.

A template name resolves, in this order, to:

1. a ``--template NAME=REF`` mapping (REF is then read as below);
2. ``base``: the forkd session's own snapshot (the parent's current state:
   the selected snapshot, or what a test session prepared in
   ``forkd_parent``);
3. a snapshot declared in forkd.yaml or kept in the store;
   ``code-interpreter-v1`` when forkd.yaml declares none of that name: the
   snapshot of forkd's code-interpreter image, with numpy and Pillow
   (:mod:`pytest_forkd.e2b.code_interpreter_template`), built on first use;
4. a container image reference with its transport (``docker://python:3.12``,
   ``oci:DIR``, ``dockerfile:PATH``...), pulled or built on first use into a
   session of its own (:mod:`pytest_forkd.integrations.sessions`);

anything else is an unknown template (404 naming it and what is known).

The first sandbox of a template prepares it once: a child of its snapshot
gets E2B's users and home directory (``root``, and ``user`` with home
``/home/user``, owned by it, as in E2B's templates) and starts the
filesystem helper (:mod:`pytest_forkd.e2b.guest_helper`), then is branched.
Calls that name no user run as ``user``, as envd runs them in E2B's
templates, whatever the image's own ``User``; a template where ``user``
could not be made (an image without a shell, a read-only ``/etc``) runs them
as the image's own user instead.
That branch is the template's snapshot: every sandbox is a copy-on-write
child of it, with children kept restored ahead in the session factory's pool,
and the same preparation serves every name that resolves to the same
snapshot. Setup hooks (``TemplateCatalog(setup=...)``) run in that child
before the branch: the place to start what every sandbox of a template
should find running (a code interpreter's kernel, say).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pytest_forkd.e2b.api_errors import ApiError
from pytest_forkd.e2b.code_interpreter_template import CodeInterpreterSnapshots
from pytest_forkd.e2b.config import CODE_INTERPRETER_TEMPLATE, DEFAULT_TEMPLATE, DEFAULT_USER
from pytest_forkd.e2b.guest_helper import start_helper
from pytest_forkd.errors import ConfigError, ForkdError
from pytest_forkd.paths import sanitize_tag

if TYPE_CHECKING:
    from pytest_forkd.core.vm import VM
    from pytest_forkd.integrations.sessions import ImageGuest
    from pytest_forkd.project.session import ForkdSession
    from pytest_forkd.storage.snapshot import Snapshot

log = logging.getLogger("pytest_forkd.e2b")

#: Container image transports a template name may start with.
IMAGE_TRANSPORTS = ("docker://", "oci:", "oci-archive:", "docker-archive:", "dockerfile:")
#: E2B's users and home directory, made (as root) in every template that lacks them: ``user`` gets the first
#: uid and gid from 1000 that the image does not use yet (an image may have its own user 1000), and
#: /home/user. Plain POSIX sh and grep, so busybox images work too; it fails only when ``user`` is still
#: missing at the end.
PREPARE_SCRIPT = """\
mkdir -p /home/user /root
grep -q '^root:' /etc/passwd 2>/dev/null || echo 'root:x:0:0:root:/root:/bin/sh' >> /etc/passwd
grep -q '^root:' /etc/group 2>/dev/null || echo 'root:x:0:' >> /etc/group
if ! grep -q '^user:' /etc/passwd 2>/dev/null; then
  id=1000
  while grep -q "^[^:]*:[^:]*:$id:" /etc/passwd /etc/group 2>/dev/null; do id=$((id + 1)); done
  grep -q '^user:' /etc/group 2>/dev/null || echo "user:x:$id:" >> /etc/group
  line=$(grep '^user:' /etc/group) && rest=${line#user:*:} && gid=${rest%%:*} || gid=$id
  shell=/bin/sh; [ -x /bin/bash ] && shell=/bin/bash
  echo "user:x:$id:$gid:user:/home/user:$shell" >> /etc/passwd
fi
line=$(grep '^user:' /etc/passwd) || exit 1
rest=${line#user:*:}; uid=${rest%%:*}; rest=${rest#*:}; gid=${rest%%:*}
chown "$uid:$gid" /home/user || true
"""

SetupHook = Callable[["VM", str], None]
"""Runs in a template's VM before it is snapshotted: ``hook(vm, template_name)`` (blocking)."""


@dataclass(frozen=True)
class Template:
    """A snapshot sandboxes are forked from, and what they find running in it."""

    name: str
    snapshot: Snapshot
    session: ForkdSession
    helper_pid: int | None
    """The filesystem helper's pid in every child (None: the image has no python3)."""
    user: str | None = None
    """Who calls that name no user run as: E2B's ``user`` (None: the image's own user, where it could not be made)."""

    def fork(self, n: int = 1) -> list[VM]:
        """``n`` children of the template (blocking)."""
        return self.session.factory.fork_snapshot(self.snapshot, n)


class TemplateCatalog:
    """The templates of one server: resolved by name, prepared once, kept warm."""

    def __init__(
        self,
        session: ForkdSession,
        mapping: Mapping[str, str] | None = None,
        *,
        setup: Sequence[SetupHook] = (),
        prepare_guest: bool = True,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self._session = session
        self._mapping = dict(mapping or {})
        self._setup = list(setup)
        self._prepare_guest = prepare_guest
        self._progress = progress or (lambda line: None)
        self._prepared: dict[tuple[int, str], Template] = {}
        self._locks: dict[tuple[int, str], asyncio.Lock] = {}
        self._image_guests: dict[str, ImageGuest] = {}
        self._code_interpreter = CodeInterpreterSnapshots(session, self._progress)
        self._closed = False

    @property
    def session(self) -> ForkdSession:
        return self._session

    def names(self) -> list[str]:
        """Template names this server knows without looking further (for error messages and docs)."""
        return sorted(
            {DEFAULT_TEMPLATE, CODE_INTERPRETER_TEMPLATE, *self._mapping, *self._session.project.snapshot_names()}
        )

    async def get(self, name: str) -> Template:
        """The prepared template ``name`` (preparing it on first use); 404 ApiError for an unknown name."""
        if self._closed:
            raise ApiError(503, "the server is stopping")
        session, origin = await asyncio.to_thread(self._origin, name)
        key = (id(session), str(origin.path))
        template = self._prepared.get(key)
        if template is not None:
            return dataclasses.replace(template, name=name)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            template = self._prepared.get(key)
            if template is None:
                self._progress(f"forkd e2b: preparing template {name!r} (once)")
                template = await asyncio.to_thread(self._prepare, name, session, origin)
                self._prepared[key] = template
        return dataclasses.replace(template, name=name)

    def close(self) -> None:
        """Drop the pools of prepared templates and release image sessions (their VMs die with them)."""
        self._closed = True
        for template in self._prepared.values():
            try:
                template.session.factory.drop_pool(template.snapshot)
            except ForkdError:
                pass
        self._prepared.clear()
        if self._image_guests:
            from pytest_forkd.integrations.sessions import SESSIONS

            for guest in self._image_guests.values():
                SESSIONS.release(guest)
            self._image_guests.clear()

    # -- resolving (blocking) -------------------------------------------------------------------------
    def _origin(self, name: str) -> tuple[ForkdSession, Snapshot]:
        reference = self._mapping.get(name, name)
        session = self._session
        try:
            if reference == DEFAULT_TEMPLATE:
                return session, session.snapshot
            if reference == CODE_INTERPRETER_TEMPLATE and reference not in session.project.snapshots:
                return session, self._code_interpreter.snapshot()
            if reference.startswith(IMAGE_TRANSPORTS) or (name in self._mapping and not self._known(reference)):
                image_session = self._image_session(name, reference)
                return image_session, image_session.snapshot
            if self._known(reference):
                return session, session.snapshot_for(reference)
        except ConfigError as exc:
            raise ApiError(400, f"template {name!r} ({reference}): {exc}") from None
        except ForkdError as exc:
            raise ApiError(500, f"template {name!r} ({reference}) could not be made ready: {exc}") from None
        raise ApiError(
            404,
            f"unknown template {name!r}: not a snapshot declared in {session.project.origin} or kept in the store, "
            f"nor an image reference (docker://...); known templates: {', '.join(self.names())}; "
            "map other names with `forkd e2b serve --template NAME=REF`",
        )

    def _known(self, reference: str) -> bool:
        try:
            self._session.check_snapshot_name(reference)
        except ConfigError:
            return False
        return True

    def _image_session(self, name: str, reference: str) -> ForkdSession:
        from pytest_forkd.integrations.sessions import SESSIONS, ImageGuest, open_image_session

        guest = self._image_guests.get(reference)
        if guest is None:
            guest = ImageGuest.of_reference(reference, origin=f"template {name!r}")
            session = SESSIONS.acquire(guest, lambda: open_image_session(guest, progress=self._progress))
            self._image_guests[reference] = guest
            return session
        found = SESSIONS.get(guest)
        assert found is not None
        return found

    # -- preparing (blocking) -------------------------------------------------------------------------
    def _prepare(self, name: str, session: ForkdSession, origin: Snapshot) -> Template:
        vm = session.factory.fork_snapshot(origin, 1)[0]
        try:
            helper_pid: int | None = None
            user: str | None = None
            if self._prepare_guest:
                try:
                    result = vm.exec(["/bin/sh", "-c", PREPARE_SCRIPT], timeout=120, user="0")
                except ForkdError as exc:  # an image without a shell: its sandboxes do without E2B's user
                    log.warning("template %s: setting up E2B's user failed: %s", name, exc)
                else:
                    if result.ok:
                        user = DEFAULT_USER
                    else:
                        log.warning(
                            "template %s: setting up E2B's user failed, so calls run as the image's own user: %s",
                            name,
                            result.stderr.strip()[:300],
                        )
                try:
                    helper_pid = start_helper(vm)
                except ApiError as exc:
                    log.warning("template %s: %s", name, exc.message)
            for hook in self._setup:
                hook(vm, name)
            snapshot = vm.branch(f"e2b-{sanitize_tag(name)[:40]}-{secrets.token_hex(4)}")
        finally:
            vm.close()
        pool = session.settings.pool
        if pool > 0:
            session.factory.pool(snapshot, pool)
        return Template(name, snapshot, session, helper_pid, user)
