"""Container images of a small project for the harness tests: Debian with a failing test, and a non-root user.

Built in Python (:mod:`oci_images`) from Debian packages, pushed with skopeo to
the tests' real registry (:mod:`registry`), as a harness's task would name
them:

- ``project``: Debian bookworm (bash, python3, coreutils, adduser, passwd) with a
  project in ``/srv/project`` whose test fails (``calc.add`` subtracts), its
  config ``WorkingDir /srv/project`` and ``Env PROJECT=calc``;
- ``agent``: the same Debian root with a user ``agent`` (uid 1000) as its
  ``User`` and ``/home/agent`` as its ``WorkingDir``, for Inspect's
  conformance suite, which needs a non-root user and ``adduser``.

Both share their Debian layer, so the registry and forkd's store keep it once.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
from oci_images import DEFAULT_PATH, ImageConfigSpec, LayerTar, push, write_layout
from registry import Registry

#: What the image's Debian root is made of (with their dependencies): bash and python3, as forkd's default image
#: has, and what a Debian image a task ships usually has besides, adduser included.
PACKAGES = (
    "bash",
    "python3-minimal",
    "libpython3-stdlib",
    "coreutils",
    "adduser",
    "passwd",
    "login",
    "perl-base",
    "findutils",
    "grep",
    "sed",
)

BUGGY_CALC = "def add(a, b):\n    return a - b\n"
FIXED_CALC = "def add(a, b):\n    return a + b\n"
TEST_CALC = """\
import unittest

from calc import add


class AddTest(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)


if __name__ == "__main__":
    unittest.main()
