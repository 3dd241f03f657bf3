"""forkd sessions of the sandbox providers: shared by a process's sandboxes, one warm parent per guest.

An agent framework asks for sandboxes many times over (Inspect: one
``task_init`` per task and sandbox configuration, then one ``sample_init``
per sample, several at once), while a :class:`~pytest_forkd.project.session.ForkdSession`
is worth having once per process and configuration: it owns the VM factory,
the snapshot built or restored for that configuration and the pool of
children restored ahead of demand. :class:`SharedSessions` keeps one session
per key, opens it once even when several callers ask at the same time, counts
its users and closes it (killing every VM it started) when the last one
releases it. A session the caller opened elsewhere (the pytest plugin's) can
be *lent*: it is found under its key but never closed here.

Whatever is still open when the interpreter exits is closed then too
(``atexit``), so an eval that ends without its cleanup (an exception in the
framework, a second Ctrl-C) leaves no VM behind; QEMU processes also die with
the process that started them.

Harnesses name their sandbox by image: Inspect's ``compose.yaml`` (``image:``
or ``build:``), the Agents SDK's ``image=``, mini-swe-agent's ``image:``. An
:class:`ImageGuest` says what such a sandbox is (the image, the working
directory and environment baked into its snapshot, memory, vCPUs, network)
and :func:`open_image_session` opens the :class:`~pytest_forkd.project.session.ForkdSession`
that hands out its VMs: a snapshot of the image booted once (pulled or built
first, then cached in the store like any snapshot), whose children fork from
a pool kept warm. Equal guests are equal keys, so a harness keeps one session
per guest in :data:`SESSIONS` and
every sandbox of the same image is a child of the same parent. A compose
service's main process (its ``command``, or the image's ``CMD``) is started
in that parent before its snapshot (:mod:`.service_process`), so every child
has it running.

The session is built from a project made in memory (one snapshot recipe whose
``from:`` is the reference), with the settings a session outside pytest
resolves (``PYTEST_FORKD_*``: the store, the accelerator, the pull policy...).
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pytest_forkd.errors import ConfigError, InvalidArgument
from pytest_forkd.integrations.compose import ComposeService, ServiceBuild
from pytest_forkd.integrations.compose_commands import ServiceProcess

if TYPE_CHECKING:
    from pytest_forkd.project.session import ForkdSession

__all__ = [
    "SESSIONS",
    "ImageDefaults",
    "ImageGuest",
    "SharedSessions",
    "canonical_reference",
    "environment_pairs",
    "image_defaults",
    "open_image_session",
]

log = logging.getLogger(__name__)


@dataclass
class _Entry:
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Held while the session is being opened, so that concurrent callers open it once."""
    session: ForkdSession | None = None
    users: int = 0
    lent: bool = False
    """Opened (and closed) by someone else: never closed here."""


