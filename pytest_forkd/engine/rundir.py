"""The run directory: everything one process's VMs create, in one place.

RAM files, sockets and console logs of every VM started by a process live in
``/dev/shm/pytest-forkd-<uid>/run-<pid>-<token>/``. Removing that directory
removes every byte a run left behind, and a directory whose owner process is
gone is recognisably stale: the next run kills whatever QEMU still references
it and removes it.

Guest RAM holds whatever secrets tests put into a VM, so everything here is
private to its user: one root per user (mode 0700, checked to be a real
directory owned by this user, since /dev/shm is writable by everyone), run
directories 0700, and files created 0600 from the start (``os.open`` modes,
a 177 umask for QEMU, ``fchmod`` of a socket before it is bound). Two users
on one host never share a directory.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import secrets
import shutil
import signal
import socket
import stat
import tempfile
import threading
import time
import warnings
from pathlib import Path

from .. import processes
from ..errors import HostNotReady, WaitTimeout
from ..paths import cache_dir, shm_root
from ..waiting import poll_until
from . import cancel, space

OWNER_FILE = "owner.json"
#: Mode of the per-user root and of every run directory.
DIRECTORY_MODE = 0o700
#: Mode of every file in a run directory (RAM files, sockets, console logs).
FILE_MODE = 0o600
MAX_SOCKET_PATH = 107
"""Bytes of a Unix socket path (sun_path holds 108 with the terminating NUL)."""
#: umask for processes (QEMU) that create files and sockets in a run directory: 0666 and 0777 become 0600.
PRIVATE_UMASK = 0o177


def write_private(path: Path, data: bytes) -> None:
    """Create ``path`` (it must not exist) with mode 0600 and write ``data``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def private_open(path: Path) -> int:
    """A descriptor of ``path`` created (or truncated) for writing with mode 0600."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)


def private_listener(path: Path, backlog: int = 1) -> socket.socket:
    """A Unix socket listening at ``path``, created with mode 0600.

    ``bind`` creates the socket file with the mode of the socket's inode minus
    the umask; setting that mode first (``fchmod`` before ``bind``) makes the
    file private from the moment it exists, without touching the process umask.
    """
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise HostNotReady(
            f"the socket path {path} is {len(os.fsencode(path))} bytes, more than the {MAX_SOCKET_PATH} a Unix "
            "socket allows: set FORKD_SHM_DIR to a shorter directory"
        )
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.fchmod(listener.fileno(), FILE_MODE)
        listener.bind(str(path))
        listener.listen(backlog)
    except BaseException:
        listener.close()
        raise
    return listener


def _user() -> str:
    import pwd

    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return f"uid {os.getuid()}"


def ensure_private_root(root: Path) -> Path:
    """Create ``root`` with mode 0700, or check that the existing one is this user's own directory.

    /dev/shm is writable by every user: a name there may already be taken by
    another user's directory or by a symbolic link. Either is refused with a
    HostNotReady naming the fix, never followed.
    """
    root.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(root, DIRECTORY_MODE)
    except FileExistsError:
        pass
    except OSError as exc:
        raise HostNotReady(
            f"cannot create the runtime directory {root}: {exc.strerror}; "
            "set FORKD_SHM_DIR to a writable directory on tmpfs"
        ) from exc
    info = os.lstat(root)
    if not stat.S_ISDIR(info.st_mode):
        raise HostNotReady(
            f"the runtime directory {root} exists but is not a directory (a symbolic link or file); "
            "remove it or set FORKD_SHM_DIR to a directory of your own"
        )
    if info.st_uid != os.getuid():
        raise HostNotReady(
            f"the runtime directory {root} belongs to uid {info.st_uid}, not to {_user()}; "
            "have its owner remove it, or set FORKD_SHM_DIR to a directory of your own"
        )
    if stat.S_IMODE(info.st_mode) != DIRECTORY_MODE:
        os.chmod(root, DIRECTORY_MODE)  # ours, left open by an older version: nothing of a live run is in it yet
    return root


def _owner_alive(directory: Path) -> bool:
    try:
        owner = json.loads((directory / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return processes.is_alive(int(owner.get("pid", -1)), owner.get("start_time"))


def _age_seconds(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def _kill_processes_referencing(directory: Path) -> int:
    """SIGKILL every process whose command line mentions ``directory``."""
    needle = str(directory).encode()
    killed = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if needle in cmdline:
            try:
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
            except OSError:
                pass
    return killed


def clean_stale(root: Path | None = None) -> list[Path]:
    """Remove run directories (and kill their QEMUs) whose owner process is gone, and the root once empty."""
    root = root or shm_root()
    removed: list[Path] = []
    if not root.is_dir() or root.is_symlink() or root.stat().st_uid != os.getuid():
        return removed  # another user's runs are theirs to clean
    for directory in [*root.glob("run-*"), *root.glob(".run-*")]:
        if directory.name.startswith(".") and _age_seconds(directory) < 60:
            continue  # being created right now
        if directory.is_dir() and not _owner_alive(directory):
            _kill_processes_referencing(directory)
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
    if removed:
        try:  # the root goes with its last run, as RunDir.close() does
            root.rmdir()
        except OSError:  # live runs or other files are still there
            pass
    return removed


#: The one shared root of versions before per-user roots; its stale runs of this user are still cleaned.
LEGACY_ROOT = Path("/dev/shm/pytest-forkd")


def _clean_legacy_root() -> None:
    """Remove this user's stale runs from the shared root older versions used, and the root once empty."""
    if LEGACY_ROOT.is_dir() and not LEGACY_ROOT.is_symlink() and LEGACY_ROOT.stat().st_uid == os.getuid():
        clean_stale(LEGACY_ROOT)
        try:
            LEGACY_ROOT.rmdir()
        except OSError:  # live runs of an older version, or other files: not ours to judge
            pass


