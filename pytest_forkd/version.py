"""The package's version, in a module of its own so any layer can name it without importing the package API."""

from __future__ import annotations

__version__ = "0.1.0.dev0"
