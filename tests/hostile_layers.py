"""Hostile layer tars, byte by byte: what makes a naive tar reader do unbounded work before any check runs.

Each builder returns an uncompressed tar (compress it with
``oci_images.compress``); ``scripts/hostile-layers`` measures what reading
them costs forkd, and tests/unit/test_oci_layers.py and
tests/oci/test_oci_hostile_layers.py assert it loosely.

- :func:`old_gnu_sparse`: a GNU sparse entry (tar type ``S``) whose map of
  ``blocks`` (offset, size) pairs fills the extension blocks after its
  header, 21 to a block; 240,000 blocks gzip (level 9) to about half a MiB.
- :func:`pax_sparse`: the PAX forms of a sparse entry (``GNU.sparse.*``):
  version 1.0 keeps its map at the start of the data, 0.0 and 0.1 in the
  PAX header itself.
- :func:`huge_pax`: entries whose PAX headers are filled with the shortest
  records (``6 a=b``), the costliest thing to parse per byte.
- :func:`many_entries`: ``count`` empty files (headers only).
- :func:`chained_long_names`: GNU long-name headers in a row before one entry.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator

BLOCK = 512
SPARSE_NAME = "sparse-bomb"


def _octal(value: int, width: int) -> bytes:
    return b"%0*o\0" % (width - 1, value)


def _with_checksum(header: bytearray) -> bytes:
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    return bytes(header)


def _pad(size: int) -> bytes:
    return b"\0" * (-size % BLOCK)


def _end() -> bytes:
    return b"\0" * (2 * BLOCK)


def sparse_map(blocks: int) -> list[tuple[int, int]]:
    """``blocks`` one-byte data blocks, each followed by a one-byte hole (a map that gzip squeezes well)."""
    return [(number * 2, 1) for number in range(blocks)]


def old_gnu_sparse(blocks: int = 240_000, name: str = SPARSE_NAME) -> bytes:
    """A tar whose one entry is an old GNU sparse file (type ``S``) with a map of ``blocks`` blocks."""
    regions = sparse_map(blocks)
    info = tarfile.TarInfo(name)
    info.type = tarfile.GNUTYPE_SPARSE
    info.size = len(regions)  # the data stored: one byte a block
    header = bytearray(info.tobuf(format=tarfile.GNU_FORMAT))
    assert len(header) == BLOCK
    for slot, (offset, size) in enumerate(regions[:4]):
        header[386 + slot * 24 : 386 + slot * 24 + 24] = _octal(offset, 12) + _octal(size, 12)
    header[482] = 1 if len(regions) > 4 else 0
    header[483:495] = _octal(regions[-1][0] + 1, 12)  # the real size
    out = io.BytesIO()
    out.write(_with_checksum(header))
    rest = regions[4:]
    for start in range(0, len(rest), 21):
        extension = bytearray(BLOCK)
        for slot, (offset, size) in enumerate(rest[start : start + 21]):
            extension[slot * 24 : slot * 24 + 24] = _octal(offset, 12) + _octal(size, 12)
        extension[504] = 1 if start + 21 < len(rest) else 0
        out.write(bytes(extension))
    data = b"x" * len(regions)
    out.write(data + _pad(len(data)) + _end())
    return out.getvalue()


def _pax_header(records: dict[str, str] | bytes, name: str = "./PaxHeaders/x") -> bytes:
    body = records if isinstance(records, bytes) else b"".join(_record(key, value) for key, value in records.items())
    info = tarfile.TarInfo(name)
    info.type, info.size = tarfile.XHDTYPE, len(body)
    return info.tobuf(format=tarfile.USTAR_FORMAT) + body + _pad(len(body))


def _record(key: str, value: str) -> bytes:
    payload = f" {key}={value}\n".encode()
    length = len(payload) + 1
    while len(str(length)) + len(payload) != length:
        length = len(str(length)) + len(payload)
    return str(length).encode() + payload


def _file_header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    return info.tobuf(format=tarfile.USTAR_FORMAT)


def pax_sparse(version: str, blocks: int = 240_000, name: str = SPARSE_NAME) -> bytes:
    """A tar whose one entry is a PAX sparse file of ``version`` ``0.0``, ``0.1`` or ``1.0``."""
    regions = sparse_map(blocks)
    real_size = regions[-1][0] + 1
    data = b"x" * len(regions)
    if version == "1.0":
        listing = f"{len(regions)}\n" + "".join(f"{offset}\n{size}\n" for offset, size in regions)
        stored = listing.encode() + _pad(len(listing)) + data
        header = _pax_header(
            {
                "GNU.sparse.major": "1",
                "GNU.sparse.minor": "0",
                "GNU.sparse.name": name,
                "GNU.sparse.realsize": str(real_size),
            }
        )
        return header + _file_header(f"GNUSparseFile.0/{name}", len(stored)) + stored + _pad(len(stored)) + _end()
    if version == "0.1":
        records: dict[str, str] | bytes = {
            "GNU.sparse.size": str(real_size),
            "GNU.sparse.numblocks": str(len(regions)),
            "GNU.sparse.name": name,
            "GNU.sparse.map": ",".join(f"{offset},{size}" for offset, size in regions),
        }
    elif version == "0.0":
        records = _record("GNU.sparse.size", str(real_size)) + b"".join(
            _record("GNU.sparse.offset", str(offset)) + _record("GNU.sparse.numbytes", str(size))
            for offset, size in regions
        )
        records += _record("path", name)
    else:
        raise ValueError(f"no PAX sparse version {version!r}")
    return _pax_header(records) + _file_header(f"GNUSparseFile.0/{name}", len(data)) + data + _pad(len(data)) + _end()


def huge_pax(total: int, header_bytes: int = (64 << 10) - 512) -> bytes:
    """Entries with PAX headers of ``header_bytes`` of ``6 a=b`` records each, ``total`` PAX bytes in all."""
    body = b"6 a=b\n" * (header_bytes // 6)
    out = io.BytesIO()
    for number in range(max(1, total // len(body))):
        out.write(_pax_header(body))
        out.write(_file_header(f"f{number}", 0))
    out.write(_end())
    return out.getvalue()


def _many(count: int) -> Iterator[bytes]:
    template = bytearray(_file_header("f0000000", 0))
    for number in range(count):
        header = bytearray(template)
        header[0:8] = b"%08d" % number
        yield _with_checksum(header)


def many_entries(count: int) -> bytes:
    """``count`` empty regular files ``00000000`` ... (headers only: 512 bytes each)."""
    return b"".join(_many(count)) + _end()


def chained_long_names(count: int, name: str = "chained") -> bytes:
    """``count`` GNU long-name headers in a row, then one file."""
    out = io.BytesIO()
    long_name = (name + "/" + "n" * 150).encode() + b"\0"
    for _ in range(count):
        info = tarfile.TarInfo("././@LongLink")
        info.type, info.size = tarfile.GNUTYPE_LONGNAME, len(long_name)
        out.write(info.tobuf(format=tarfile.GNU_FORMAT) + long_name + _pad(len(long_name)))
    out.write(_file_header(name, 0) + _end())
    return out.getvalue()
