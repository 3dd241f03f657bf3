"""The filesystem helper that runs inside each sandbox's guest: envd's filesystem calls, served from the guest.

It lives beside the agent and the code interpreter's program because it
is guest code, never imported by the host: the E2B server
(``pytest_forkd.e2b.guest_helper``) finds it with
:func:`pytest_forkd.guest.e2b_files_program` and runs it in a template's VM
as root (``python3 -u -c SOURCE``), once per template, before the template
is snapshotted. Every sandbox is a copy of that VM, so each has the helper already
running (its imports paid once, before the template was snapshotted) and the
host only attaches to it. It reads one JSON request per line on stdin and
answers one JSON line per request on stdout, with the request's ``id``;
watchers started with ``watch_stream`` also push ``{"watch", "events"}``
lines as the guest's files change. Plain Python, standard library only (the
guest may have nothing else), and no state the host needs besides what the
guest's memory already keeps across snapshots: file metadata set at upload
and the watchers.

Errors carry a ``code`` the host maps to Connect codes: ``not_found``,
``exists``, ``invalid``, ``permission``, ``no_space``, ``unknown_user``,
``internal``.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import sys
import threading
import time
from typing import Any, Callable

DEFAULT_HOME = "/home/user"
#: Temporary files of the agent's atomic writes (``.NAME.PID-ID.forkd-upload``): never reported to watchers.
UPLOAD_SUFFIX = ".forkd-upload"
#: Events a non-streaming watcher keeps until they are fetched; older ones are dropped past this.
MAX_QUEUED_EVENTS = 10000
MAX_LIST_ENTRIES = 100000
#: Seconds after an upload was committed during which the events of its own rename are not reported.
WRITE_SETTLE_S = 2.0

CREATE, WRITE, REMOVE, RENAME, CHMOD = 1, 2, 3, 4, 5

IN_MODIFY, IN_ATTRIB, IN_MOVED_FROM, IN_MOVED_TO = 0x2, 0x4, 0x40, 0x80
IN_CREATE, IN_DELETE, IN_DELETE_SELF, IN_MOVE_SELF = 0x100, 0x200, 0x400, 0x800
IN_IGNORED, IN_ISDIR, IN_NONBLOCK, IN_CLOEXEC = 0x8000, 0x40000000, 0x800, 0x80000
WATCH_MASK = IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF | IN_MOVE_SELF

_out_lock = threading.Lock()
_metadata: dict[
    str, dict[str, str]
] = {}  # absolute path -> {key: value}, set by uploads that carried X-Metadata-* headers


class Failure(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def emit(message: dict[str, Any]) -> None:
    line = json.dumps(message, separators=(",", ":")) + "\n"
    with _out_lock:
        sys.stdout.write(line)
        sys.stdout.flush()


def os_failure(exc: OSError, path: str) -> Failure:
    code = {
        errno.ENOENT: "not_found",
        errno.ENOTDIR: "invalid",
        errno.EEXIST: "exists",
        errno.ENOTEMPTY: "invalid",
        errno.EISDIR: "invalid",
        errno.EACCES: "permission",
        errno.EPERM: "permission",
        errno.ENOSPC: "no_space",
        errno.EINVAL: "invalid",
    }.get(exc.errno or 0, "internal")
    return Failure(code, f"{path}: {exc.strerror or exc}")


# -- users and paths ---------------------------------------------------------------------------------------------


def _table(path: str) -> list[list[str]]:
    try:
        with open(path, encoding="utf-8", errors="replace") as source:
            return [line.rstrip("\n").split(":") for line in source if line.strip() and not line.startswith("#")]
    except OSError:
        return []


def account(user: str | None) -> tuple[int, int, str]:
    """(uid, gid, home) of ``user``; None (a template without E2B's ``user``): root's ids, home /home/user."""
    if user is None or user == "":
        return 0, 0, DEFAULT_HOME
    for fields in _table("/etc/passwd"):
        if len(fields) >= 7 and (fields[0] == user or (user.isdigit() and fields[2] == user)):
            return int(fields[2]), int(fields[3]), fields[5] or "/"
    raise Failure("unknown_user", f"invalid username: {user!r} is not a user of the sandbox (not in its /etc/passwd)")


def absolute(path: Any, user: str | None) -> str:
    if not isinstance(path, str) or "\0" in path:
        raise Failure("invalid", f"path must be a string without NUL bytes, got {path!r}")
    if not path:
        raise Failure("invalid", "path must not be empty")
    if path == "~" or path.startswith("~/"):
        path = account(user)[2] + path[1:]
    elif not path.startswith("/"):
        path = os.path.join(account(user)[2], path)
    return str(os.path.normpath(path))


def _names(path: str) -> dict[str, str]:
    return {fields[2]: fields[0] for fields in _table(path) if len(fields) >= 3}


def entry(path: str, users: dict[str, str] | None = None, groups: dict[str, str] | None = None) -> dict[str, Any]:
    """envd's EntryInfo of ``path`` (a symbolic link is described by its target, with ``is_symlink`` set)."""
    info = os.lstat(path)
    is_link = stat.S_ISLNK(info.st_mode)
    target = None
    kind = "file" if stat.S_ISREG(info.st_mode) else "dir" if stat.S_ISDIR(info.st_mode) else ""
    if is_link:
        target = os.path.realpath(path)
        try:
            followed = os.stat(path)
            kind = "dir" if stat.S_ISDIR(followed.st_mode) else "file" if stat.S_ISREG(followed.st_mode) else ""
        except OSError:
            kind = "symlink"  # a dangling link: nothing to describe but the link
    users = users if users is not None else _names("/etc/passwd")
    groups = groups if groups is not None else _names("/etc/group")
    return {
        "name": os.path.basename(path) or path,
        "type": kind,
        "path": path,
        "size": info.st_size,
        "mode": info.st_mode & 0o777,
        "permissions": stat.filemode(info.st_mode),
        "owner": users.get(str(info.st_uid), str(info.st_uid)),
        "group": groups.get(str(info.st_gid), str(info.st_gid)),
        "mtime": info.st_mtime,
        "symlink_target": target,
        "is_symlink": is_link,
        "metadata": dict(_metadata.get(path, {})),
    }


def _make_parents(directory: str, uid: int, gid: int) -> bool:
    """``mkdir -p``, giving the directories it made to ``uid``; True when ``directory`` itself was made."""
    missing: list[str] = []
    current = directory
    while not os.path.isdir(current):
        missing.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    for path in reversed(missing):
        try:
            os.mkdir(path)
        except FileExistsError:
            if not os.path.isdir(path):
                raise Failure("invalid", f"{path} exists and is not a directory") from None
            continue
        if uid or gid:
            os.chown(path, uid, gid)
    return bool(missing)


# -- operations -------------------------------------------------------------------------------------------------


def op_stat(request: dict[str, Any]) -> dict[str, Any]:
    path = absolute(request.get("path"), request.get("user"))
    try:
        return {"entry": entry(path)}
    except OSError as exc:
        raise os_failure(exc, path) from None


def op_list(request: dict[str, Any]) -> dict[str, Any]:
    path = absolute(request.get("path"), request.get("user"))
    depth = request.get("depth") or 1
    if not isinstance(depth, int) or depth < 1:
        raise Failure("invalid", f"depth must be at least 1, got {depth!r}")
    try:
        if not stat.S_ISDIR(os.stat(path).st_mode):
            raise Failure("invalid", f"{path} is not a directory")
    except OSError as exc:
        raise os_failure(exc, path) from None
    users, groups = _names("/etc/passwd"), _names("/etc/group")
    found: list[dict[str, Any]] = []
    level = [path]
    for _ in range(depth):
        below: list[str] = []
        for directory in level:
            try:
                names = sorted(os.listdir(directory))
            except OSError:
                continue
            for name in names:
                child = os.path.join(directory, name)
                try:
                    found.append(entry(child, users, groups))
                except OSError:
                    continue  # gone meanwhile
                if len(found) > MAX_LIST_ENTRIES:
                    raise Failure("invalid", f"{path} holds more than {MAX_LIST_ENTRIES} entries at depth {depth}")
                if os.path.isdir(child) and not os.path.islink(child):
                    below.append(child)
        level = below
    return {"entries": found}


def op_mkdir(request: dict[str, Any]) -> dict[str, Any]:
    user = request.get("user")
    path = absolute(request.get("path"), user)
    uid, gid, _ = account(user)
    if os.path.lexists(path):
        raise Failure("exists", f"{path} already exists")
    try:
        _make_parents(path, uid, gid)
        return {"entry": entry(path)}
    except OSError as exc:
        raise os_failure(exc, path) from None


def op_move(request: dict[str, Any]) -> dict[str, Any]:
    user = request.get("user")
    source = absolute(request.get("source"), user)
    destination = absolute(request.get("destination"), user)
    uid, gid, _ = account(user)
    try:
        os.lstat(source)
        _make_parents(os.path.dirname(destination), uid, gid)
        os.rename(source, destination)
    except OSError as exc:
        raise os_failure(exc, source if not os.path.lexists(source) else destination) from None
    for key in [key for key in _metadata if key == source or key.startswith(source + "/")]:
        _metadata[destination + key[len(source) :]] = _metadata.pop(key)
    return {"entry": entry(destination)}


def op_remove(request: dict[str, Any]) -> dict[str, Any]:
    path = absolute(request.get("path"), request.get("user"))
    try:
        info = os.lstat(path)
        if stat.S_ISDIR(info.st_mode):
            import shutil

            shutil.rmtree(path)
        else:
            os.unlink(path)
    except OSError as exc:
        raise os_failure(exc, path) from None
    for key in [key for key in _metadata if key == path or key.startswith(path + "/")]:
        del _metadata[key]
    return {}


def op_prepare_write(request: dict[str, Any]) -> dict[str, Any]:
    """Before an upload: the absolute path, its parent directories made, and whether the file was there."""
    user = request.get("user")
    path = absolute(request.get("path"), user)
    uid, gid, _ = account(user)
    if os.path.isdir(path):
        raise Failure("invalid", f"{path} is a directory")
    try:
        _make_parents(os.path.dirname(path), uid, gid)
    except OSError as exc:
        raise os_failure(exc, path) from None
    existed = os.path.lexists(path)
    WATCHERS.expect_write(path)
    return {"path": path, "existed": existed}


def op_finish_write(request: dict[str, Any]) -> dict[str, Any]:
    """After an upload: the file given to its user, its metadata kept, watchers told; its entry."""
    user = request.get("user")
    path = absolute(request.get("path"), user)
    uid, gid, _ = account(user)
    try:
        if uid or gid:
            os.chown(path, uid, gid)
        metadata = request.get("metadata")
        if isinstance(metadata, dict) and metadata:
            _metadata[path] = {str(key): str(value) for key, value in metadata.items()}
        WATCHERS.written(path, bool(request.get("existed")))
        return {"entry": entry(path)}
    except OSError as exc:
        raise os_failure(exc, path) from None


def op_read_check(request: dict[str, Any]) -> dict[str, Any]:
    """Before a download: the absolute path of a readable regular file (or why not)."""
    path = absolute(request.get("path"), request.get("user"))
    try:
        info = os.stat(path)
    except OSError as exc:
        raise os_failure(exc, path) from None
    if stat.S_ISDIR(info.st_mode):
        raise Failure("invalid", f"{path} is a directory, not a file")
    return {"path": path, "size": info.st_size}


_cpu_sample: list[tuple[int, int] | None] = [None]


def op_metrics(request: dict[str, Any]) -> dict[str, Any]:
    def meminfo() -> dict[str, int]:
        values: dict[str, int] = {}
        with open("/proc/meminfo") as source:
            for line in source:
                key, _, rest = line.partition(":")
                values[key] = int(rest.split()[0]) * 1024
        return values

    memory = meminfo()
    with open("/proc/stat") as source:
        fields = [int(value) for value in source.readline().split()[1:]]
    idle, total = fields[3] + (fields[4] if len(fields) > 4 else 0), sum(fields)
    previous = _cpu_sample[0] or (0, 0)
    _cpu_sample[0] = (idle, total)
    busy_pct = 100.0 * (1 - (idle - previous[0]) / (total - previous[1])) if total > previous[1] else 0.0
    disk = os.statvfs("/")
    return {
        "cpu_count": os.cpu_count() or 1,
        "cpu_used_pct": round(max(0.0, min(100.0, busy_pct)), 2),
        "mem_total": memory.get("MemTotal", 0),
        "mem_used": memory.get("MemTotal", 0) - memory.get("MemAvailable", memory.get("MemFree", 0)),
        "mem_cache": memory.get("Cached", 0),
        "disk_total": disk.f_blocks * disk.f_frsize,
        "disk_used": (disk.f_blocks - disk.f_bfree) * disk.f_frsize,
    }


# -- watchers ---------------------------------------------------------------------------------------------------


class Watcher:
    def __init__(self, number: int, root: str, recursive: bool, include_entry: bool, streaming: bool) -> None:
        self.id = number
        self.root = root
        self.recursive = recursive
        self.include_entry = include_entry
        self.streaming = streaming
        self.queue: list[dict[str, Any]] = []

    def covers(self, path: str) -> bool:
        if path == self.root:
            return False
        if not path.startswith(self.root.rstrip("/") + "/"):
            return False
        return self.recursive or os.path.dirname(path) == self.root

    def event(self, path: str, kind: int) -> dict[str, Any]:
        item: dict[str, Any] = {"name": os.path.relpath(path, self.root), "type": kind}
        if self.include_entry and kind != REMOVE and kind != RENAME:
            try:
                item["entry"] = entry(path)
            except OSError:
                pass
        return item


class Watchers:
    """Watchers over one inotify instance, read by a thread of their own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watchers: dict[int, Watcher] = {}
        self._next = 1
        self._fd: int | None = None
        self._dirs: dict[int, str] = {}  # watch descriptor -> directory
        self._wds: dict[str, int] = {}  # directory -> watch descriptor
        # Destinations of uploads: their own events are left out (the upload is reported once it is committed),
        # while it is in progress (None) and for a moment after (the rename's event may be read late).
        self._pending_writes: dict[str, float | None] = {}
        self._libc: Any = None

    def _start(self) -> None:
        if self._fd is not None:
            return
        import ctypes  # on first use: the helper starts sooner without it

        self._libc = ctypes.CDLL(None, use_errno=True)  # the C library the interpreter runs on
        fd = self._libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            raise Failure("internal", f"inotify_init1 failed: {os.strerror(ctypes.get_errno())}")
        self._fd = fd
        threading.Thread(target=self._read, name="watchers", daemon=True).start()

    def _watch_dir(self, directory: str) -> None:
        if directory in self._wds:
            return
        wd = self._libc.inotify_add_watch(self._fd, directory.encode(), WATCH_MASK)
        if wd >= 0:
            self._dirs[wd] = directory
            self._wds[directory] = wd

    def create(self, request: dict[str, Any], streaming: bool) -> dict[str, Any]:
        path = absolute(request.get("path"), request.get("user"))
        try:
            if not stat.S_ISDIR(os.stat(path).st_mode):
                raise Failure("invalid", f"{path} is not a directory")
        except OSError as exc:
            raise os_failure(exc, path) from None
        recursive = bool(request.get("recursive"))
        with self._lock:
            self._start()
            watcher = Watcher(self._next, path, recursive, bool(request.get("include_entry")), streaming)
            self._next += 1
            self._watchers[watcher.id] = watcher
            self._watch_dir(path)
            if recursive:
                for directory, subdirs, _ in os.walk(path):
                    for name in subdirs:
                        self._watch_dir(os.path.join(directory, name))
        return {"watcher": watcher.id, "path": path}

    def take(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            watcher = self._watchers.get(int(request.get("watcher") or 0))
            if watcher is None:
                raise Failure(
                    "not_found", f"watcher {request.get('watcher')!r} does not exist (removed, or never made)"
                )
            events, watcher.queue = watcher.queue, []
        return {"events": events}

    def remove(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self._watchers.pop(int(request.get("watcher") or 0), None) is None:
                raise Failure("not_found", f"watcher {request.get('watcher')!r} does not exist")
        return {}

    def expect_write(self, path: str) -> None:
        with self._lock:
            self._pending_writes[path] = None

    def written(self, path: str, existed: bool) -> None:
        with self._lock:
            self._pending_writes[path] = time.monotonic() + WRITE_SETTLE_S
        self._report(path, [WRITE] if existed else [CREATE, WRITE])

    def _muted(self, path: str) -> bool:
        if path not in self._pending_writes:
            return False
        until = self._pending_writes[path]
        if until is None or time.monotonic() < until:
            return True
        del self._pending_writes[path]
        return False

    def _report(self, path: str, kinds: list[int]) -> None:
        pushed: list[tuple[int, list[dict[str, Any]]]] = []
        with self._lock:
            for watcher in self._watchers.values():
                if not watcher.covers(path):
                    continue
                items = [watcher.event(path, kind) for kind in kinds]
                if watcher.streaming:
                    pushed.append((watcher.id, items))
                else:
                    watcher.queue.extend(items)
                    del watcher.queue[:-MAX_QUEUED_EVENTS]
        for number, items in pushed:
            emit({"watch": number, "events": items})

    def _read(self) -> None:
        import select
        import struct

        header = struct.Struct("iIII")
        fd = self._fd
        assert fd is not None
        while True:
            select.select([fd], [], [])
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                continue
            offset = 0
            while offset + header.size <= len(data):
                wd, mask, _cookie, length = header.unpack_from(data, offset)
                raw = data[offset + header.size : offset + header.size + length]
                offset += header.size + length
                name = raw.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                self._on_event(wd, mask, name)

    def _on_event(self, wd: int, mask: int, name: str) -> None:
        with self._lock:
            directory = self._dirs.get(wd)
            if mask & IN_IGNORED:
                gone = self._dirs.pop(wd, None)
                if gone is not None:
                    self._wds.pop(gone, None)
                return
            if directory is None:
                return
            path = os.path.join(directory, name) if name else directory
            if name.endswith(UPLOAD_SUFFIX) or self._muted(path):
                return  # an upload in progress: reported as a whole when it is committed
            if mask & IN_ISDIR and mask & (IN_CREATE | IN_MOVED_TO):
                if any(
                    w.recursive and (path + "/").startswith(w.root.rstrip("/") + "/") for w in self._watchers.values()
                ):
                    self._watch_dir(path)
        kinds: list[int] = []
        if mask & (IN_CREATE | IN_MOVED_TO):
            kinds.append(CREATE)
        if mask & IN_MODIFY:
            kinds.append(WRITE)
        if mask & (IN_DELETE | IN_DELETE_SELF):
            kinds.append(REMOVE)
        if mask & (IN_MOVED_FROM | IN_MOVE_SELF):
            kinds.append(RENAME)
        if mask & IN_ATTRIB:
            kinds.append(CHMOD)
        if kinds and name:
            self._report(path, kinds)


WATCHERS = Watchers()

OPERATIONS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "stat": op_stat,
    "list": op_list,
    "mkdir": op_mkdir,
    "move": op_move,
    "remove": op_remove,
    "prepare_write": op_prepare_write,
    "finish_write": op_finish_write,
    "read_check": op_read_check,
    "metrics": op_metrics,
    "watch_create": lambda request: WATCHERS.create(request, streaming=False),
    "watch_stream": lambda request: WATCHERS.create(request, streaming=True),
    "watch_events": WATCHERS.take,
    "watch_remove": WATCHERS.remove,
    "ping": lambda request: {"time": time.time()},
}


def serve(line: str) -> None:
    try:
        request = json.loads(line)
        number = request["id"]
    except (ValueError, KeyError, TypeError):
        return  # not a request of the host's: nothing to answer
    try:
        operation = OPERATIONS.get(request.get("op"))
        if operation is None:
            raise Failure("invalid", f"unknown operation {request.get('op')!r}")
        if request.get("user"):
            account(request["user"])  # as envd: a call as a user the guest does not have fails, whatever it does
        emit({"id": number, "result": operation(request)})
    except Failure as exc:
        emit({"id": number, "error": {"code": exc.code, "message": exc.message}})
    except OSError as exc:
        failure = os_failure(exc, getattr(exc, "filename", None) or "")
        emit({"id": number, "error": {"code": failure.code, "message": failure.message}})
    except Exception as exc:  # noqa: BLE001 - the helper answers every request, whatever went wrong
        emit({"id": number, "error": {"code": "internal", "message": f"{type(exc).__name__}: {exc}"}})


def main() -> None:
    emit({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        if line.strip():
            serve(line)


if __name__ == "__main__":
    main()
