"""Byte sizes as users write them in options and forkd.yaml: ``4194304``, ``4MiB``, ``512 KiB``."""

from __future__ import annotations

import re

from .errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}
_SIZE = re.compile(r"^\s*(\d+)\s*([a-zA-Z]*)\s*$")


def parse_byte_size(value: object, where: str) -> int:
    """A whole number of bytes >= 0 from an int or a string with an optional KiB/MiB/GiB unit.

    ConfigError names ``where`` (an option, an ini key or a forkd.yaml field path).
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value >= 0:
            return value
    elif isinstance(value, str):
        match = _SIZE.match(value)
        if match and match.group(2).lower() in _UNITS:
            return int(match.group(1)) * _UNITS[match.group(2).lower()]
    raise ConfigError(f"{where}: expected a size in bytes >= 0, such as 4194304, 512KiB or 4MiB, got {value!r}")
