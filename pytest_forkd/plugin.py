"""pytest plugin entry point (``-p no:forkd`` disables it)."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("forkd", "pytest-forkd: microVM fixtures")
