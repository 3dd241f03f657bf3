"""Render a page in headless Chromium (Debian's ``chromium`` package) and read back its DOM and pixels.

Used to check that the HTML report draws its charts in a real browser. The
screenshot is decoded with the standard library only (zlib + struct), so
the check needs no imaging package. CI installs the browser with
``apt-get install -y chromium``; without it the tests that need it skip.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest

WINDOW = (1200, 2000)


def chromium() -> str:
    """The browser binary, or skip the test saying how to install it."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip("needs headless Chromium: apt-get install -y chromium")
    return found


def _run(page: Path, *mode: str) -> subprocess.CompletedProcess[bytes]:
    with tempfile.TemporaryDirectory(prefix="forkd-chromium-") as profile:
        return subprocess.run(
            [
                chromium(),
                "--headless",
                "--no-sandbox",  # CI runs as root, where Chromium's sandbox refuses to start
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--hide-scrollbars",
                f"--user-data-dir={profile}",
                f"--window-size={WINDOW[0]},{WINDOW[1]}",
                *mode,
                page.absolute().as_uri(),
            ],
            capture_output=True,
            timeout=120,
            check=False,
        )


def dump_dom(page: Path) -> str:
    """The DOM after the page's scripts ran, serialized."""
    result = _run(page, "--dump-dom")
    assert result.returncode == 0, result.stderr.decode(errors="replace")[-2000:]
    return result.stdout.decode("utf-8")


def screenshot(page: Path, target: Path) -> Image:
    """A screenshot of the page at :data:`WINDOW`, saved to ``target`` and decoded."""
    result = _run(page, f"--screenshot={target}")
    assert result.returncode == 0 and target.is_file(), result.stderr.decode(errors="replace")[-2000:]
    return decode_png(target.read_bytes())


@dataclass(frozen=True)
class Image:
    """Decoded 8-bit RGB(A) pixels, row by row."""

    width: int
    height: int
    channels: int
    rows: list[bytes]

    def pixel(self, x: int, y: int) -> tuple[int, int, int]:
        offset = x * self.channels
        row = self.rows[y]
        return row[offset], row[offset + 1], row[offset + 2]

    def colours(self, left: int, top: int, width: int, height: int) -> set[tuple[int, int, int]]:
        """The distinct colours in a rectangle (clipped to the image)."""
        found = set()
        for y in range(max(0, top), min(self.height, top + height)):
            for x in range(max(0, left), min(self.width, left + width)):
                found.add(self.pixel(x, y))
        return found


def decode_png(data: bytes, *, max_rows: int | None = None) -> Image:
    """Decode a non-interlaced 8-bit RGB or RGBA PNG (what Chromium writes); only the first ``max_rows`` rows.

    Rows filtered with None or Up (most of a screenshot) are undone with
    big-integer arithmetic, the others byte by byte.
    """
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    position, compressed = 8, b""
    width = height = channels = 0
    while position < len(data):
        (length,) = struct.unpack(">I", data[position : position + 4])
        kind = data[position + 4 : position + 8]
        body = data[position + 8 : position + 8 + length]
        position += 12 + length
        if kind == b"IHDR":
            width, height, depth, colour_type, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and interlace == 0 and colour_type in (2, 6), (depth, colour_type, interlace)
            channels = 3 if colour_type == 2 else 4
        elif kind == b"IDAT":
            compressed += body
        elif kind == b"IEND":
            break
    raw = zlib.decompress(compressed)
    stride = width * channels
    height = min(height, max_rows) if max_rows is not None else height
    low_bits = int.from_bytes(b"\x7f" * stride, "big")
    high_bits = int.from_bytes(b"\x80" * stride, "big")
    rows: list[bytes] = []
    previous = bytes(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind = raw[start]
        encoded = raw[start + 1 : start + 1 + stride]
        if kind == 0:
            line = encoded
        elif kind == 2:  # bytewise addition of the row above, without carries between bytes
            a, b = int.from_bytes(encoded, "big"), int.from_bytes(previous, "big")
            line = (((a & low_bits) + (b & low_bits)) ^ ((a ^ b) & high_bits)).to_bytes(stride, "big")
        else:
            line = _unfilter(kind, bytearray(encoded), previous, channels)
        rows.append(line)
        previous = line
    return Image(width, height, channels, rows)


def _unfilter(kind: int, line: bytearray, previous: bytes, channels: int) -> bytes:
    """PNG filters Sub (1), Average (3) and Paeth (4), undone in place."""
    for i in range(len(line)):
        left = line[i - channels] if i >= channels else 0
        up = previous[i]
        if kind == 1:
            line[i] = (line[i] + left) & 0xFF
        elif kind == 3:
            line[i] = (line[i] + ((left + up) >> 1)) & 0xFF
        elif kind == 4:
            upper_left = previous[i - channels] if i >= channels else 0
            estimate = left + up - upper_left
            pa, pb, pc = abs(estimate - left), abs(estimate - up), abs(estimate - upper_left)
            predictor = left if pa <= pb and pa <= pc else up if pb <= pc else upper_left
            line[i] = (line[i] + predictor) & 0xFF
    return bytes(line)
