"""Compose's variables: ``${VAR}`` interpolation and ``.env`` files, read as Docker Compose reads them.

Values of a compose file are interpolated from the environment given (the
process's, by default) over the ``.env`` file beside the compose file:
``$VAR``, ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``,
``${VAR:?message}``, ``${VAR?message}``, ``${VAR:+replacement}``,
``${VAR+replacement}``, nested defaults, and ``$$`` for a ``$``. Keys are
never interpolated; values at every depth are. ``env_file:`` files are read
with the same rules as ``.env`` (``#`` comments, ``export``, quoted values).

Plain data only: no framework, no VM.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pytest_forkd.errors import ConfigError
from pytest_forkd.integrations.compose_errors import Where

__all__ = ["DOTENV", "interpolate", "read_env_file"]

#: The environment file Compose reads for interpolation, beside the compose file.
DOTENV = ".env"


# -- .env files --------------------------------------------------------------------------------------------------

_ENV_LINE = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_.-]*)\s*(?:=\s*(.*?))?\s*$")


def read_env_file(path: Path, *, origin: str, missing_ok: bool = False) -> dict[str, str]:
    """``KEY=VALUE`` lines as Compose reads an env file: ``#`` comments, ``export``, quoted values."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if missing_ok:
            return {}
        raise ConfigError(f"{origin}: no such env file {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"{origin}: cannot read the env file {path}: {getattr(exc, 'strerror', None) or exc}"
        ) from None
    values: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = _ENV_LINE.match(line)
        if match is None:
            raise ConfigError(f"{origin}: {path.name} line {number}: expected KEY=VALUE, got {line.strip()[:80]!r}")
        key, value = match.group(1), match.group(2)
        if value is None:
            continue
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
            if match.group(2)[0] == '"':
                value = value.replace("\\n", "\n").replace('\\"', '"').replace("\\\\", "\\")
        else:
            value = re.sub(r"\s+#.*$", "", value)
        values[key] = value
    return values


# -- interpolation ---------------------------------------------------------------------------------------------

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BRACED = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])(.*))?", re.DOTALL)


def interpolate(value: Any, environ: Mapping[str, str], where: Where | str, field_path: str = "") -> Any:
    """``value`` (a loaded YAML tree) with ``$VAR``, ``${VAR}``, ``${VAR:-default}``... replaced as Compose does.

    ``${VAR-d}``/``${VAR:-d}``: ``d`` when unset (or empty); ``${VAR?m}``/
    ``${VAR:?m}``: ConfigError with ``m`` when unset (or empty);
    ``${VAR+r}``/``${VAR:+r}``: ``r`` when set (and not empty); ``$$`` is a
    ``$``. Keys are not interpolated, values of every depth are.
    """
    place = where if isinstance(where, Where) else Where(where)
    if isinstance(value, str):
        return _interpolate_text(value, environ, place, field_path)
    if isinstance(value, Mapping):
        return {
            key: interpolate(item, environ, place, f"{field_path}.{key}" if field_path else str(key))
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [interpolate(item, environ, place, f"{field_path}[{index}]") for index, item in enumerate(value)]
    return value


def _interpolate_text(text: str, environ: Mapping[str, str], where: Where, field_path: str) -> str:
    out: list[str] = []
    index = 0
    while index < len(text):
        char = text[index]
        if char != "$":
            out.append(char)
            index += 1
            continue
        following = text[index + 1 : index + 2]
        if following == "$":
            out.append("$")
            index += 2
        elif following == "{":
            end = _closing_brace(text, index + 2)
            if end < 0:
                raise where.error(field_path, f"invalid interpolation in {text!r}: a '${{' is not closed")
            out.append(_substitute(text[index + 2 : end], text, environ, where, field_path))
            index = end + 1
        else:
            match = _NAME.match(text, index + 1)
            if match is None:
                out.append("$")
                index += 1
            else:
                out.append(environ.get(match.group(), ""))
                index = match.end()
    return "".join(out)


def _closing_brace(text: str, start: int) -> int:
    depth = 1
    index = start
    while index < len(text):
        if text.startswith("${", index):
            depth += 1
            index += 2
            continue
        if text[index] == "}":
            depth -= 1
            if depth == 0:
                return index
        index += 1
    return -1


def _substitute(body: str, text: str, environ: Mapping[str, str], where: Where, field_path: str) -> str:
    match = _BRACED.fullmatch(body)
    if match is None:
        raise where.error(
            field_path, f"invalid interpolation ${{{body}}} in {text!r}: expected ${{NAME}} or ${{NAME:-default}}"
        )
    name, operator, argument = match.group(1), match.group(2), match.group(3) or ""
    value = environ.get(name)
    if operator is None:
        return value or ""
    empty_counts = operator.startswith(":")
    unset = value is None or (empty_counts and value == "")
    if operator.endswith("-"):
        return _interpolate_text(argument, environ, where, field_path) if unset else str(value)
    if operator.endswith("?"):
        if unset:
            message = _interpolate_text(argument, environ, where, field_path) or f"set {name}"
            raise where.error(field_path, f"required variable {name} is missing a value: {message}")
        return str(value)
    return "" if unset else _interpolate_text(argument, environ, where, field_path)
