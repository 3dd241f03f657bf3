"""The container image the agent serves in: its config, and the users its commands run as.

In a VM booted from a container image, /init mounts the image's root, bind-mounts
the agent's own runtime (interpreter, libraries, busybox) at ``/.forkd`` inside it
and starts the agent chrooted there with ``FORKD_RUNTIME=/.forkd``. The image's
config (``Env``, ``WorkingDir``, ``User``) becomes the agent's environment, working
directory and default user, so every command starts as ``docker exec`` starts one.

Users are resolved as Docker resolves them, in the image's own ``/etc/passwd``
and ``/etc/group``, read as text: the runtime's C library must not load the
image's NSS modules, and an image may have no passwd file at all (a number
then works, a name does not). Supplementary groups are cleared.

A command starts as its user without a program in between: the thread that
starts it takes the user's ids for the moment of the ``vfork`` (:func:`starting_as`),
so the child execs the command already as that user.

A file the host writes as a user (``write_file`` with ``user``) is opened by
the agent itself, in the thread that serves the request, under that user's
filesystem identity (:func:`acting_as`): the kernel checks the user's
permissions, a new file is the user's, and the data then streams straight
into it, with no second copy in guest memory.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os

from .common import RequestError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any, NoReturn

#: Where /init mounts the runtime inside an image root, given to the agent as FORKD_RUNTIME.
RUNTIME_ENV = "FORKD_RUNTIME"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class Credentials:
    """Who a command runs as: numeric ids and the home directory its HOME names."""

    __slots__ = ("gid", "home", "uid")

    def __init__(self, uid: int, gid: int, home: str) -> None:
        self.uid = uid
        self.gid = gid
        self.home = home

    @property
    def is_root(self) -> bool:
        return self.uid == 0 and self.gid == 0


ROOT = Credentials(0, 0, "/root")


#: setfsuid, setfsgid and setgroups by machine: called raw, they change the calling thread only (the C
#: library's wrappers of setgroups and the set*id calls change every thread of the process).
_IDENTITY_SYSCALLS = {"x86_64": (122, 123, 116), "aarch64": (151, 152, 159)}
#: setresuid and setresgid by machine, called raw for the same reason.
_SETRES_SYSCALLS = {"x86_64": (117, 119), "aarch64": (147, 149)}
_MACHINE = os.uname().machine
_libc: Any = None
_ids_call: Any = None


def _syscall() -> Any:
    global _libc
    if _libc is None:
        import ctypes  # imports cost in an emulated guest: the guest's agent calls this before its snapshot

        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc.syscall


def _ids_syscall() -> Any:
    """libc's ``syscall`` typed for (number, id, id, id): the ints are converted in C, not as Python objects.

    A function object of its own (``CDLL[name]`` makes a new one), so the typing stays off other callers.
    """
    global _ids_call
    if _ids_call is None:
        import ctypes

        _syscall()
        function = _libc["syscall"]
        function.argtypes = (ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_long)
        _ids_call = function
    return _ids_call


def prepare_user_switch() -> None:
    """Load what switching users needs now, so that a forked child of a snapshot does not pay for it."""
    _syscall()
    _ids_syscall()


@contextlib.contextmanager
def acting_as(credentials: Credentials) -> Iterator[None]:
    """Inside the block this thread opens files as ``credentials``: its fsuid and fsgid, no other groups.

    The kernel checks permissions against the filesystem ids, and while the
    fsuid is not 0 the thread has none of root's filesystem capabilities, so
    the user's permissions apply exactly as to a process of that user (as
    a command started as the user has). Other threads keep the agent's
    identity. PermissionError when the agent may not switch (not root).
    """
    if credentials.uid == os.geteuid() and credentials.gid == os.getegid():
        yield
        return
    numbers = _IDENTITY_SYSCALLS.get(_MACHINE)
    if numbers is None:
        raise RequestError("Unsupported", f"acting as another user is not implemented on {_MACHINE}")
    import ctypes

    setfsuid, setfsgid, setgroups = numbers
    syscall = _syscall()
    groups = os.getgroups()
    if syscall(ctypes.c_long(setgroups), ctypes.c_long(0), None) != 0:
        code = ctypes.get_errno()
        raise PermissionError(code, f"cannot act as user {credentials.uid}: {os.strerror(code)}")
    try:
        # Each call returns the id before it; setting the same id again reads back whether it took.
        syscall(ctypes.c_long(setfsgid), ctypes.c_long(credentials.gid))
        syscall(ctypes.c_long(setfsuid), ctypes.c_long(credentials.uid))
        gid = syscall(ctypes.c_long(setfsgid), ctypes.c_long(credentials.gid))
        uid = syscall(ctypes.c_long(setfsuid), ctypes.c_long(credentials.uid))
        if (uid, gid) != (credentials.uid, credentials.gid):
            raise PermissionError(errno.EPERM, f"cannot act as user {credentials.uid}:{credentials.gid}")
        yield
    finally:
        syscall(ctypes.c_long(setfsuid), ctypes.c_long(os.geteuid()))
        syscall(ctypes.c_long(setfsgid), ctypes.c_long(os.getegid()))
        listed = (ctypes.c_uint * len(groups))(*groups)
        syscall(ctypes.c_long(setgroups), ctypes.c_long(len(groups)), listed)


def starting_as(credentials: Credentials) -> _StartingAs:
    """Inside the block this thread has ``credentials``' ids and no other groups: a process it starts is that user.

    Linux keeps credentials per thread; the C library's wrappers switch every
    thread of the process, the raw calls only the calling one, and a child
    (``vfork`` or ``fork``) takes the credentials of the thread that made it.
    The saved ids stay the agent's, so the thread can switch back; ``exec``
    then makes them the user's too, and with them the child loses every
    capability: it is that user as completely as after ``setpriv`` or busybox's
    ``nsenter -S UID -G GID``, without starting such a program. The agent's
    other threads keep serving as root. ROOT is a no-op; PermissionError when
    the agent may not switch (it is not root). Nothing in the block may import:
    the user may not be able to read the agent's files.
    """
    return _StartingAs(credentials)


class _StartingAs:
    """:func:`starting_as`'s block: a plain object and typed calls, as it runs for every command started as a user."""

    __slots__ = ("_credentials", "_restore")

    def __init__(self, credentials: Credentials) -> None:
        self._credentials = credentials
        self._restore: tuple[int, int, list[int]] | None = None

    def __enter__(self) -> None:
        credentials = self._credentials
        if credentials.is_root:
            return
        numbers = _SETRES_SYSCALLS.get(_MACHINE)
        if numbers is None:
            raise RequestError("Unsupported", f"running a command as another user is not implemented on {_MACHINE}")
        setresuid, setresgid = numbers
        uid, gid, groups = os.geteuid(), os.getegid(), os.getgroups()
        if groups:  # the guest's agent has none (the kernel starts init without): two calls saved per command
            self._set_groups([])
        try:
            self._call(setresgid, credentials.gid)
            try:
                self._call(setresuid, credentials.uid)
            except BaseException:
                self._call(setresgid, gid)
                raise
        except BaseException:
            if groups:
                self._set_groups(groups)
            raise
        self._restore = (uid, gid, groups)

    def __exit__(self, *exc_info: object) -> None:
        if self._restore is None:
            return
        uid, gid, groups = self._restore
        self._restore = None
        setresuid, setresgid = _SETRES_SYSCALLS[_MACHINE]
        try:
            self._call(setresuid, uid)
        finally:
            try:
                self._call(setresgid, gid)
            finally:
                if groups:
                    self._set_groups(groups)

    def _call(self, number: int, new_id: int) -> None:
        # setresuid/setresgid(id, id, -1): the kernel truncates C longs to 32-bit ids, where -1 keeps the saved id.
        if _ids_syscall()(number, new_id, new_id, -1) != 0:
            self._refuse()

    def _set_groups(self, groups: list[int]) -> None:
        import ctypes  # loaded by prepare_user_switch() already: no file is read here

        listed = (ctypes.c_uint * len(groups))(*groups) if groups else None
        if _syscall()(ctypes.c_long(_IDENTITY_SYSCALLS[_MACHINE][2]), ctypes.c_long(len(groups)), listed) != 0:
            self._refuse()

    def _refuse(self) -> NoReturn:
        import ctypes

        code = ctypes.get_errno()
        raise PermissionError(code, f"cannot run a command as user {self._credentials.uid}: {os.strerror(code)}")