class SharedSessions:
    """One :class:`ForkdSession` per key, shared by its users and closed by the last one (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[Hashable, _Entry] = {}

    def acquire(self, key: Hashable, opener: Callable[[], ForkdSession]) -> ForkdSession:
        """The session under ``key``, opened with ``opener`` if there is none yet; one more user of it.

        Blocking (``opener`` may build a snapshot): call it from a worker
        thread in async code. If ``opener`` raises, nothing is kept and the
        next caller tries again.
        """
        with self._lock:
            entry = self._entries.setdefault(key, _Entry())
            entry.users += 1
        try:
            with entry.lock:
                if entry.session is None:
                    entry.session = opener()
                return entry.session
        except BaseException:
            self._drop_user(key, entry)
            raise

    def get(self, key: Hashable) -> ForkdSession | None:
        """The open session under ``key``, without becoming a user of it (None if there is none)."""
        with self._lock:
            entry = self._entries.get(key)
            return entry.session if entry is not None else None

    def lend(self, key: Hashable, session: ForkdSession) -> None:
        """Make a session opened elsewhere available under ``key``; :meth:`release` never closes it."""
        with self._lock:
            if key in self._entries:
                raise ValueError(f"a forkd session is already registered under {key!r}")
            self._entries[key] = _Entry(session=session, users=1, lent=True)

    def release(self, key: Hashable) -> None:
        """One user fewer of the session under ``key``; the last one closes it (unless it was lent)."""
        with self._lock:
            entry = self._entries.get(key)
        if entry is not None:
            self._drop_user(key, entry)

    def _drop_user(self, key: Hashable, entry: _Entry) -> None:
        with self._lock:
            entry.users -= 1
            if entry.users > 0:
                return
            if self._entries.get(key) is entry:
                del self._entries[key]
            session, entry.session = entry.session, None
        if session is not None and not entry.lent:
            session.close()

    def keys(self) -> list[Hashable]:
        with self._lock:
            return list(self._entries)

    def users(self, key: Hashable) -> int:
        """How many users the session under ``key`` has (0 when there is none)."""
        with self._lock:
            entry = self._entries.get(key)
            return entry.users if entry is not None else 0

    def close_all(self) -> None:
        """Close every session this registry opened and forget every key (lent sessions stay open)."""
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        for entry in entries:
            session, entry.session = entry.session, None
            if session is not None and not entry.lent:
                try:
                    session.close()
                except Exception:  # noqa: BLE001 - closing at exit must go on with the others
                    log.warning("closing a forkd session failed", exc_info=True)


#: The sessions of the sandbox providers of this process.
SESSIONS = SharedSessions()
atexit.register(SESSIONS.close_all)


#: Environment variables of a session outside pytest that would pick another origin than the guest's image.
_ORIGIN_VARIABLES = ("PYTEST_FORKD_SNAPSHOT", "PYTEST_FORKD_IMAGE", "PYTEST_FORKD_CONFIG")


def canonical_reference(text: str, *, origin: str) -> str:
    """``text`` as a canonical reference (a bare one read as Docker reads it); ConfigError names ``origin``."""
    from pytest_forkd.image.oci.reference import parse_reference

    try:
        return str(parse_reference(text, bare="docker"))
    except InvalidArgument as exc:
        raise ConfigError(f"{origin}: {exc}") from None


@dataclass(frozen=True)
class ImageGuest:
    """The VMs of one container image: what their common snapshot is made of. Hashable: one session per guest."""

    reference: str | None = None
    """A canonical image reference (``docker://...``, ``oci:...``, ``dockerfile:...``); None with ``build``."""
    build: ServiceBuild | None = None
    """A Dockerfile built (with its context and arguments) when the session opens."""
    workdir: str | None = None
    """The VMs' working directory, created in the snapshot; None: the image's ``WorkingDir``."""
    env: tuple[tuple[str, str], ...] = ()
    """Over the image's ``Env``, in the snapshot and every command of its VMs."""
    memory_mib: int | None = None
    vcpus: int | None = None
    network: Literal["none", "outbound"] = "none"
    pool: int | None = None
    """Children kept restored ahead of demand (None: the settings' ``pool``)."""
    process: ServiceProcess | None = None
    """A compose service's main process, started in the snapshot (see :mod:`.service_process`); None: none."""
    process_user: str | None = None
    """Who the main process runs as (the service's ``user:``); None: the image's ``User``."""
    origin: str = field(default="image", compare=False)
    """How messages name where the guest was described (``compose.yaml: services.default``)."""

    def __post_init__(self) -> None:
        if (self.reference is None) == (self.build is None):
            raise ValueError("an ImageGuest has a reference or a build, not both or neither")

    @classmethod
    def of_reference(cls, text: str, *, origin: str = "image", **fields: object) -> ImageGuest:
        """The guest of image ``text``; a malformed reference is a ConfigError naming ``origin``."""
        return cls(reference=canonical_reference(text, origin=origin), origin=origin, **fields)  # type: ignore[arg-type]

    @classmethod
    def of_service(cls, service: ComposeService, *, pool: int | None = None) -> ImageGuest:
        """The guest of a compose service: its image or build, working directory, environment and machine."""
        where = f"{service.origin}.image"
        return cls(
            reference=canonical_reference(service.image, origin=where)
            if service.build is None and service.image
            else None,
            build=service.build,
            workdir=service.working_dir,
            env=service.environment,
            memory_mib=service.memory_mib,
            vcpus=service.vcpus,
            network=service.network,
            pool=pool,
            process=service.process,
            process_user=service.user if service.process is not None else None,
            origin=service.origin,
        )

    @property
    def described(self) -> str:
        """The image in words, for messages: its reference, or the Dockerfile built."""
        if self.build is not None:
            return f"the build of {self.build.dockerfile}"
        return str(self.reference)

    def snapshot_name(self) -> str:
        """The name of the guest's snapshot: the image's last name part and a hash of everything that makes it."""
        from pytest_forkd.paths import sanitize_tag

        identity = dataclasses.asdict(self)
        identity.pop("origin")
        identity.pop("pool")
        for unset in ("process", "process_user"):  # guests without them keep the names they had
            if identity[unset] is None:
                identity.pop(unset)
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:10]
        stem = (
            self.build.context.name or "build"
            if self.build is not None
            else str(self.reference).rstrip("/").rsplit("/", 1)[-1]
        )
        return f"image-{sanitize_tag(stem)[:40]}-{digest}"


