"""Guest memory from the VMM's side: dirty-page scans, reads, writes, sparse copies.

A copy-on-write child maps its snapshot's RAM file ``MAP_PRIVATE``; the pages
it has changed since are the anonymous pages of that mapping. The
``PAGEMAP_SCAN`` ioctl (Linux 6.7+) lists them in well under a millisecond,
``/proc/PID/mem`` reads and writes them while the VM is stopped, and tmpfs
keeps untouched guest memory as holes, so copies follow SEEK_DATA/SEEK_HOLE.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
from pathlib import Path
from typing import Callable, Iterable, Iterator

from ..errors import BackendError, ForkdError, HostNotReady, VMError
from ..filesystems import is_no_space, mount_of

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
PAGEMAP_SCAN = 0xC0606610  # _IOWR('f', 16, struct pm_scan_arg)
PM_SCAN_WP_MATCHING = 1 << 0
PM_SCAN_CHECK_WPASYNC = 1 << 1
PAGE_IS_WRITTEN = 1 << 1
PAGE_IS_FILE = 1 << 2
PAGE_IS_PRESENT = 1 << 3
PAGE_IS_SWAPPED = 1 << 4
_VEC_LEN = 4096
_CHUNK = 1 << 20  # one reusable buffer that stays in cache: fastest here


class _ScanArg(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "size",
            "flags",
            "start",
            "end",
            "walk_end",
            "vec",
            "vec_len",
            "max_pages",
            "category_inverted",
            "category_mask",
            "category_anyof_mask",
            "return_mask",
        )
    ]


class _Region(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64), ("categories", ctypes.c_uint64)]


def private_pages(pid: int, start: int, length: int) -> list[tuple[int, int]]:
    """(offset, length) ranges, relative to ``start``, of anonymous pages in a file mapping.

    These are exactly the pages a copy-on-write child has written (or that were
    written into it when it was restored from a diff).
    """
    return scan_pages(
        pid,
        start,
        length,
        required=PAGE_IS_FILE,
        inverted=PAGE_IS_FILE,
        anyof=PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
    )


def scan_pages(
    pid: int, start: int, length: int, *, required: int, inverted: int = 0, anyof: int = 0
) -> list[tuple[int, int]]:
    """``PAGEMAP_SCAN`` of process ``pid``: the merged ranges (relative to ``start``) whose pages
    have every category bit of ``required`` (each bit of ``inverted`` counting when *unset*) and,
    if ``anyof`` is given, at least one of its bits."""
    regions = scan_regions(
        pid, start, length, required=required, inverted=inverted, anyof=anyof, report=required | anyof
    )
    return merged_ranges((offset, size) for offset, size, _ in regions)


def merged_ranges(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """(offset, length) ranges in ascending order, with each run of adjacent ones made one range."""
    merged: list[tuple[int, int]] = []
    for offset, size in ranges:
        if merged and merged[-1][0] + merged[-1][1] == offset:
            merged[-1] = (merged[-1][0], merged[-1][1] + size)
        else:
            merged.append((offset, size))
    return merged


def scan_regions(
    pid: int,
    start: int,
    length: int,
    *,
    required: int = 0,
    inverted: int = 0,
    anyof: int = 0,
    report: int,
    flags: int = 0,
) -> list[tuple[int, int, int]]:
    """(offset, length, categories) of the matching regions, as :func:`scan_pages` selects them.

    ``report`` names the category bits returned (regions split where they
    change); ``flags`` are PM_SCAN flags (``PM_SCAN_WP_MATCHING`` write-protects
    what matched, page by page under the page-table lock, in a range registered
    with an asynchronous userfaultfd).
    """
    vec = (_Region * _VEC_LEN)()
    arg = _ScanArg()
    arg.size = ctypes.sizeof(_ScanArg)
    arg.flags = flags
    arg.vec = ctypes.addressof(vec)
    arg.vec_len = _VEC_LEN
    arg.category_inverted = inverted
    arg.category_mask = required
    arg.category_anyof_mask = anyof
    arg.return_mask = report
    end = start + length
    regions: list[tuple[int, int, int]] = []
    with os.fdopen(open_process_file(pid, "pagemap", os.O_RDONLY), "rb") as pagemap:
        cursor = start
        while cursor < end:
            arg.start, arg.end = cursor, end
            count = fcntl.ioctl(pagemap.fileno(), PAGEMAP_SCAN, arg)
            regions += [(region.start - start, region.end - region.start, region.categories) for region in vec[:count]]
            # Fewer regions than room for them: the walk is complete. (walk_end may then stop short
            # of regions already returned, e.g. at the start of a trailing hole: re-walking from
            # there would report them twice.) A full vector ends where the walk stopped.
            if count < _VEC_LEN:
                break
            cursor = max(arg.walk_end, vec[count - 1].end)
    return regions


def _chunks(ranges: list[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    for offset, length in ranges:
        done = 0
        while done < length:
            step = min(_CHUNK, length - done)
            yield offset + done, step
            done += step


def _transfer(
    source: int, source_base: int, destination: int, destination_base: int, ranges: list[tuple[int, int]]
) -> int:
    """Copy ``ranges`` (offsets into guest memory) between two file descriptors through one buffer."""
    total = 0
    view = memoryview(bytearray(_CHUNK))
    for offset, length in _chunks(ranges):
        got = os.preadv(source, [view[:length]], source_base + offset)
        os.pwrite(destination, view[:got], destination_base + offset)
        total += got
    return total


def copy_out(pid: int, start: int, ranges: list[tuple[int, int]], destination: int) -> int:
    """Copy guest ``ranges`` from the VMM's memory into file ``destination`` at the same offsets."""
    fd = open_process_file(pid, "mem", os.O_RDONLY)
    try:
        return _transfer(fd, start, destination, 0, ranges)
    except OSError as exc:
        raise memory_error(exc, pid, "copying guest memory out of") from exc
    finally:
        os.close(fd)


