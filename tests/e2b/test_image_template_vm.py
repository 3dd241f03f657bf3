"""Container images as templates: ``Sandbox.create("docker://...")`` and ``forkd e2b serve --template NAME=REF``.

The image is the tests' Debian image (bash, python3, a ``/work/README`` of its
own and a user ``tester`` with uid 1000), pushed to the tests' local registry.
One server maps a name to it as ``--template debian=REF`` does, and the test
creates sandboxes both by that name and by the reference itself: both resolve
to the same image session and share one prepared template. In the busybox
image whose config names ``User: app`` the code interpreter runs as root (on
forkd's own Python, since the image has none), as E2B's Jupyter server runs it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from registry import busybox_user_image, debian_image, registry  # noqa: F401 - fixtures, used by name

pytest.importorskip("e2b")
from e2b import Sandbox  # noqa: E402

from pytest_forkd.e2b import E2BServer, ServerConfig  # noqa: E402
from pytest_forkd.plugin.e2b import REDIRECTING_VARIABLES  # noqa: E402

if TYPE_CHECKING:
    from pytest_forkd.project.session import ForkdSession

pytestmark = pytest.mark.vm

README = "a Debian image for forkd tests\n"


@pytest.fixture
def image_server(forkd: ForkdSession, debian_image: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[E2BServer]:  # noqa: F811
    """A server started as ``forkd e2b serve --template debian=REF`` would be, with the SDK's environment set."""
    with E2BServer(forkd, ServerConfig(templates={"debian": debian_image})) as server:
        server.warm("debian")  # as the command readies every mapping before it prints the environment
        for name in REDIRECTING_VARIABLES:
            monkeypatch.delenv(name, raising=False)
        for name, value in server.environment.items():
            monkeypatch.setenv(name, value)
        yield server


def test_an_image_reference_is_a_template(image_server: E2BServer, debian_image: str) -> None:  # noqa: F811
    mapped = Sandbox.create("debian")
    assert mapped.get_info().template_id == "debian"
    assert mapped.files.read("/work/README") == README  # the image's own file, through the filesystem API
    ran = mapped.commands.run("echo \"$FORKD_IMAGE $(id -un) $(pwd)\"; bash -c 'echo $BASH_VERSION'; cat /work/README")
    first, bash_version, readme = ran.stdout.split("\n", 2)
    assert first == "debian user /home/user"  # the image's Env; E2B's user and working directory
    assert bash_version.split(".")[0].isdigit() and readme == README
    ids = mapped.commands.run("id -u tester; id -u").stdout.split()
    assert ids[0] == "1000" and ids[1] not in ("0", "1000"), "E2B's user gets a uid the image does not use"
    mapped.files.write("from-sdk.txt", "written through the SDK")
    python = mapped.commands.run("python3 -c 'print(open(\"from-sdk.txt\").read())'")
    assert python.stdout == "written through the SDK\n"

    direct = Sandbox.create(debian_image)  # the reference itself, with no mapping
    assert direct.commands.run("cat /work/README").stdout == README
    assert not direct.files.exists("from-sdk.txt"), "each sandbox is a copy of its own"
    origins = [image_server.vm(sandbox.sandbox_id).origin for sandbox in (mapped, direct)]
    assert origins[0] is not None and origins[1] is not None
    assert origins[0].path == origins[1].path, "both names are one template, prepared once"
    assert sorted(image_server.sandbox_ids()) == sorted([mapped.sandbox_id, direct.sandbox_id])


def test_the_code_interpreter_runs_as_root_whatever_the_images_user(
    forkd: ForkdSession,
    busybox_user_image: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    code_interpreter = pytest.importorskip("e2b_code_interpreter")
    with E2BServer(forkd) as server:
        for name in REDIRECTING_VARIABLES:
            monkeypatch.delenv(name, raising=False)
        for name, value in server.environment.items():
            monkeypatch.setenv(name, value)
        sandbox = code_interpreter.Sandbox.create(busybox_user_image, request_timeout=600)
        ran = sandbox.run_code("import os; os.getuid()", timeout=300)  # the image has no Python: forkd's runs it
        assert (ran.error, ran.text) == (None, "0")
        sandbox.kill()
