"""Sandbox providers for agent frameworks: their shell and file tools run in forkd VMs.

Each submodule imports its framework and is loaded only when that framework
asks for it (Inspect through its ``inspect_ai`` entry point, the OpenAI
Agents SDK when a test or program imports
:mod:`pytest_forkd.integrations.openai_agents`), so ``import pytest_forkd``
and pytest start-up never import either framework.

May import: every layer below (foundation, guest, image, engine, storage,
latency, core, project, aio). Nothing inside the package imports it except
the plugin's framework fixtures, lazily.
"""

from pytest_forkd.moved import alias

alias(
    {
        "pytest_forkd.integrations.image_sessions": "pytest_forkd.integrations.sessions",
        "pytest_forkd.integrations.shared_sessions": "pytest_forkd.integrations.sessions",
    }
)
