"""Third-party E2B clients installed as their users install them, cached so that a second run is offline.

Each consumer gets what its own users get from the registries: the npm
``e2b`` package for node, and a virtualenv of its own for a Python consumer
that pins an SDK version other than the suite's (the OpenAI Agents SDK's
``e2b`` extra pins e2b 2.31.0) or brings dependencies the suite does not have
(smolagents). They are installed on first use under
``$XDG_CACHE_HOME/pytest-forkd-tests`` (``~/.cache/...``), one directory per
exact requirement list, and reused from there: an install that completed is
marked complete, one that did not is started over. A lock keeps two pytest
workers from installing the same thing at once.

Where the registry cannot be reached and nothing is cached, the test is
skipped with a reason naming what is missing; any other failure of an
install fails the test with the installer's output.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import filelock
import pytest

#: pip's and npm's words for "the registry could not be reached" (the only failures that skip).
OFFLINE = re.compile(
    r"Could not find a version that satisfies|No matching distribution found|NewConnectionError|"
    r"Temporary failure in name resolution|Name or service not known|Network is unreachable|"
    r"Connection refused|ConnectTimeout|Read timed out|ProxyError|Max retries exceeded|"
    r"ENOTFOUND|EAI_AGAIN|ETIMEDOUT|ECONNREFUSED|ECONNRESET|ENETUNREACH|network request .* failed"
)
_COMPLETE = ".complete"
INSTALL_TIMEOUT_S = 900


def cache_root() -> Path:
    """Where consumers are kept between runs (not the package's own cache: `make clean-cache` keeps them)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pytest-forkd-tests"


def _slot(kind: str, name: str, requirements: Sequence[str]) -> Path:
    key = hashlib.sha256("\n".join([kind, sys.version, *requirements]).encode()).hexdigest()[:16]
    return cache_root() / kind / f"{name}-{key}"


def _install(folder: Path, what: str, steps: Sequence[Sequence[str]], env: dict[str, str] | None = None) -> None:
    """Run ``steps`` to fill ``folder`` unless a completed install is there; skip when offline."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(folder) + ".lock", timeout=INSTALL_TIMEOUT_S):
        if (folder / _COMPLETE).exists():
            return
        shutil.rmtree(folder, ignore_errors=True)  # an install that did not complete
        folder.mkdir()
        for step in steps:
            completed = subprocess.run(
                list(step),
                capture_output=True,
                text=True,
                timeout=INSTALL_TIMEOUT_S,
                env={**os.environ, **(env or {})},
                check=False,
            )
            if completed.returncode != 0:
                output = (completed.stdout + completed.stderr).strip()
                shutil.rmtree(folder, ignore_errors=True)
                if OFFLINE.search(output):
                    said = next(line.strip() for line in output.splitlines() if OFFLINE.search(line))
                    pytest.skip(f"{what}: not cached under {folder.parent} and the registry is unreachable ({said})")
                pytest.fail(f"installing {what} failed ({' '.join(step)}):\n{output[-4000:]}")
        (folder / _COMPLETE).write_text(" ".join(" ".join(step) for step in steps) + "\n")


def python_env(name: str, requirements: Sequence[str]) -> Path:
    """The python of a virtualenv holding exactly ``requirements`` (installed from PyPI on first use)."""
    folder = _slot("venvs", name, requirements)
    python = folder / "bin" / "python"
    _install(
        folder,
        f"{name} ({' '.join(requirements)})",
        [
            [sys.executable, "-m", "venv", str(folder)],
            [
                str(python),
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "-q",
                "--timeout",
                "30",
                "--retries",
                "2",
                *requirements,
            ],
        ],
    )
    return python


def node_modules(name: str, packages: Sequence[str]) -> Path:
    """``node_modules`` holding ``packages`` (npm specs such as ``e2b@2.51.0``), installed from npm on first use."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip(f"{name}: needs node and npm on PATH (found node={node}, npm={npm})")
    folder = _slot("npm", name, packages)
    _install(
        folder,
        f"{name} ({' '.join(packages)} from npm)",
        [[npm, "install", "--prefix", str(folder), "--no-audit", "--no-fund", "--no-save", *packages]],
        env={"npm_config_fetch_retries": "1", "npm_config_fetch_timeout": "30000"},
    )
    return folder / "node_modules"


def installed_version(distribution: str) -> str | None:
    """The version of ``distribution`` this interpreter has (None: not installed)."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None