"""
#: What proves a guest runs the project image (a file only its top layer has).
IMAGE_MARK = "/etc/forkd-project"
IMAGE_MARK_TEXT = "the project image\n"


#: The PAM stacks Debian's pam-auth-update writes, which chfn (run by adduser) and su include.
PAM_COMMON = {
    "common-auth": "auth [success=1 default=ignore] pam_unix.so nullok\nauth requisite pam_deny.so\n"
    "auth required pam_permit.so\n",
    "common-account": "account [success=1 new_authtok_reqd=done default=ignore] pam_unix.so\n"
    "account requisite pam_deny.so\naccount required pam_permit.so\n",
    "common-password": "password [success=1 default=ignore] pam_unix.so obscure yescrypt\n"
    "password requisite pam_deny.so\npassword required pam_permit.so\n",
    "common-session": "session [default=1] pam_permit.so\nsession requisite pam_deny.so\n"
    "session required pam_permit.so\nsession required pam_unix.so\n",
    "common-session-noninteractive": "session [default=1] pam_permit.so\nsession requisite pam_deny.so\n"
    "session required pam_permit.so\nsession required pam_unix.so\n",
}


@functools.lru_cache(maxsize=1)
def debian_debs() -> tuple[Path, ...]:
    """The .debs of :data:`PACKAGES` and their dependencies in the default image's release, downloaded once.

    Exactly the versions the release resolves to: the package cache may hold
    other releases' versions of the same packages too.
    """
    from pytest_forkd import paths
    from pytest_forkd.image import load_default_recipe
    from pytest_forkd.image.debian import select_packages

    recipe = load_default_recipe()
    selection = select_packages(
        recipe.release, recipe.kernel, PACKAGES, ("dpkg", "debconf", "tzdata"), paths.debs_dir(), lambda line: None
    )
    return tuple(selection.package_debs())


@functools.lru_cache(maxsize=1)
def debian_layer() -> bytes:
    """The Debian root as one uncompressed layer (its users: root and ``agent``, with shadow entries)."""
    from pytest_forkd.image.deb import unpack
    from pytest_forkd.image.rootfs import make_merged_usr

    with tempfile.TemporaryDirectory(prefix="forkd-project-image-") as folder:
        root = Path(folder) / "root"
        root.mkdir()
        make_merged_usr(root)
        for deb in debian_debs():
            unpack(deb, root)
        shell = root / "usr" / "bin" / "sh"
        shell.unlink(missing_ok=True)
        shell.symlink_to("bash")
        python = root / "usr" / "bin" / "python3"
        if not python.exists():
            python.unlink(missing_ok=True)
            python.symlink_to(sorted(path.name for path in (root / "usr" / "bin").glob("python3.*"))[-1])
        for directory in ("root", "tmp", "home"):
            (root / directory).mkdir(exist_ok=True)
        (root / "tmp").chmod(0o1777)
        etc = root / "etc"
        (etc / "passwd").write_text(
            "root:x:0:0:root:/root:/bin/bash\nagent:x:1000:1000:agent:/home/agent:/bin/bash\n"
            "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
        )
        (etc / "group").write_text("root:x:0:\nshadow:x:42:\nusers:x:100:\nagent:x:1000:\nnogroup:x:65534:\n")
        (etc / "shadow").write_text("root:*:19000:0:99999:7:::\nagent:!:19000:0:99999:7:::\nnobody:*:19000::::::\n")
        (etc / "gshadow").write_text("root:*::\nshadow:*::\nusers:*::\nagent:!::\nnogroup:*::\n")
        (etc / "shadow").chmod(0o640)
        (etc / "gshadow").chmod(0o640)
        # What libpam-runtime's postinst (pam-auth-update) writes; no maintainer script runs here.
        for name, text in PAM_COMMON.items():
            (etc / "pam.d" / name).write_text(text)
        return LayerTar().tree(root).tar()


def project_layer(calc: str = BUGGY_CALC) -> LayerTar:
    return (
        LayerTar()
        .dir("srv")
        .dir("srv/project")
        .file("srv/project/calc.py", calc)
        .file("srv/project/test_calc.py", TEST_CALC)
        .file(IMAGE_MARK.lstrip("/"), IMAGE_MARK_TEXT)
        .dir("home/agent", uid=1000, gid=1000)
    )


def push_project_image(registry: Registry, folder: Path, *, name: str = "forkd-tests/project:1") -> str:
    """Push the project image; its bare reference ``127.0.0.1:PORT/NAME`` (a compose file's ``image:``)."""
    config = ImageConfigSpec(env=(f"PATH={DEFAULT_PATH}", "PROJECT=calc"), working_dir="/srv/project", cmd=("bash",))
    written = write_layout(
        folder / "layout", [(debian_layer(), "none"), (project_layer(), "gzip")], config=config, tag="1"
    )
    push(written, registry.reference(name))
    return f"{registry.host}/{name}"


def push_agent_image(registry: Registry, folder: Path, *, name: str = "forkd-tests/agent:1") -> str:
    """Push the image whose ``User`` is ``agent`` (uid 1000); its bare reference."""
    config = ImageConfigSpec(env=(f"PATH={DEFAULT_PATH}",), working_dir="/home/agent", user="agent", cmd=("bash",))
    written = write_layout(
        folder / "layout", [(debian_layer(), "none"), (project_layer(), "gzip")], config=config, tag="1"
    )
    push(written, registry.reference(name))
    return f"{registry.host}/{name}"


@pytest.fixture(scope="session")
def project_image(registry: Registry, tmp_path_factory: pytest.TempPathFactory) -> str:
    """``127.0.0.1:PORT/forkd-tests/project:1``: Debian with a project whose test fails (bare, as compose names it)."""
    return push_project_image(registry, tmp_path_factory.mktemp("project-image"))


@pytest.fixture(scope="session")
def agent_image(registry: Registry, tmp_path_factory: pytest.TempPathFactory) -> str:
    """``127.0.0.1:PORT/forkd-tests/agent:1``: the project's Debian with ``User: agent`` and ``adduser``."""
    return push_agent_image(registry, tmp_path_factory.mktemp("agent-image"))
