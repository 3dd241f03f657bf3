"""System calls run inside another process (a VMM we started), and its file descriptors.

Some kernel objects work only on the address space of the process that
creates or uses them: a userfaultfd is bound to the mm that called
``userfaultfd(2)``, and an ``mmap`` replaces a mapping only in its caller. To
write-protect a QEMU's guest RAM from this process, or to swap the file
behind that RAM while the VM is stopped, the call must be made *by* QEMU.

:func:`remote_syscall` does that the way CRIU's parasite code does, without
any code in QEMU: it seizes one of QEMU's threads with ``ptrace``, points it
at a ``syscall`` instruction of its vDSO with the call's registers, single-steps
it, and restores the thread exactly as it was (an interrupted system call is
restarted by the kernel as after any signal). :func:`take_fd` then duplicates
a descriptor of QEMU's into this process with ``pidfd_getfd(2)``.

Both need the same permission as reading ``/proc/PID/mem`` (which the diff
backend needs anyway): being allowed to ptrace QEMU. x86_64 Linux only.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import signal
import threading
from pathlib import Path

from pytest_forkd.engine.memory import memory_error, open_process_file
from pytest_forkd.errors import BackendError

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.restype = ctypes.c_long
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
_libc.syscall.restype = ctypes.c_long

PTRACE_GETREGS, PTRACE_SETREGS = 12, 13
PTRACE_SINGLESTEP, PTRACE_DETACH = 9, 17
PTRACE_SEIZE, PTRACE_INTERRUPT = 0x4206, 0x4207
PTRACE_CONT = 7
PTRACE_EVENT_STOP = 128
_WALL = 0x40000000
_SYSCALL_INSN = b"\x0f\x05"

SYS_CLOSE, SYS_MMAP, SYS_MUNMAP, SYS_GETPID, SYS_OPENAT = 3, 9, 11, 39, 257
AT_FDCWD = -100
SYS_USERFAULTFD = 323
SYS_PIDFD_OPEN, SYS_PIDFD_GETFD = 434, 438

PROT_READ, PROT_WRITE = 1, 2
MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS = 0x02, 0x10, 0x20

# One injection at a time per process: ptrace stops are per tracer thread and cheap to serialise.
_lock = threading.Lock()


class _Regs(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_ulonglong)
        for name in (
            "r15",
            "r14",
            "r13",
            "r12",
            "rbp",
            "rbx",
            "r11",
            "r10",
            "r9",
            "r8",
            "rax",
            "rcx",
            "rdx",
            "rsi",
            "rdi",
            "orig_rax",
            "rip",
            "cs",
            "eflags",
            "rsp",
            "ss",
            "fs_base",
            "gs_base",
            "ds",
            "es",
            "fs",
            "gs",
        )
    ]


def unsupported_reason() -> str | None:
    """Why remote system calls cannot work on this host, or None."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"remote system calls into the VMM are implemented for x86_64 Linux, not {platform.machine()}"
    return None


def _check(result: int, what: str, pid: int) -> int:
    if result == -1:
        code = ctypes.get_errno()
        raise memory_error(OSError(code, os.strerror(code)), pid, what)
    return result