def copy_in(pid: int, start: int, source: int, ranges: list[tuple[int, int]]) -> int:
    """Write ``ranges`` of file ``source`` into the VMM's memory at ``start`` + offset."""
    fd = open_process_file(pid, "mem", os.O_RDWR)
    try:
        return _transfer(source, 0, fd, start, ranges)
    except OSError as exc:
        raise memory_error(exc, pid, "writing guest memory into") from exc
    finally:
        os.close(fd)


def open_process_file(pid: int, name: str, flags: int) -> int:
    """Open ``/proc/PID/NAME`` of a QEMU process; a refusal or a dead process becomes a ForkdError."""
    try:
        return os.open(f"/proc/{pid}/{name}", flags | os.O_CLOEXEC)
    except OSError as exc:
        raise memory_error(exc, pid, f"opening /proc/{pid}/{name} of") from exc


def memory_error(exc: OSError, pid: int, what: str) -> ForkdError:
    """The ForkdError for an OSError met while reaching a QEMU process's memory, with the fix."""
    if exc.errno in (errno.EPERM, errno.EACCES):
        try:
            scope = Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip()
        except OSError:
            scope = None
        return BackendError(
            f"{what} QEMU process {pid} was refused ({exc.strerror}): the kernel lets a process read another's "
            "memory only when it may ptrace it"
            + (f", and kernel.yama.ptrace_scope is {scope}" if scope is not None else "")
            + ". Run the VMs as the same user as this process, set `sudo sysctl kernel.yama.ptrace_scope=1`"
            " (QEMU is our child process), or grant CAP_SYS_PTRACE"
        )
    if exc.errno in (errno.ENOENT, errno.ESRCH, errno.EIO) and not Path(f"/proc/{pid}").exists():
        return VMError(
            f"{what} QEMU process {pid} failed: the process is gone (the VM died); "
            "see its console log in the error that closed it"
        )
    if is_no_space(exc):
        return HostNotReady(
            f"{what} QEMU process {pid} failed: {exc.strerror}; free space on the filesystem "
            "holding the snapshot store (or /dev/shm), or remove old snapshots with "
            "`forkd snapshots rm`"
        )
    return VMError(f"{what} QEMU process {pid} failed: {exc.strerror or exc}")


def data_extents(fd: int) -> list[tuple[int, int]]:
    """(offset, length) of the allocated extents of a sparse file."""
    size = os.fstat(fd).st_size
    extents = []
    position = 0
    while position < size:
        try:
            data = os.lseek(fd, position, os.SEEK_DATA)
        except OSError:  # ENXIO: no data after position
            break
        hole = os.lseek(fd, data, os.SEEK_HOLE)
        extents.append((data, hole - data))
        position = hole
    return extents


def copy_extents(src: int, dst: int, extents: list[tuple[int, int]]) -> int:
    """Copy ``extents`` of file ``src`` into file ``dst`` at the same offsets, in the kernel.

    ``sendfile`` beat ``copy_file_range`` on tmpfs by ~25% here (measured on
    256 MiB RAM files), so it is used with the destination positioned per extent.
    """
    total = 0
    for offset, length in extents:
        os.lseek(dst, offset, os.SEEK_SET)
        done = 0
        while done < length:
            copied = os.sendfile(dst, src, offset + done, length - done)
            if copied == 0:
                break
            done += copied
        total += done
    return total


