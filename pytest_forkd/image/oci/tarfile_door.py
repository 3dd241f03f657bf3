"""The one door to tarfile's private API: hooks a reader of hostile layers needs and tarfile has no public way to.

Before :mod:`tarfile` hands back an entry, it reads the entry's extended
headers (PAX, GNU long names) into memory and, for a GNU sparse entry, its
whole map: a map of 240,000 blocks, which gzip squeezes into half a MiB,
costs hundreds of MiB and a minute before the caller sees the entry. In
stream mode it also keeps every entry it returned. Nothing public bounds
either, so this module, and no other, reaches into tarfile's private
methods:

- ``TarInfo._proc_member`` (the dispatch on an entry's type): an extended
  header bigger than the reader's limit, global PAX headers beyond their
  limit, and an old GNU sparse entry (type ``S``) are refused here, before
  tarfile reads their data or map;
- ``TarInfo._proc_gnusparse_00``, ``_01``, ``_10`` (PAX sparse entries,
  versions 0.0, 0.1 and 1.0): refused before the map is parsed or read;
- ``TarInfo._apply_pax_info`` (where PAX records become the entry's fields):
  any other ``GNU.sparse.*`` record, which tarfile would take for the
  entry's size, is refused;
- ``TarFile.members`` (undocumented): emptied as a stream is read, so memory
  does not grow with the number of entries.

A refusal is :class:`Refused`, which is no ``tarfile.HeaderError`` on purpose:
tarfile rewraps those into a bare ``ReadError`` and the entry's name would be
lost. :func:`door_problems` checks, with small tars made through tarfile's
public API, that this Python's tarfile still calls each hook where the door
expects it; :func:`open_stream` runs that check once per process and refuses
to read a layer when the shape has changed, so a new Python cannot silently
turn the hooks off (tests/unit/test_tarfile_door.py fails first).
"""

from __future__ import annotations

import functools
import io
import sys
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any, Final

from ...errors import ImageError

__all__ = ["SPARSE_PREFIX", "HeaderLimits", "Refused", "TarStream", "door_problems", "entries", "open_stream"]

#: The PAX keyword prefix of GNU sparse files, every version.
SPARSE_PREFIX: Final = "GNU.sparse."
#: Entry types whose data is an extended header that tarfile reads into memory whole.
EXTENDED_HEADER_TYPES: Final = (
    tarfile.XHDTYPE,
    tarfile.XGLTYPE,
    tarfile.SOLARIS_XHDTYPE,
    tarfile.GNUTYPE_LONGNAME,
    tarfile.GNUTYPE_LONGLINK,
)
SPARSE_WHY: Final = (
    "is a GNU sparse file{version}, which no image builder writes (Docker, BuildKit and buildah never do)"
)


