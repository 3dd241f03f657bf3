"""A compose file's YAML read as Docker Compose reads it: YAML 1.2 scalars, not PyYAML's YAML 1.1 ones.

Compose (compose-go, on Go's yaml.v3) resolves plain scalars by YAML 1.2's
core schema: only ``true``/``false`` (in three spellings) are booleans,
``0755`` is the number 755, ``0o755`` is octal, ``1:30`` and ``2001-12-14``
are text. PyYAML's ``safe_load`` follows YAML 1.1, where ``yes``, ``no``,
``on`` and ``off`` are booleans, ``0755`` is 493 and ``1:30`` is 90. Those
differences change what a service gets (``environment: {DEBUG: yes}`` is
the text ``yes`` for Compose) and which service Inspect runs
(``x-default: no`` is the text ``no``, which Inspect takes as true), so
forkd reads compose files with this loader.

Where Compose turns text into a boolean for a typed field (``internal:
"yes"``), :func:`compose_boolean` does it with Compose's rules.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

__all__ = ["ComposeLoader", "compose_boolean", "load_yaml"]


class ComposeLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 core-schema resolution of plain scalars."""


# The implicit resolvers are a class attribute shared with SafeLoader: start from an empty copy.
ComposeLoader.yaml_implicit_resolvers = {}
ComposeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
ComposeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789")
)
ComposeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)
ComposeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:null", re.compile(r"^(?:~|null|Null|NULL|)$"), ["~", "n", "N", ""]
)
ComposeLoader.add_implicit_resolver("tag:yaml.org,2002:merge", re.compile(r"^(?:<<)$"), ["<"])


def _construct_int(loader: yaml.SafeLoader, node: yaml.Node) -> int:
    """YAML 1.2 integers: decimal (a leading 0 stays decimal), ``0o`` octal, ``0x`` hexadecimal."""
    text = str(loader.construct_scalar(node))  # type: ignore[arg-type]
    if text.startswith("0o"):
        return int(text[2:], 8)
    if text.startswith("0x"):
        return int(text[2:], 16)
    return int(text, 10)


ComposeLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def load_yaml(text: str) -> Any:
    """The document in ``text`` as Compose reads it (yaml.YAMLError when it is not YAML)."""
    return yaml.load(text, Loader=ComposeLoader)  # noqa: S506 - a SafeLoader subclass


#: The texts Compose reads as booleans for a boolean field (compose-go's ``toBoolean``), lower-cased.
_TRUE = frozenset({"y", "yes", "true", "on"})
_FALSE = frozenset({"n", "no", "false", "off"})


def compose_boolean(value: object) -> bool | None:
    """``value`` of a boolean field as Compose reads it: a boolean, or one of its texts; None if it is neither."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
    return None