def _vdso_syscall(pid: int) -> int:
    """Address of a ``syscall`` instruction in the vDSO of ``pid`` (every process has one)."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if line.endswith("[vdso]"):
            start, end = (int(part, 16) for part in line.split()[0].split("-"))
            fd = open_process_file(pid, "mem", os.O_RDONLY)
            try:
                code = os.pread(fd, end - start, start)
            finally:
                os.close(fd)
            offset = code.find(_SYSCALL_INSN)
            if offset >= 0:
                return start + offset
    raise BackendError(f"no syscall instruction found in the vDSO of process {pid}; remote calls need one")


def _helper_thread(pid: int) -> int:
    """A long-lived thread of ``pid`` other than its leader (whose stops the process's Popen would see).

    The oldest one: QEMU starts its RCU thread first and keeps it; worker
    threads come and go.
    """
    tids = sorted(int(name) for name in os.listdir(f"/proc/{pid}/task"))
    others = [tid for tid in tids if tid != pid]
    return others[0] if others else pid


def _wait_stop(tid: int) -> int:
    """Wait for the next stop of ``tid``; returns its wait status."""
    while True:
        try:
            _, status = os.waitpid(tid, _WALL)
        except InterruptedError:
            continue
        if os.WIFEXITED(status) or os.WIFSIGNALED(status):
            raise BackendError(f"thread {tid} of the VMM ended during a remote system call")
        if os.WIFSTOPPED(status):
            return status


def _event_stop(status: int) -> bool:
    return status >> 16 == PTRACE_EVENT_STOP


def remote_syscall(pid: int, number: int, *args: int) -> int:
    """Run system call ``number`` with ``args`` inside process ``pid``; return its result.

    A negative result is ``-errno`` as the kernel returned it. The process's
    other threads keep running: callers stop the VM first when the call
    touches guest memory.
    """
    reason = unsupported_reason()
    if reason:
        raise BackendError(reason)
    if len(args) > 6:
        raise ValueError("a system call takes at most six arguments")
    with _lock:
        entry = _vdso_syscall(pid)
        tid = _helper_thread(pid)
        _check(_libc.ptrace(PTRACE_SEIZE, tid, None, None), f"seizing thread {tid} of", pid)
        pending_signal = 0  # a signal that stopped the thread on its way: delivered when we let go
        try:
            _check(_libc.ptrace(PTRACE_INTERRUPT, tid, None, None), f"interrupting thread {tid} of", pid)
            while not _event_stop(status := _wait_stop(tid)):
                pending_signal = os.WSTOPSIG(status)
                _libc.ptrace(PTRACE_CONT, tid, None, None)
            saved = _Regs()
            _check(_libc.ptrace(PTRACE_GETREGS, tid, None, ctypes.byref(saved)), "reading registers of", pid)
            call = _Regs.from_buffer_copy(saved)
            call.rax = number
            call.orig_rax = ctypes.c_ulonglong(-1).value  # no syscall-restart fix-up of the interrupted call
            call.rip = entry
            for name, value in zip(("rdi", "rsi", "rdx", "r10", "r8", "r9"), args):
                setattr(call, name, ctypes.c_ulonglong(value).value)
            try:
                _check(_libc.ptrace(PTRACE_SETREGS, tid, None, ctypes.byref(call)), "setting registers of", pid)
                done = _Regs()
                while True:  # until the syscall instruction has run (a signal may stop the thread first)
                    _check(_libc.ptrace(PTRACE_SINGLESTEP, tid, None, None), "single-stepping", pid)
                    status = _wait_stop(tid)
                    _check(_libc.ptrace(PTRACE_GETREGS, tid, None, ctypes.byref(done)), "reading registers of", pid)
                    if done.rip != entry:
                        break
                    if not _event_stop(status) and os.WSTOPSIG(status) != signal.SIGTRAP:
                        pending_signal = os.WSTOPSIG(status)
                if done.rip != entry + len(_SYSCALL_INSN):
                    raise BackendError(
                        f"a remote system call in process {pid} stopped at {done.rip:#x}, "
                        f"not after the syscall instruction at {entry:#x}"
                    )
            finally:
                _libc.ptrace(PTRACE_SETREGS, tid, None, ctypes.byref(saved))
            return ctypes.c_longlong(done.rax).value
        finally:
            _libc.ptrace(PTRACE_DETACH, tid, None, ctypes.c_void_p(pending_signal or None))


def take_fd(pid: int, fd: int) -> int:
    """Duplicate file descriptor ``fd`` of process ``pid`` into this process (close-on-exec)."""
    pidfd = _check(_libc.syscall(SYS_PIDFD_OPEN, ctypes.c_int(pid), ctypes.c_uint(0)), "opening a pidfd of", pid)
    try:
        return _check(
            _libc.syscall(SYS_PIDFD_GETFD, ctypes.c_int(pidfd), ctypes.c_int(fd), ctypes.c_uint(0)),
            f"taking descriptor {fd} of",
            pid,
        )
    finally:
        os.close(pidfd)


def remote_call_ok(pid: int, number: int, *args: int, what: str) -> int:
    """:func:`remote_syscall` that turns a ``-errno`` result into a BackendError naming ``what``."""
    result = remote_syscall(pid, number, *args)
    if result < 0:
        code = -result
        raise BackendError(
            f"{what} inside VMM process {pid} failed: {os.strerror(code)} ({errno.errorcode.get(code, code)})"
        )
    return result


def fd_number(pid: int, path: Path) -> int:
    """The lowest descriptor of process ``pid`` open on ``path`` (e.g. one handed over with QMP getfd)."""
    target = str(path)
    found = []
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{name}") == target:
                found.append(int(name))
        except OSError:
            continue
    if not found:
        raise BackendError(f"VMM process {pid} has no descriptor open on {target}")
    return min(found)


def open_in(pid: int, path: Path) -> int:
    """Open ``path`` read-only inside process ``pid``; returns the descriptor number there.

    The path is written into a scratch page mapped in the process for the
    call (through ``/proc/PID/mem``), then the page is unmapped again.
    """
    encoded = os.fsencode(str(path)) + b"\0"
    size = (len(encoded) + 4095) // 4096 * 4096
    page = remote_call_ok(
        pid,
        SYS_MMAP,
        0,
        size,
        PROT_READ | PROT_WRITE,
        MAP_PRIVATE | MAP_ANONYMOUS,
        ctypes.c_ulonglong(-1).value,
        0,
        what="mapping a scratch page",
    )
    try:
        mem = open_process_file(pid, "mem", os.O_RDWR)
        try:
            os.pwrite(mem, encoded, page)
        finally:
            os.close(mem)
        return remote_call_ok(
            pid,
            SYS_OPENAT,
            ctypes.c_ulonglong(AT_FDCWD).value,
            page,
            os.O_RDONLY | os.O_CLOEXEC,
            0,
            what=f"opening {path}",
        )
    finally:
        remote_syscall(pid, SYS_MUNMAP, page, size)