def copy_sparse(source: Path, destination: Path) -> int:
    """Copy ``source`` to a new file ``destination`` keeping holes; returns bytes copied."""
    src = os.open(source, os.O_RDONLY)
    try:
        # 0600 from the start: the copy holds guest memory (see pytest_forkd.private).
        dst = os.open(destination, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(dst, os.fstat(src).st_size)
            return copy_extents(src, dst, data_extents(src))
        finally:
            os.close(dst)
    finally:
        os.close(src)


_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_ZERO_BLOCK = bytes(64 << 10)


def _fallocate() -> Callable[[int, int, int, int], int]:
    libc = ctypes.CDLL(None, use_errno=True)
    function = libc.fallocate
    function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    function.restype = ctypes.c_int
    return function


def zero_page_runs(fd: int) -> list[tuple[int, int]]:
    """(offset, length) runs of allocated pages of file ``fd`` that hold only zeros.

    Only allocated extents are read (``pread``, so reading allocates nothing
    even on tmpfs, where a read fault through a mapping would); 64 KiB blocks
    are compared whole, page by page only when a block is not all zero.
    """
    runs: list[tuple[int, int]] = []
    zero_page = _ZERO_BLOCK[:PAGE_SIZE]

    def add(offset: int, length: int) -> None:
        if runs and runs[-1][0] + runs[-1][1] == offset:
            runs[-1] = (runs[-1][0], runs[-1][1] + length)
        else:
            runs.append((offset, length))

    for start, length in data_extents(fd):
        position, end = start, start + length
        while position < end:
            block = os.pread(fd, min(len(_ZERO_BLOCK), end - position), position)
            if not block:
                break
            if block == _ZERO_BLOCK[: len(block)]:
                add(position, len(block))
            else:
                for page in range(0, len(block) - PAGE_SIZE + 1, PAGE_SIZE):
                    if block[page : page + PAGE_SIZE] == zero_page:
                        add(position + page, PAGE_SIZE)
            position += len(block)
    return runs


def punch_zero_pages(path: Path) -> int:
    """Give back the allocated all-zero pages of a RAM file (holes read as zeros); returns bytes freed.

    QEMU allocates pages it only reads: its background snapshot reads every
    page of guest RAM first, and its migration loader reads a zero page to see
    whether it must clear it. On tmpfs each such read allocates a page, so a
    sparse 256 MiB RAM file ends up fully allocated. Punching the zero pages
    back out changes no byte anyone reads. Only for files nobody writes
    through a shared mapping while this runs (a page found zero must stay zero
    until it is punched): a snapshot's files, which children map copy-on-write.
    """
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        before = os.fstat(fd)
        fallocate = _fallocate()
        freed = 0
        try:
            for offset, length in zero_page_runs(fd):
                if fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
                    number = ctypes.get_errno()
                    if number in (errno.EOPNOTSUPP, errno.ENOSYS):
                        break  # a filesystem without holes: nothing to give back
                    raise OSError(number, os.strerror(number), str(path))
                freed += length
        finally:
            if freed:
                # The content is unchanged: keep the modification time a snapshot's record
                # compares (storage.integrity re-reads a whole file whose time moved).
                os.utime(fd, ns=(before.st_atime_ns, before.st_mtime_ns))
        return freed
    finally:
        os.close(fd)


def pagemap_scan_problem() -> str | None:
    """Why the PAGEMAP_SCAN ioctl (Linux 6.7+) is unavailable, or None when it works."""
    args = (ctypes.c_uint64 * 12)()
    buf = (ctypes.c_uint64 * 3)()
    page = ctypes.create_string_buffer(4096)
    start = ctypes.addressof(page) & ~4095
    args[0] = ctypes.sizeof(args)
    args[2], args[3] = start, start + 4096
    args[5], args[6] = ctypes.addressof(buf), 1
    args[9] = args[11] = 1 << 3  # PAGE_IS_PRESENT
    try:
        with open("/proc/self/pagemap", "rb") as pagemap:
            fcntl.ioctl(pagemap.fileno(), PAGEMAP_SCAN, args, True)
    except OSError as exc:
        return f"PAGEMAP_SCAN ioctl unavailable ({exc.strerror}); it needs Linux 6.7 or newer"
    return None


#: Feature bit of a virtio balloon that reports freed guest memory to the host (VIRTIO_BALLOON_F_REPORTING).
BALLOON_REPORTING_BIT = 5


def free_page_reporting(sysfs: Path = Path("/sys")) -> bool:
    """Whether this machine is a virtual one that hands its freed memory back to its host.

    A virtio balloon with free page reporting does that within seconds, and a
    page the host took back costs a host fault when it is used again, so
    restores that need new memory are slower than those that reuse memory
    just freed. ``forkd bench`` records it with its figures. Read from the
    feature bits the balloon driver negotiated (a string of 0/1 per bit).
    """
    for features in (sysfs / "bus/virtio/drivers/virtio_balloon").glob("virtio*/features"):
        try:
            bits = features.read_text().strip()
        except OSError:
            continue
        if len(bits) > BALLOON_REPORTING_BIT and bits[BALLOON_REPORTING_BIT] == "1":
            return True
    return False


def filesystem_type(path: str | os.PathLike[str]) -> str:
    """Type of the filesystem holding ``path`` (``tmpfs``, ``ext4``...), from /proc/self/mounts."""
    return mount_of(path)[1]