class Refused(Exception):
    """An entry refused by a hook before tarfile read what it would have read: its ``name`` and the ``problem``."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"entry {name!r} {problem}")
        self.name = name
        self.problem = problem


@dataclass
class HeaderLimits:
    """What the hooks let extended headers cost: per header, per stream, and for a whole image (shared)."""

    #: Bytes of one extended header (PAX, GNU long name): tarfile reads it into memory whole.
    header_bytes: int
    #: Bytes of a stream's global PAX headers: tarfile copies them into every later entry.
    global_bytes: int
    #: PAX header bytes left for the whole image: tarfile parses them record by record.
    pax_bytes_left: int
    #: Extended headers before one entry (a chain of GNU long names recurses in tarfile).
    chained: int = 8


class TarStream(tarfile.TarFile):
    """A tar read as a stream, with the :class:`HeaderLimits` the hooks of :class:`_GuardedTarInfo` apply."""

    def __init__(self, *args: Any, limits: HeaderLimits, **kwargs: Any) -> None:
        # Set before tarfile's constructor reads the first entry (it does, in read mode).
        self.limits = limits
        self.global_header_bytes = 0
        self.chained = 0
        super().__init__(*args, **kwargs)


def _sparse_name(entry: tarfile.TarInfo, headers: object) -> str:
    """The name a PAX sparse entry goes by: its ``GNU.sparse.name``, else its ``path``, else its header's.

    tarfile hands the version 0.0 hook the parsed records (a dict) or, in
    releases with the 2024 fix of PAX parsing backported (Debian's 3.11.2),
    the raw ones: a list of ``(length, keyword, value)`` in bytes. Both are read.
    """
    if isinstance(headers, dict):
        return str(headers.get(SPARSE_PREFIX + "name") or headers.get("path") or entry.name)
    if isinstance(headers, list):
        raw = {record[1]: record[2] for record in headers if isinstance(record, tuple) and len(record) == 3}
        value = raw.get(b"GNU.sparse.name") or raw.get(b"path")
        if isinstance(value, bytes):
            return value.decode("utf-8", "surrogateescape")
    return entry.name


class _GuardedTarInfo(tarfile.TarInfo):
    """The hooks: each refuses before tarfile does the unbounded part."""

    def _proc_member(self, archive: Any) -> tarfile.TarInfo:
        if self.type == _GNU_SPARSE:
            raise Refused(self.name, SPARSE_WHY.format(version=" (old GNU format, tar type 'S')"))
        if isinstance(archive, TarStream):
            if self.type in EXTENDED_HEADER_TYPES:
                _check_extended(self, archive)
            else:
                archive.chained = 0
        result: tarfile.TarInfo = super()._proc_member(archive)  # type: ignore[misc]
        return result

    def _proc_gnusparse_00(self, next: tarfile.TarInfo, *rest: Any) -> None:  # noqa: A002
        raise Refused(_sparse_name(next, rest[0] if rest else None), SPARSE_WHY.format(version=" (PAX, version 0.0)"))

    def _proc_gnusparse_01(self, next: tarfile.TarInfo, *rest: Any) -> None:  # noqa: A002
        raise Refused(_sparse_name(next, rest[0] if rest else None), SPARSE_WHY.format(version=" (PAX, version 0.1)"))

    def _proc_gnusparse_10(self, next: tarfile.TarInfo, *rest: Any) -> None:  # noqa: A002
        raise Refused(_sparse_name(next, rest[0] if rest else None), SPARSE_WHY.format(version=" (PAX, version 1.0)"))

    def _apply_pax_info(self, pax_headers: dict[str, str], encoding: str, errors: str) -> None:
        for keyword in pax_headers:
            if keyword.startswith(SPARSE_PREFIX):
                raise Refused(_sparse_name(self, pax_headers), SPARSE_WHY.format(version=f" (PAX {keyword})"))
        super()._apply_pax_info(pax_headers, encoding, errors)  # type: ignore[misc]


_GNU_SPARSE: Final = tarfile.GNUTYPE_SPARSE
_GLOBAL: Final = tarfile.XGLTYPE
_PAX: Final = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE)


def _check_extended(header: tarfile.TarInfo, archive: TarStream) -> None:
    """Refuse an extended header before tarfile reads it, if it takes its entry or image past a limit."""
    limits = archive.limits
    archive.chained += 1
    if archive.chained > limits.chained:
        raise Refused(header.name, f"is one of more than {limits.chained} extended headers in a row")
    if header.size > limits.header_bytes:
        raise Refused(header.name, f"is a {header.size}-byte extended header (at most {limits.header_bytes} are read)")
    if header.type in _PAX:
        limits.pax_bytes_left -= header.size
        if limits.pax_bytes_left < 0:
            raise Refused(header.name, "takes the image past the PAX header bytes it may have")
    if header.type == _GLOBAL:
        archive.global_header_bytes += header.size
        if archive.global_header_bytes > limits.global_bytes:
            raise Refused(
                header.name,
                f"takes the layer's global PAX headers past {limits.global_bytes} bytes (they apply to every entry)",
            )


def open_stream(fileobj: IO[bytes], *, limits: HeaderLimits, bufsize: int) -> TarStream:
    """``fileobj`` read as a tar stream (``r|``) through the hooks; raises :class:`Refused` for a refused entry.

    Raises ImageError, before reading anything, when this Python's tarfile no
    longer has the shape the hooks rely on.
    """
    problems = _checked()
    if problems:
        raise ImageError(
            f"this Python's tarfile ({sys.version.split()[0]}) no longer works the way forkd's layer reader "
            f"relies on to refuse hostile layers cheaply ({'; '.join(problems)}); run forkd on a Python it "
            "supports (3.10 to 3.13), or report this"
        )
    return _open(fileobj, limits, bufsize)


def _open(fileobj: IO[bytes], limits: HeaderLimits, bufsize: int = tarfile.RECORDSIZE) -> TarStream:
    # TarFile.open hands keyword arguments it does not know to the class it opens (typeshed does not say so).
    opener: Any = TarStream.open
    opened = opener(fileobj=fileobj, mode="r|", tarinfo=_GuardedTarInfo, bufsize=bufsize, limits=limits)
    assert isinstance(opened, TarStream)
    return opened


def entries(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    """Each entry of a stream, in order, none of them kept by ``tar`` once the next is read."""
    while True:
        member = tar.next()
        tar.members.clear()  # type: ignore[attr-defined]  # what tarfile keeps of every entry it returned
        if member is None:
            return
        yield member


# ---------------------------------------------------------------------------------------------- the shape check


def _tar(*members: tuple[tarfile.TarInfo, bytes], tar_format: int = tarfile.PAX_FORMAT, **globals_: str) -> bytes:
    stream = io.BytesIO()
    with tarfile.open(fileobj=stream, mode="w", format=tar_format, pax_headers=globals_ or None) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data))
    return stream.getvalue()


def _member(name: str, pax: dict[str, str] | None = None, data: bytes = b"") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.pax_headers = dict(pax or {})
    return info, data


def _samples() -> dict[str, tuple[bytes, str]]:
    """Small tars made with tarfile's public API, each with what the refusal of a working door says."""
    old_sparse = tarfile.TarInfo("old-sparse")
    old_sparse.type = tarfile.GNUTYPE_SPARSE
    # A version 1.0 map tarfile cannot parse: read before the hook, it fails with another error than Refused.
    unparsable_map = b"999999999\nnot a number\n".ljust(512, b"\0")
    sparse_10 = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": "s10"}
    return {
        "old GNU sparse (type S)": (_tar((old_sparse, b""), tar_format=tarfile.GNU_FORMAT), "tar type 'S'"),
        "PAX sparse 0.0": (
            _tar(_member("s00", {"GNU.sparse.size": "4", "GNU.sparse.offset": "0", "GNU.sparse.numbytes": "1"})),
            "version 0.0",
        ),
        "PAX sparse 0.1": (_tar(_member("s01", {"GNU.sparse.map": "0,x,y", "GNU.sparse.name": "s"})), "version 0.1"),
        "PAX sparse 1.0": (_tar(_member("GNUSparseFile.0/s10", sparse_10, unparsable_map)), "version 1.0"),
        "PAX sparse of another version": (
            _tar(_member("s20", {"GNU.sparse.major": "2", "GNU.sparse.realsize": "99"}, b"x")),
            "GNU.sparse.major",
        ),
        "an extended header over the limit": (_tar(_member("long", {"comment": "x" * 2000})), "extended header"),
        "global headers over their limit": (_tar(_member("g"), comment="y" * 600), "global PAX headers"),
    }


def _open_for_check(data: bytes) -> TarStream:
    return _open(io.BytesIO(data), HeaderLimits(header_bytes=1024, global_bytes=512, pax_bytes_left=1 << 20))


def door_problems() -> list[str]:
    """What of tarfile's private shape the hooks rely on has changed in this Python (empty: the door holds)."""
    hooks = ("_proc_member", "_proc_gnusparse_00", "_proc_gnusparse_01", "_proc_gnusparse_10", "_apply_pax_info")
    problems = [
        f"tarfile.TarInfo.{name} is gone" for name in hooks if not callable(getattr(tarfile.TarInfo, name, None))
    ]
    if problems:
        return problems
    for what, (data, expected) in _samples().items():
        try:
            with _open_for_check(data) as tar:
                for _entry in entries(tar):
                    pass
        except Refused as refused:
            if expected not in refused.problem:
                problems.append(f"{what}: refused as {refused.problem!r}")
            continue
        except Exception as exc:  # noqa: BLE001 - any other outcome is what the check reports
            problems.append(f"{what}: tarfile read it before the hook ({type(exc).__name__}: {exc})")
            continue
        problems.append(f"{what}: read without the hook refusing it")
    with _open_for_check(_tar(*(_member(f"f{number}", data=b"x") for number in range(3)))) as tar:
        kept = 0
        for _entry in entries(tar):
            kept = max(kept, len(tar.members))  # type: ignore[attr-defined]
        if kept > 1:
            problems.append("TarFile.members no longer holds the entries a stream returned")
    return problems


@functools.lru_cache(maxsize=1)
def _checked() -> tuple[str, ...]:
    return tuple(door_problems())