#: Below this much free space on the default runtime root's filesystem, run directories go elsewhere:
#: two default (256 MiB) VMs' RAM files, the least a test session needs.
FALLBACK_BELOW = 512 * space.MIB


class RuntimeSpaceWarning(UserWarning):
    """The default runtime directory (/dev/shm) had too little room; run directories went elsewhere."""


_warned_roots: set[Path] = set()
_warn_lock = threading.Lock()


def fallback_roots() -> list[Path]:
    """Where run directories may go when /dev/shm is too small: the user's runtime directory, the temporary
    directory, the cache directory. Each is this user's own (mode 0700, checked like the default root)."""
    uid = os.getuid()
    roots = []
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        roots.append(Path(runtime) / "pytest-forkd")
    roots.append(Path(tempfile.gettempdir()) / f"pytest-forkd-run-{uid}")
    roots.append(cache_dir() / "run")
    return roots


def choose_root(*, warn: bool = True) -> tuple[Path, str | None]:
    """The root run directories go under, and why it is not the default one (None when it is).

    ``$FORKD_SHM_DIR`` is always used as given (VM starts then check its room
    and refuse in one line when it is too small). The default, /dev/shm, is
    left for a fallback with room when its filesystem has less than
    :data:`FALLBACK_BELOW` free, as in containers (64 MiB by default): a tmpfs
    first, else a directory on disk (guest RAM then lives in the page cache
    and is written back to disk: slower, and the uffd backend, which needs
    tmpfs memory, is unavailable). ``warn`` emits a RuntimeSpaceWarning once
    per process and root.
    """
    root = shm_root()
    if os.environ.get("FORKD_SHM_DIR"):
        return root, None
    try:
        default = space.filesystem_of(root)
    except OSError:
        return root, None
    if default.free >= FALLBACK_BELOW:
        return root, None
    roomy = []
    for candidate in fallback_roots():
        try:
            filesystem = space.filesystem_of(candidate)
        except OSError:
            continue
        if filesystem.free >= FALLBACK_BELOW and os.access(space.existing_ancestor(candidate), os.W_OK):
            roomy.append((filesystem.type != "tmpfs", candidate, filesystem))
    if not roomy:
        return root, None  # nowhere better: VM starts refuse with the fix
    _, chosen, filesystem = min(roomy, key=lambda item: item[0])
    reason = (
        f"{root.parent} is {default.describe()}, less than the {FALLBACK_BELOW // space.MIB} MiB forkd wants "
        f"for guest RAM, so VM files go to {chosen} ({filesystem.describe()})"
        + ("" if filesystem.type == "tmpfs" else "; guest RAM on disk is slower, and the uffd backend needs tmpfs")
    )
    if warn:
        with _warn_lock:
            first = chosen not in _warned_roots
            _warned_roots.add(chosen)
        if first:
            warnings.warn(f"{reason}; to keep them in memory, {space.RUNTIME_FIX}", RuntimeSpaceWarning, stacklevel=3)
    return chosen, reason


