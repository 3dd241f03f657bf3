"""The Agents SDK client without VMs: options, bad input, and the SDK staying unimported until asked for.

Bad snapshot names and broken forkd.yaml files are refused by
``ForkdSession.open`` before anything boots, so these tests need no QEMU.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pytest_forkd.errors import ConfigError

if TYPE_CHECKING:  # bound by sdk_imported below
    from agents.sandbox.session.sandbox_client import BaseSandboxClientOptions

    from pytest_forkd.integrations.openai_agents import ForkdSandboxClient, ForkdSandboxClientOptions


@pytest.fixture(autouse=True, scope="module")
def sdk_imported() -> None:
    """The SDK and forkd's client for it, imported when this module's first test runs, not at collection.

    Importing the SDK takes a second: a run that selects none of these tests
    (``-k``, another file) does not pay it. The names become the module's, as
    imports at its top would make them.
    """
    global BaseSandboxClientOptions, ForkdSandboxClient, ForkdSandboxClientOptions
    pytest.importorskip("agents", reason='needs the OpenAI Agents SDK: pip install "pytest-forkd[openai-agents]"')
    from agents.sandbox.session.sandbox_client import BaseSandboxClientOptions

    from pytest_forkd.integrations.openai_agents import ForkdSandboxClient, ForkdSandboxClientOptions


def test_options_round_trip_through_the_sdk_registry(tmp_path: Path) -> None:
    options = ForkdSandboxClientOptions("tools", tmp_path / "forkd.yaml", pool=2)
    payload = options.model_dump(mode="json")
    assert payload == {
        "type": "forkd",
        "snapshot": "tools",
        "config": str(tmp_path / "forkd.yaml"),
        "pool": 2,
        "image": None,
        "network_mode": None,
    }
    assert BaseSandboxClientOptions.parse(payload) == options
    assert ForkdSandboxClientOptions().snapshot == "base"


def test_image_options_take_any_reference_and_round_trip() -> None:
    options = ForkdSandboxClientOptions(image="127.0.0.1:5000/project:1", pool=2)
    assert options.image == "docker://127.0.0.1:5000/project:1"  # a bare reference, read as Docker reads it
    assert BaseSandboxClientOptions.parse(options.model_dump(mode="json")) == options
    assert options.guest is not None and options.guest.network == "outbound"  # a container's default network
    closed = ForkdSandboxClientOptions(image="python:3.12-slim", network_mode="none")
    assert closed.image == "docker://docker.io/library/python:3.12-slim" and closed.guest is not None
    assert closed.guest.network == "none"
    assert ForkdSandboxClientOptions().guest is None


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        ({"image": "Not/A Reference"}, "ForkdSandboxClientOptions image: invalid image reference"),
        ({"image": "python:3.12", "snapshot": "tools"}, "give image= or snapshot=/config=, not both"),
    ],
)
def test_bad_image_options_fail_in_one_line_before_anything_boots(arguments: dict[str, str], says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        ForkdSandboxClientOptions(**arguments)  # type: ignore[arg-type]
    assert says in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.asyncio
async def test_unknown_snapshot_fails_create_with_one_line() -> None:
    async with ForkdSandboxClient() as client:
        with pytest.raises(ConfigError) as caught:
            await client.create(options=ForkdSandboxClientOptions(snapshot="no-such-snapshot"))
        message = str(caught.value)
        assert "unknown snapshot 'no-such-snapshot'" in message and "\n" not in message
        assert client.vms == []


@pytest.mark.asyncio
async def test_broken_or_missing_forkd_yaml_fails_create(tmp_path: Path) -> None:
    broken = tmp_path / "forkd.yaml"
    broken.write_text("settings: [this is not a mapping\n")
    async with ForkdSandboxClient() as client:
        with pytest.raises(ConfigError, match="forkd.yaml"):
            await client.create(options=ForkdSandboxClientOptions(config=broken))
        with pytest.raises(ConfigError, match="no such forkd.yaml"):
            await client.create(options=ForkdSandboxClientOptions(config=tmp_path / "missing.yaml"))


@pytest.mark.asyncio
async def test_a_closed_client_refuses_to_create() -> None:
    client = ForkdSandboxClient()
    client.close()
    with pytest.raises(Exception, match="closed"):
        await client.create(options=ForkdSandboxClientOptions())


@pytest.mark.slow
def test_import_and_pytest_start_up_do_not_import_the_sdk(tmp_path: Path) -> None:
    """``import pytest_forkd``, a pytest run that does not use the fixture, and listing it never load ``agents``."""
    (tmp_path / "test_plain.py").write_text("def test_plain():\n    pass\n")
    script = textwrap.dedent(
        f"""
        import sys
        import pytest_forkd
        assert "agents" not in sys.modules, "import pytest_forkd loaded agents"
        import pytest
        assert pytest.main(["-q", "-p", "no:cacheprovider", {str(tmp_path)!r}]) == 0
        assert pytest.main(["-q", "-p", "no:cacheprovider", "--fixtures", {str(tmp_path)!r}]) == 0
        loaded = sorted(name for name in sys.modules if name == "agents" or name.startswith("agents."))
        assert not loaded, loaded
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout
    assert "forkd_sandbox_client" in done.stdout  # the fixture is registered all the same
