"""What the ``--forkd-isolate`` tests download from PyPI, kept in the user's cache so later runs need no network.

- sdists of real suites (six, pluggy), as ``pip download --no-binary :all: --no-deps`` saves them;
- Debian bookworm's pytest as the guest has it (7.2.1 with the pluggy, attrs, iniconfig and packaging
  versions of its python3-* packages, and pytest-timeout 2.1.0 as python3-pytest-timeout), installed with
  ``pip install --target`` into a folder of its own: a Python started with ``-S`` and that folder on
  ``PYTHONPATH`` runs the guest's pytest on the host;
- pytest-timeout for the host, the same way.

Each lives under the real user cache (read before pytester moves ``HOME``), made once under a file lock.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from filelock import FileLock
from support import USER_CACHE

DOWNLOADS = USER_CACHE / "test-downloads"
#: Debian bookworm's versions of what python3-pytest and python3-pytest-timeout install.
GUEST_PYTEST = ("pytest==7.2.1", "pluggy==1.0.0", "attrs==22.2.0", "iniconfig==1.1.1", "packaging==23.0")
GUEST_PYTEST_TIMEOUT = "pytest-timeout==2.1.0"
HOST_PYTEST_TIMEOUT = "pytest-timeout==2.4.0"


def _pip(*args: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if result.returncode != 0:
        raise RuntimeError(f"pip {' '.join(args)} failed (PyPI unreachable?):\n{result.stdout}\n{result.stderr}")


def sdist(name: str, version: str) -> Path:
    """The sdist of ``name==version`` from PyPI (downloaded once)."""
    folder = DOWNLOADS / "sdists"
    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder / f"{name}.lock")):
        found = sorted(folder.glob(f"{name}-{version}.tar.gz"))
        if not found:
            _pip("download", f"{name}=={version}", "--no-binary", ":all:", "--no-deps", "-d", str(folder))
            found = sorted(folder.glob(f"{name}-{version}.tar.gz"))
        if not found:
            raise RuntimeError(f"pip downloaded no sdist of {name}=={version} into {folder}")
        return found[0]


def target(name: str, *requirements: str) -> Path:
    """A folder with ``requirements`` installed (``pip install --target``, no other packages)."""
    folder = DOWNLOADS / name
    with FileLock(str(DOWNLOADS / f"{name}.lock")):
        if not (folder / ".complete").is_file():
            DOWNLOADS.mkdir(parents=True, exist_ok=True)
            _pip("install", "--no-deps", "--target", str(folder), *requirements)
            (folder / ".complete").write_text("\n".join(requirements))
    return folder


def guest_pytest() -> Path:
    """Debian bookworm's pytest (the guest's), with pytest-timeout as Debian packages it."""
    return target("guest-pytest-7.2", *GUEST_PYTEST, GUEST_PYTEST_TIMEOUT)


def host_pytest_timeout() -> Path:
    return target("host-pytest-timeout", HOST_PYTEST_TIMEOUT)


def guest_python(site: Path) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a Python that sees only the standard library and ``site``."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTEST_", "PYTHON"))}
    env["PYTHONPATH"] = str(site)
    return [sys.executable, "-S"], env