#: How long a forced exit keeps trying to remove its run directories.
EMERGENCY_REMOVE_S = 2.0

_live: set[Path] = set()
"""Run directories of this process not closed yet: what a forced exit (see :mod:`.cancel`) removes."""


def _remove_live_now() -> None:
    """Kill every process using this process's run directories and remove them: the last step of a forced exit.

    As in :meth:`RunDir.close`, a VMM just killed may still create or unlink
    its files while the tree is removed, so removal is tried again for up to
    :data:`EMERGENCY_REMOVE_S` (a forced exit must stay quick).
    """
    deadline = time.monotonic() + EMERGENCY_REMOVE_S
    for path in list(_live):
        _kill_processes_referencing(path)
        while True:
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.lexists(path) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        try:
            path.parent.rmdir()
        except OSError:  # other runs are still there
            pass


cancel.on_emergency(_remove_live_now)
# An interpreter that ends with run directories still open (an interrupt that came after the
# session closed its VMs, a script that never called close()) removes them on its way out too.
atexit.register(_remove_live_now)


class RunDir:
    """A fresh run directory (mode 0700) owned by this process; ``close()`` removes it."""

    def __init__(self, root: Path | None = None) -> None:
        root = root or choose_root()[0]
        name = f"run-{os.getpid()}-{secrets.token_hex(3)}"
        # Appear with the owner file already inside: another process's
        # clean_stale() must never see this directory without its owner.
        pending = root / f".{name}"
        for _ in range(10):
            ensure_private_root(root)
            try:
                os.mkdir(pending, DIRECTORY_MODE)
                break
            except FileNotFoundError:  # the last run of another process removed the empty root
                continue
            except OSError as exc:
                raise HostNotReady(
                    f"cannot create a run directory under {root}: {exc.strerror}; "
                    "free space on its filesystem or set FORKD_SHM_DIR"
                ) from exc
        else:
            raise HostNotReady(
                f"cannot create a run directory under {root}: it keeps disappearing; "
                "set FORKD_SHM_DIR to a directory of your own"
            )
        clean_stale(root)
        if root == shm_root() and not os.environ.get("FORKD_SHM_DIR"):
            _clean_legacy_root()
        owner = {"pid": os.getpid(), "start_time": processes.start_time(os.getpid())}
        write_private(pending / OWNER_FILE, json.dumps(owner).encode())
        self.path = root / name
        os.rename(pending, self.path)
        _live.add(self.path)
        self._counter = itertools.count(1)

    def new_name(self, prefix: str = "vm") -> str:
        """A name for a new VM's files, unique in this run (safe from several threads)."""
        return f"{prefix}{next(self._counter)}"

    def close(self) -> None:
        """Kill what still uses the directory and remove it (and the root, once no run is left)."""
        _kill_processes_referencing(self.path)

        def removed() -> bool:
            # A VMM that was just killed may still create or unlink its socket and log files
            # while the tree is removed; try again until the directory is gone.
            shutil.rmtree(self.path, ignore_errors=True)
            return not os.path.lexists(self.path)

        try:
            poll_until(removed, timeout=5, interval=0.05, what=f"run directory {self.path} to be removed")
        except WaitTimeout:  # closing never fails; the next run cleans it as stale
            pass
        _live.discard(self.path)
        try:
            self.path.parent.rmdir()
        except OSError:  # other runs (or their stale directories) are still there
            pass


def open_run_dir(purpose: str = "VM files") -> RunDir:
    """A new :class:`RunDir`; HostNotReady naming the directory and the fix when none can be made."""
    try:
        return RunDir()
    except OSError as exc:
        raise HostNotReady(
            f"cannot create a run directory for {purpose} under {exc.filename or 'the shm root'}: "
            f"{exc.strerror or exc}; check that /dev/shm (or $FORKD_SHM_DIR) exists, is writable and has free space"
        ) from exc