def open_image_session(guest: ImageGuest, *, progress: Callable[[str], None] | None = None) -> ForkdSession:
    """A session whose selected snapshot is ``guest``'s image booted and ready (nothing boots yet).

    A build runs here (blocking), so its failure is forkd's one-line
    ImageError; the pull, the image's disk and the snapshot are made when the
    session's snapshot is first asked for (``session.snapshot``). The
    session boots the image just built, whatever the pull policy (the build
    itself follows it).
    """
    from pytest_forkd.core.runtime import Runtime
    from pytest_forkd.engine.network import NetworkSpec
    from pytest_forkd.project.config import Project, SnapshotRecipe
    from pytest_forkd.project.session import ForkdSession
    from pytest_forkd.project.settings import resolve

    runtime = Runtime()
    environ = {key: value for key, value in os.environ.items() if key not in _ORIGIN_VARIABLES}
    settings = resolve(
        cli={"snapshot": None, "pool": None if guest.pool is None else str(guest.pool)},
        env=environ,
        ini={},
        project_settings={},
        backends=lambda: runtime.backends.ids(),
        rootdir=Path.cwd(),
        config=None,
        config_source="default",
        project_origin=guest.origin,
    )
    reference = guest.reference
    pull = settings.pull
    if guest.build is not None:
        reference = built_reference(guest.build, policy=settings.pull, progress=progress)
        pull = "never"  # just built (or found up to date) with its context and arguments: boot that image
    assert reference is not None
    name = guest.snapshot_name()
    starter = None
    if guest.process is not None:
        from pytest_forkd.integrations.service_process import ServiceStarter

        starter = ServiceStarter(guest.process, reference, user=guest.process_user, origin=guest.origin)
    recipe = SnapshotRecipe(
        name=name,
        source=reference,
        memory_mib=guest.memory_mib,
        vcpus=guest.vcpus,
        env=dict(guest.env),
        workdir=guest.workdir,
        network=NetworkSpec(mode=guest.network),
        main_process=starter,
    )
    project = Project(snapshots={name: recipe})
    chosen = dataclasses.replace(settings, snapshot=name, pull=pull)
    return ForkdSession(chosen, project, runtime=runtime, progress=progress)


@dataclass(frozen=True)
class ImageDefaults:
    """What an image's config gives its commands unless they say otherwise."""

    working_dir: str = "/"
    """The image's ``WorkingDir`` (``/`` when it names none)."""
    user: str | None = None
    """The image's ``User`` (None: root)."""


def image_defaults(session: ForkdSession) -> ImageDefaults:
    """The defaults of the image a session of :func:`open_image_session` boots, read from the local image store.

    Call it once the session's snapshot is made (the image is pulled then);
    an image not in the store gives Docker's defaults (``/``, root).
    """
    from pytest_forkd.image.oci.store import lookup

    recipe = session.project.snapshots.get(session.settings.snapshot)
    pulled = lookup(recipe.source) if recipe is not None else None
    if pulled is None:
        return ImageDefaults()
    return ImageDefaults(working_dir=pulled.config.working_dir or "/", user=pulled.config.user or None)


def built_reference(
    build: ServiceBuild, *, policy: str = "missing", progress: Callable[[str], None] | None = None
) -> str:
    """Build ``build`` with the host's builder (unless the store has this build); its reference in the store.

    The store keeps each build under ``dockerfile:PATH@sha256:KEY``, KEY
    hashing what it is built from (the Dockerfile, the context's files, the
    arguments, the target and the platform), so builds of one Dockerfile
    with other arguments are other images; ``policy`` is the pull policy
    (``always`` builds again, ``never`` takes a stored build).
    """
    from pytest_forkd.image.oci.builders import build_dockerfile
    from pytest_forkd.image.oci.pull import check_policy

    image = build_dockerfile(
        build.dockerfile,
        context=build.context,
        args=dict(build.args),
        target=build.target,
        platform=build.platform,
        policy=check_policy(policy),
        progress=progress,
    )
    return str(image.reference)


def environment_pairs(env: Mapping[str, str] | None) -> tuple[tuple[str, str], ...]:
    """An environment mapping as the hashable pairs an :class:`ImageGuest` keeps (in the mapping's order)."""
    return tuple((str(key), str(value)) for key, value in (env or {}).items())
