"""forkd sessions shared by the sandboxes of one process, counted and closed with their last user.

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
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pytest_forkd.project.session import ForkdSession

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
