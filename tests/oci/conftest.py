"""Fixtures of the container image tests: a real registry (tests/registry.py) and an empty image store per test."""

from __future__ import annotations

from pathlib import Path

import pytest
from registry import (  # noqa: F401 - fixtures, used by name
    auth_registry,
    busybox_image,
    busybox_user_image,
    debian_image,
    private_registry,
    registry,
)


@pytest.fixture
def image_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty forkd cache for the test (FORKD_CACHE_DIR), so pulls start from nothing; returns its oci folder."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("FORKD_CACHE_DIR", str(cache))
    return cache / "oci"