class _AccountFile:
    """``/etc/passwd`` or ``/etc/group`` as lines of fields, read again only when the file changed.

    Every command that names a user resolves it; in an emulated guest reading
    and splitting the file each time costs more than a ``stat``. A change is
    seen by the file's identity, size and change times, which every way of
    editing it (in place, or a new file renamed over it) moves.
    """

    __slots__ = ("_cached", "path")

    def __init__(self, path: str) -> None:
        self.path = path
        self._cached: tuple[tuple[int, ...], list[list[str]]] | None = None

    def entries(self) -> list[list[str]]:
        try:
            info = os.stat(self.path)
        except OSError:
            return []
        version = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
        cached = self._cached
        if cached is not None and cached[0] == version:
            return cached[1]
        try:
            with open(self.path, encoding="utf-8", errors="replace") as source:
                entries = [line.rstrip("\n").split(":") for line in source if line.strip() and not line.startswith("#")]
        except OSError:
            return []
        self._cached = (version, entries)
        return entries


_PASSWD = _AccountFile("/etc/passwd")
_GROUP = _AccountFile("/etc/group")


def resolve_user(spec: str) -> Credentials:
    """``name``, ``uid``, ``name:group``, ``uid:gid`` (any mix) as ``docker exec --user`` reads them.

    A name must exist in /etc/passwd (a group name in /etc/group); a number
    need not, and then runs with gid 0 unless one is given, and HOME ``/``.
    """
    user, _, group = spec.partition(":")
    if not user:
        raise RequestError("BadRequest", f"user {spec!r}: give a user name or number (USER[:GROUP])")
    passwd = _PASSWD.entries()
    entry = next((fields for fields in passwd if len(fields) >= 7 and fields[0] == user), None)
    if entry is None and user.isdigit():
        entry = next((fields for fields in passwd if len(fields) >= 7 and fields[2] == user), None)
        uid, gid, home = int(user), int(entry[3]) if entry else 0, entry[5] if entry else "/"
    elif entry is None:
        raise RequestError(
            "BadRequest",
            f"unable to find user {user}: no matching entries in the image's /etc/passwd; "
            "give a user the image has, or a number",
        )
    else:
        try:
            uid, gid, home = int(entry[2]), int(entry[3]), entry[5] or "/"
        except ValueError:
            raise RequestError("BadRequest", f"user {user}: its /etc/passwd entry is malformed") from None
    if group:
        if group.isdigit():
            gid = int(group)
        else:
            match = next((fields for fields in _GROUP.entries() if len(fields) >= 3 and fields[0] == group), None)
            if match is None or not match[2].isdigit():
                raise RequestError(
                    "BadRequest", f"unable to find group {group}: no matching entries in the image's /etc/group"
                )
            gid = int(match[2])
    return Credentials(uid, gid, home)


