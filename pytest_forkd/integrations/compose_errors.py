"""Where a value sits in a compose file, for messages: every compose error is one line naming its field.

Shared by the modules that read a compose file (:mod:`.compose`,
:mod:`.compose_interpolation`, :mod:`.compose_networks`,
:mod:`.compose_commands`), so that each says ``compose.yaml:
services.default.healthcheck.test: ...`` the same way, and shows a bad value
the same way (its type and a short repr).
"""

from __future__ import annotations

from pytest_forkd.errors import ConfigError

__all__ = ["Where", "shown"]


class Where:
    """Builds ConfigErrors that start with ``<file>: <field path>:``."""

    def __init__(self, origin: str) -> None:
        self.origin = origin

    def error(self, field_path: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.origin}: {field_path}: {problem}" if field_path else f"{self.origin}: {problem}")


def shown(value: object) -> str:
    """A value as a message shows it: ``nothing``, or its type and repr (cut at 80 characters)."""
    text = repr(value)
    return "nothing" if value is None else f"{type(value).__name__} {text if len(text) <= 80 else text[:77] + '...'}"
