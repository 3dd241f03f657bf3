"""zstd streams for snapshot archives, without a compiled dependency.

The standard library has no zstd before Python 3.14. Archives are written and
read through the ``zstd`` command-line tool when it is on PATH: it is one
package on every distribution and CI image (``apt-get install zstd``; GitHub's
Ubuntu runners ship it), compresses on every core (``-T0``) and keeps
``pip install pytest-forkd`` free of compiled wheels. Where the tool is
missing, the ``zstandard`` module is used if installed
(``pip install 'pytest-forkd[archive]'``); with neither, the error says how to
get one. Both produce the same standard zstd frames, so an archive written
with one is read with the other (or with ``zstd -dc FILE | tar -t``).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import IO, Final, Literal

from pytest_forkd.engine import space
from pytest_forkd.errors import ArchiveError, HostNotReady

#: zstd level 3 (the tool's default): ~1 GB/s on one core, within a few % of level 9's size on guest memory.
LEVEL: Final = 3
#: Environment variable that forces one implementation: ``binary`` or ``module``.
ENV_IMPLEMENTATION: Final = "FORKD_ZSTD"

Implementation = Literal["binary", "module"]

_HOW_TO_GET_ONE: Final = (
    "install the zstd tool (`sudo apt-get install zstd`, `dnf install zstd`, `brew install zstd`) "
    "or the Python module (`pip install 'pytest-forkd[archive]'`, which adds zstandard)"
)


def implementation() -> Implementation:
    """Which zstd this host uses: the ``zstd`` tool first, else the ``zstandard`` module."""
    forced = os.environ.get(ENV_IMPLEMENTATION, "")
    if forced not in ("", "binary", "module"):
        raise ArchiveError(f"{ENV_IMPLEMENTATION}={forced!r}: expected 'binary' or 'module', or leave it unset")
    if forced != "module" and shutil.which("zstd"):
        return "binary"
    if forced != "binary" and _zstandard() is not None:
        return "module"
    wanted = {"binary": "the zstd tool", "module": "the zstandard module"}.get(forced, "zstd")
    raise HostNotReady(f"snapshot archives are zstd-compressed and {wanted} is not available; {_HOW_TO_GET_ONE}")


def _zstandard() -> ModuleType | None:
    """The optional zstandard module, or None."""
    try:
        return importlib.import_module("zstandard")
    except ImportError:
        return None


@contextlib.contextmanager
def compressing(destination: Path) -> Iterator[IO[bytes]]:
    """A binary stream whose bytes end up zstd-compressed in ``destination`` (created 0600, or truncated).

    The file is complete when the ``with`` block exits without an exception;
    on an exception it is left incomplete, for the caller to delete.
    """
    if implementation() == "binary":
        with _private_file(destination) as output, tempfile.TemporaryFile() as errors:
            process = subprocess.Popen(
                ["zstd", "-q", f"-{LEVEL}", "-T0", "-c"], stdin=subprocess.PIPE, stdout=output, stderr=errors
            )
            assert process.stdin is not None
            try:
                yield process.stdin
                process.stdin.close()
            except BrokenPipeError:
                process.wait()
                raise _write_failure(destination, f"zstd stopped: {_text(errors)}") from None
            except BaseException:
                process.kill()
                process.wait()
                raise
            if process.wait() != 0:
                raise _write_failure(destination, f"zstd exited with status {process.returncode}: {_text(errors)}")
        return
    zstandard = _zstandard()
    assert zstandard is not None  # implementation() chose the module
    with _private_file(destination) as output:
        compressor = zstandard.ZstdCompressor(level=LEVEL, threads=-1, write_checksum=True)
        with compressor.stream_writer(output, closefd=False) as writer:
            yield writer


@contextlib.contextmanager
def decompressing(source: Path) -> Iterator[IO[bytes]]:
    """The decompressed bytes of ``source`` as a stream.

    When the ``with`` block exits normally the rest of the stream is read, so
    damage after the last byte the caller needed (a truncated frame, a bad
    checksum) still raises :class:`ArchiveError`.
    """
    if implementation() == "binary":
        with tempfile.TemporaryFile() as errors:
            process = subprocess.Popen(
                ["zstd", "-q", "-d", "-c", "--", str(source)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=errors,
            )
            assert process.stdout is not None
            try:
                yield process.stdout
                while process.stdout.read(1 << 20):
                    pass
            except BaseException:
                process.kill()
                raise
            finally:
                process.stdout.close()
                status = process.wait()
            if status != 0:
                raise ArchiveError(
                    f"{source} is not a complete zstd archive (truncated or corrupt): zstd says {_text(errors)}"
                )
        return
    zstandard = _zstandard()
    assert zstandard is not None  # implementation() chose the module
    with open(source, "rb") as raw:
        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        try:
            yield reader
            while reader.read(1 << 20):
                pass
        except zstandard.ZstdError as exc:
            raise ArchiveError(f"{source} is not a complete zstd archive (truncated or corrupt): {exc}") from None


def _write_failure(destination: Path, said: str) -> ArchiveError:
    """The error of a zstd process that could not write ``destination``: a full filesystem is named as such."""
    for number in space.NO_SPACE_ERRNOS:
        if os.strerror(number) in said:
            return ArchiveError(
                space.no_space_text(
                    OSError(number, os.strerror(number)),
                    destination.parent,
                    f"writing {destination}",
                    "free space there or write the archive elsewhere, and try again",
                )
            )
    return ArchiveError(f"writing {destination} failed: {said}")


def _private_file(path: Path) -> IO[bytes]:
    """``path`` opened for writing, created 0600: an archive holds guest memory, and with it a test's secrets."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600), "wb")


def _text(stream: IO[bytes]) -> str:
    stream.seek(0)
    text = stream.read().decode(errors="replace").strip()
    return " ".join(text.split())[-300:] or "nothing"
