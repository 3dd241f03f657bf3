"""Which pages of a running VMM's guest RAM the guest writes, from outside the VMM.

A userfaultfd in *asynchronous* write-protect mode (``UFFD_FEATURE_WP_ASYNC``,
Linux 6.7+) needs no fault handler: the kernel resolves the first write to a
protected page by lifting the protection, and ``PAGEMAP_SCAN`` then reports
the page as written (:meth:`WriteTracker.written`). Nothing the guest does can
make it wait for this process, and protecting guest RAM (``PAGEMAP_SCAN`` with
``PM_SCAN_WP_MATCHING``, mapped pages only) takes milliseconds *while the VM
runs*: a live branch copies memory first and, in its pause, only what was
written since.

A userfaultfd acts on the address space of the process that created it, so
it is made inside the VMM (:func:`~pytest_forkd.engine.remote.remote_syscall`),
taken over with ``pidfd_getfd`` and closed there at once: this process then
holds the only reference, and closing it ends the tracking (the kernel lifts
whatever protection is left). ``UFFD_USER_MODE_ONLY`` lets a VMM without
``CAP_SYS_PTRACE`` create it; asynchronous write-protection never delivers a
fault, from user or kernel mode, so it loses nothing.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
from types import TracebackType

from pytest_forkd.engine import memory, remote
from pytest_forkd.errors import BackendError

UFFD_USER_MODE_ONLY = 1
UFFD_API = 0xAA
UFFDIO_API = 0xC018AA3F
UFFDIO_REGISTER = 0xC020AA00
UFFDIO_REGISTER_MODE_WP = 1 << 1
UFFD_FEATURE_WP_HUGETLBFS_SHMEM = 1 << 12
UFFD_FEATURE_WP_ASYNC = 1 << 15
FEATURES = UFFD_FEATURE_WP_HUGETLBFS_SHMEM | UFFD_FEATURE_WP_ASYNC
"""Write-protection resolved by the kernel, of any memory (tmpfs-backed included, as forkd VMs' RAM is)."""


MAPPED = memory.PAGE_IS_PRESENT | memory.PAGE_IS_SWAPPED
"""A page-table entry that maps a page (in memory or swapped out)."""


class WriteTrackingUnavailable(BackendError):
    """This host or VMM cannot track writes this way (old kernel, no ptrace permission)."""


class _Api(ctypes.Structure):
    _fields_ = [("api", ctypes.c_uint64), ("features", ctypes.c_uint64), ("ioctls", ctypes.c_uint64)]


class _Register(ctypes.Structure):
    _fields_ = [
        ("start", ctypes.c_uint64),
        ("len", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("ioctls", ctypes.c_uint64),
    ]


def _userfaultfd_in(pid: int) -> int:
    """A userfaultfd created by process ``pid``, as a descriptor of this process."""
    reason = remote.unsupported_reason()
    if reason is not None:
        raise WriteTrackingUnavailable(reason)
    try:
        remote_fd = remote.remote_syscall(
            pid, remote.SYS_USERFAULTFD, os.O_CLOEXEC | os.O_NONBLOCK | UFFD_USER_MODE_ONLY
        )
    except BackendError as exc:  # ptrace refused: no remote calls into this VMM
        raise WriteTrackingUnavailable(str(exc)) from exc
    if remote_fd < 0:
        code = -remote_fd
        raise WriteTrackingUnavailable(
            f"the VMM (process {pid}) cannot create a userfaultfd: {os.strerror(code)} "
            f"({errno.errorcode.get(code, code)})"
        )
    try:
        return remote.take_fd(pid, remote_fd)
    finally:
        remote.remote_syscall(pid, remote.SYS_CLOSE, remote_fd)


class WriteTracker:
    """Asynchronous write-protection of ``length`` bytes at ``start`` in process ``pid``.

    ``protect()`` starts a tracking interval, :meth:`written` lists what the
    guest wrote since, ``close()`` ends it. Use as a context manager.
    """

    def __init__(self, pid: int, start: int, length: int) -> None:
        self.pid, self.start, self.length = pid, start, length
        self._fd = _userfaultfd_in(pid)
        try:
            api = _Api(UFFD_API, FEATURES, 0)
            try:
                fcntl.ioctl(self._fd, UFFDIO_API, api)
            except OSError as exc:
                raise WriteTrackingUnavailable(
                    f"this kernel has no asynchronous userfaultfd write-protection ({exc.strerror}); "
                    "it needs Linux 6.7 or newer"
                ) from exc
            if api.features & FEATURES != FEATURES:
                raise WriteTrackingUnavailable(
                    "this kernel has no asynchronous userfaultfd write-protection; it needs Linux 6.7 or newer"
                )
            try:
                fcntl.ioctl(self._fd, UFFDIO_REGISTER, _Register(start, length, UFFDIO_REGISTER_MODE_WP, 0))
            except OSError as exc:
                raise WriteTrackingUnavailable(
                    f"memory at {start:#x} (+{length:#x}) of process {pid} cannot be registered with a "
                    f"userfaultfd: {exc.strerror}"
                ) from exc
        except BaseException:
            os.close(self._fd)
            raise

    def protect(self) -> list[tuple[int, int]]:
        """Write-protect every mapped page of the range; returns the (offset, length) ranges of its anonymous ones.

        In a copy-on-write mapping of a file the anonymous pages are those the
        process changed. They are listed in the same pass that protects them,
        page by page under the page-table lock, so a page that changes later
        is written after its protection. Pages never mapped are left alone:
        protecting them would plant a marker in every empty page-table entry
        (work that grows with the size of the range, and again when the
        tracker closes), and :meth:`written` reports them once they are mapped.
        """
        try:
            regions = memory.scan_regions(
                self.pid,
                self.start,
                self.length,
                anyof=MAPPED,
                report=memory.PAGE_IS_FILE | MAPPED,
                flags=memory.PM_SCAN_WP_MATCHING | memory.PM_SCAN_CHECK_WPASYNC,
            )
        except OSError as exc:
            raise BackendError(f"write-protecting guest RAM of process {self.pid} failed: {exc.strerror}") from exc
        return memory.merged_ranges(
            (offset, size) for offset, size, categories in regions if not categories & memory.PAGE_IS_FILE
        )

    def written(self) -> list[tuple[int, int]]:
        """(offset, length) ranges written since :meth:`protect`, or mapped since for the first time
        (stop the VM first for a final answer).

        A page without write-protection counts as written, and so does an
        empty page-table entry; only mapped pages are asked for, so the range
        that was never touched is not reported.
        """
        return memory.scan_pages(self.pid, self.start, self.length, required=memory.PAGE_IS_WRITTEN, anyof=MAPPED)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> WriteTracker:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()