class ImageRoot:
    """The container image a chrooted agent serves in (None outside one: see :func:`enter_image`)."""

    __slots__ = ("config", "default_user", "user_error")

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.default_user: Credentials = ROOT
        self.user_error: RequestError | None = None
        """Why the image's own ``User`` does not resolve: every command without a user fails with it."""

    def credentials(self, user: str | None) -> Credentials:
        """The request's user, else the image's."""
        if user:
            return resolve_user(user)
        if self.user_error is not None:
            raise self.user_error
        return self.default_user


def image_env(config: dict[str, Any], home: str) -> dict[str, str]:
    """The environment of the image's commands: its ``Env``, with PATH and HOME where it has none."""
    env: dict[str, str] = {}
    for item in config.get("env") or ():
        name, sep, value = str(item).partition("=")
        if name and sep:
            env[name] = value
    env.setdefault("PATH", DEFAULT_PATH)
    env.setdefault("HOME", home)
    env.setdefault("HOSTNAME", "forkd")
    return env


def enter_image() -> ImageRoot | None:
    """Adopt the image's config when the agent runs in a container image; None otherwise.

    Replaces the agent's environment with the image's (the initramfs's own
    variables would mean nothing there) and moves to its ``WorkingDir``,
    created if the image lacks it, as Docker does.
    """
    runtime = os.environ.get(RUNTIME_ENV)
    if not runtime:
        return None
    try:
        with open(os.path.join(runtime, "etc/forkd/image.json"), encoding="utf-8") as source:
            record = json.load(source)
    except (OSError, ValueError):
        record = {}
    config = record.get("config") or {}
    root = ImageRoot(config)
    user = str(config.get("user") or "")
    if user:
        try:
            root.default_user = resolve_user(user)
        except RequestError as exc:  # commands then fail naming it; the agent must still serve
            root.user_error = RequestError(exc.error_type, f"the image's User: {exc}")
    env = image_env(config, root.default_user.home)
    os.environ.clear()
    os.environ.update(env)
    workdir = str(config.get("working_dir") or "/")
    try:
        os.makedirs(workdir, exist_ok=True)
        os.chdir(workdir)
    except OSError:
        os.chdir("/")
    return root
