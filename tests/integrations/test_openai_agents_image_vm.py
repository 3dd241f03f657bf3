"""The Agents SDK's sandbox sessions in VMs of a container image from the tests' real registry.

``ForkdSandboxClientOptions(image=...)`` takes the image as the SDK's Docker
client does (a bare reference, as Docker reads it); the manifest and the
workspace work in it as they do on forkd's own snapshots.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("agents", reason='needs the OpenAI Agents SDK: pip install "pytest-forkd[openai-agents]"')

from agents import set_tracing_disabled  # noqa: E402
from agents.sandbox import Manifest  # noqa: E402
from agents.sandbox.entries import File  # noqa: E402
from project_images import IMAGE_MARK, IMAGE_MARK_TEXT  # noqa: E402
from support import wait_until_dead  # noqa: E402

from pytest_forkd.errors import ImageError  # noqa: E402
from pytest_forkd.integrations.openai_agents import (  # noqa: E402
    ForkdSandbox,
    ForkdSandboxClient,
    ForkdSandboxClientOptions,
)
from pytest_forkd.integrations.sessions import SESSIONS  # noqa: E402

pytestmark = pytest.mark.vm

set_tracing_disabled(True)


@pytest.mark.asyncio
async def test_a_session_in_an_image_with_its_manifest_and_workspace(project_image: str) -> None:
    options = ForkdSandboxClientOptions(image=project_image, network_mode="none")
    manifest = Manifest(entries={"notes.txt": File(content=b"from the manifest\n")})
    client = ForkdSandboxClient()
    pids: list[int] = []
    try:
        first = await client.create(options=options, manifest=manifest)
        second = await client.create(options=options, manifest=manifest)
        assert isinstance(first, ForkdSandbox) and isinstance(second, ForkdSandbox)
        pids = [first.vm.machine.pid, second.vm.machine.pid]
        async with first, second:
            seen = await first.exec(f"pwd; cat notes.txt {IMAGE_MARK}; echo $PROJECT; python3 --version")
            assert seen.exit_code == 0, seen.stderr
            assert seen.stdout.decode().splitlines() == [
                "/workspace",
                "from the manifest",
                IMAGE_MARK_TEXT.strip(),
                "calc",
                "Python 3.11.2",
            ]
            await first.exec("cd /srv/project && sed -i 's/a - b/a + b/' calc.py")
            fixed = await first.exec("cd /srv/project && python3 test_calc.py 2>&1 | tail -1")
            untouched = await second.exec("cd /srv/project && python3 test_calc.py 2>&1 | tail -1")
            assert (fixed.stdout, untouched.stdout) == (b"OK\n", b"FAILED (failures=1)\n")
            assert (await first.read(Path("notes.txt"))).read() == b"from the manifest\n"
            # One warm parent of the image serves both sessions.
            assert first.vm.origin is not None and second.vm.origin is not None
            assert first.vm.origin.path == second.vm.origin.path
        await client.delete(first)
        await client.delete(second)
    finally:
        client.close()
    assert [pid for pid in pids if not wait_until_dead(pid)] == []
    assert SESSIONS.keys() == []


@pytest.mark.asyncio
async def test_an_image_that_cannot_be_pulled_fails_create_with_forkds_error(project_image: str) -> None:
    missing = project_image.rsplit("/", 1)[0] + "/no-such-image:1"
    async with ForkdSandboxClient() as client:
        with pytest.raises(ImageError) as caught:
            await client.create(options=ForkdSandboxClientOptions(image=missing))
        assert "no-such-image" in str(caught.value) and "\n" not in str(caught.value)
        assert client.vms == []
    assert SESSIONS.keys() == []
