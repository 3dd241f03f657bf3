"""Fixtures of the harness tests: the real local registry and the project's images pushed to it.

Importing the fixtures here makes them available to every module of this folder,
which then need not import them (their names would shadow the parameters).
"""

from project_images import agent_image, project_image  # noqa: F401
from registry import registry  # noqa: F401
