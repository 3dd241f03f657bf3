"""zstd, the one implementation: streams to compress and decompress files, and a one-shot decompression.

Snapshot archives are written and read with it, container image layers
compressed with zstd are read with it, and the guest kernel and its modules
are undone with it when their package compresses them so. The standard
library has no zstd before Python 3.14, so the ``zstd`` command-line tool is
used when it is on PATH: it is one package on every distribution and CI image
(``apt-get install zstd``; GitHub's Ubuntu runners ship it), compresses on
every core (``-T0``) and keeps ``pip install pytest-forkd`` free of compiled
wheels. Where the tool is missing, the ``zstandard`` module is used if
installed (``pip install 'pytest-forkd[archive]'``); with neither, the error
says how to get one. Both read and write the same standard zstd frames, so a
file written with one is read with the other (or with ``zstd -dc FILE``).

Callers say which error a damaged stream becomes (``error``: an archive's
ArchiveError, a layer's LayerError...) and which a missing implementation
(``missing``: HostNotReady, or ImageToolMissing for images); the message is
this module's, one line naming the file.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import IO, Final, Literal

from .errors import ForkdError, HostNotReady
from .filesystems import Remedy, unwritable_text

__all__ = [
    "ENV_IMPLEMENTATION",
    "LEVEL",
    "MAGIC",
    "compressing",
    "decompress",
    "decompressing",
    "implementation",
    "is_zstd",
]

#: The first four bytes of every zstd frame.
MAGIC: Final = b"\x28\xb5\x2f\xfd"
#: zstd level 3 (the tool's default): ~1 GB/s on one core, within a few % of level 9's size on guest memory.
LEVEL: Final = 3
#: Environment variable that forces one implementation: ``binary`` or ``module``.
ENV_IMPLEMENTATION: Final = "FORKD_ZSTD"
CHUNK: Final = 1 << 20

Implementation = Literal["binary", "module"]
ErrorFactory = Callable[[str], BaseException]

HOW_TO_GET_ONE: Final = (
    "install the zstd tool (`sudo apt-get install zstd`, `dnf install zstd`, `brew install zstd`) "
    "or the Python module (`pip install 'pytest-forkd[archive]'`, which adds zstandard)"
)
_REMEDY: Final = Remedy("free space there or write elsewhere, and try again", "write elsewhere, and try again")


def is_zstd(head: bytes) -> bool:
    """Whether ``head`` (a file's first bytes) starts a zstd frame."""
    return head.startswith(MAGIC)


def _zstandard() -> ModuleType | None:
    """The optional zstandard module, or None."""
    try:
        return importlib.import_module("zstandard")
    except ImportError:
        return None


def implementation(needed_for: str = "", missing: ErrorFactory = HostNotReady) -> Implementation:
    """Which zstd this host uses: the ``zstd`` tool first, else the ``zstandard`` module.

    With neither (or not the one ``FORKD_ZSTD`` forces), raises
    ``missing(message)``; ``needed_for`` (``"layer sha256:ab12… is
    zstd-compressed"``) starts the message.
    """
    forced = os.environ.get(ENV_IMPLEMENTATION, "")
    if forced not in ("", "binary", "module"):
        raise missing(f"{ENV_IMPLEMENTATION}={forced!r}: expected 'binary' or 'module', or leave it unset")
    if forced != "module" and shutil.which("zstd"):
        return "binary"
    if forced != "binary" and _zstandard() is not None:
        return "module"
    wanted = {"binary": "the zstd tool", "module": "the zstandard module"}.get(forced, "zstd")
    raise missing(f"{needed_for or 'zstd data is read or written'} and {wanted} is not available; {HOW_TO_GET_ONE}")


@contextlib.contextmanager
def compressing(
    destination: Path, *, error: ErrorFactory = ForkdError, missing: ErrorFactory = HostNotReady
) -> Iterator[IO[bytes]]:
    """A binary stream whose bytes end up zstd-compressed in ``destination`` (created 0600, or truncated).

    The file is complete when the ``with`` block exits without an exception;
    on an exception it is left incomplete, for the caller to delete. A write
    the tool could not make (a full filesystem, say) raises ``error``.
    """
    if implementation(f"writing {destination} needs zstd", missing) == "binary":
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
                raise error(_write_failure(destination, f"zstd stopped: {_text(errors)}")) from None
            except BaseException:
                process.kill()
                process.wait()
                raise
            if process.wait() != 0:
                said = f"zstd exited with status {process.returncode}: {_text(errors)}"
                raise error(_write_failure(destination, said))
        return
    zstandard = _zstandard()
    assert zstandard is not None  # implementation() chose the module
    with _private_file(destination) as output:
        compressor = zstandard.ZstdCompressor(level=LEVEL, threads=-1, write_checksum=True)
        with compressor.stream_writer(output, closefd=False) as writer:
            yield writer


@contextlib.contextmanager
def decompressing(
    source: Path, *, error: ErrorFactory = ForkdError, missing: ErrorFactory = HostNotReady
) -> Iterator[IO[bytes]]:
    """The decompressed bytes of ``source`` as a stream.

    When the ``with`` block exits normally the rest of the stream is read, so
    damage after the last byte the caller needed (a truncated frame, a bad
    checksum) still raises ``error``. A caller that must bound the work of a
    hostile file reads the rest itself, counting it, before it leaves the block.
    """
    if implementation(f"{source} is zstd-compressed", missing) == "binary":
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
                while process.stdout.read(CHUNK):
                    pass
            except BaseException:
                process.kill()
                raise
            finally:
                process.stdout.close()
                status = process.wait()
            if status != 0:
                raise error(f"{source} is not a complete zstd stream (truncated or corrupt): zstd says {_text(errors)}")
        return
    zstandard = _zstandard()
    assert zstandard is not None  # implementation() chose the module
    with open(source, "rb") as raw:
        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        try:
            yield reader
            while reader.read(CHUNK):
                pass
        except zstandard.ZstdError as exc:
            raise error(f"{source} is not a complete zstd stream (truncated or corrupt): {exc}") from None


def decompress(
    data: bytes, what: str, *, error: ErrorFactory = ForkdError, missing: ErrorFactory = HostNotReady
) -> bytes:
    """``data`` (one or more zstd frames, as in a kernel payload or a ``.ko.zst`` module) decompressed.

    ``what`` names the data in errors (``"the kernel"``). Frames written from
    a pipe record no size; both implementations read them.
    """
    if implementation(f"{what} is zstd-compressed", missing) == "binary":
        completed = subprocess.run(["zstd", "-q", "-d", "-c"], input=data, capture_output=True, check=False)
        if completed.returncode != 0:
            said = " ".join(completed.stderr.decode(errors="replace").split())[-300:]
            raise error(f"{what}: zstd cannot decompress it ({said or f'exit status {completed.returncode}'})")
        return completed.stdout
    zstandard = _zstandard()
    assert zstandard is not None  # implementation() chose the module
    output = bytearray()
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True)
        while chunk := reader.read(CHUNK):
            output += chunk
    except zstandard.ZstdError as exc:
        raise error(f"{what}: zstd cannot decompress it ({exc})") from None
    return bytes(output)


def _write_failure(destination: Path, said: str) -> str:
    """What a zstd process that could not write ``destination`` said; a full or read-only filesystem as such."""
    return unwritable_text(said, destination.parent, f"writing {destination}", _REMEDY) or (
        f"writing {destination} failed: {said}"
    )


def _private_file(path: Path) -> IO[bytes]:
    """``path`` opened for writing, created 0600: an archive holds guest memory, and with it a test's secrets."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600), "wb")


def _text(stream: IO[bytes]) -> str:
    stream.seek(0)
    text = stream.read().decode(errors="replace").strip()
    return " ".join(text.split())[-300:] or "nothing"
