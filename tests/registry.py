"""A real registry server on 127.0.0.1 for the container image tests (Debian's ``docker-registry``).

:class:`Registry` runs ``docker-registry serve CONFIG`` (the CNCF
distribution registry) on a free port over plain HTTP, its storage in a
temporary folder; it can be stopped and started again (a test of "the
registry is down, cached images still run"), protected with htpasswd basic
auth, and its stored blobs can be reached to tamper with one.

Fixtures (import the ones a module uses: ``from registry import registry``):

- ``registry``: one open registry per test session (per xdist worker);
- ``private_registry``: a registry of its own for a test that stops it or
  damages its storage;
- ``auth_registry``: one per session that wants user ``forkd`` and
  :data:`PASSWORD`;
- ``busybox_image``, ``busybox_user_image``, ``debian_image``: the images of
  :mod:`oci_images` pushed to ``registry`` once per session (their
  ``docker://127.0.0.1:PORT/...`` references).

``needs_registry`` skips, with the reason, where docker-registry or skopeo
is missing (``scripts/setup.sh --test-tools`` installs both).
"""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import tenacity

USER = "forkd"
#: The password of ``auth_registry``: a tests checks that it never shows up in output, index or cache.
PASSWORD = "s3cret-Pa55word-never-logged"


def registry_problem() -> str | None:
    """Why the real-registry tests cannot run here, or None."""
    missing = [tool for tool in ("docker-registry", "skopeo") if shutil.which(tool) is None]
    if missing:
        return (
            f"needs {' and '.join(missing)} (apt-get install docker-registry skopeo, or scripts/setup.sh --test-tools)"
        )
    return None


needs_registry = pytest.mark.skipif(registry_problem() is not None, reason=registry_problem() or "")


def htpasswd_line(user: str, password: str) -> str | None:
    """A bcrypt htpasswd line (the registry accepts bcrypt only), or None where nothing here can make one."""
    tool = shutil.which("htpasswd")
    if tool:
        return subprocess.run([tool, "-nbB", user, password], capture_output=True, text=True, check=True).stdout.strip()
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            import crypt  # the standard library's, up to Python 3.12
    except ImportError:
        return None
    hashed = crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH))
    if not hashed or not hashed.startswith("$2"):
        return None
    return f"{user}:$2a${hashed[4:]}"  # $2b$ and $2a$ hash alike; Go's bcrypt reads both


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Registry:
    """One ``docker-registry`` process on 127.0.0.1, plain HTTP, storage under ``root``."""

    def __init__(self, root: Path, *, htpasswd: str | None = None) -> None:
        self.root = root
        self.storage = root / "storage"
        self.config = root / "config.yml"
        self.log = root / "registry.log"
        self.htpasswd = htpasswd
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        """``127.0.0.1:PORT``: the registry part of a reference."""
        return f"127.0.0.1:{self.port}"

    def reference(self, name: str) -> str:
        """``docker://127.0.0.1:PORT/NAME`` (NAME with its tag or digest)."""
        return f"docker://{self.host}/{name}"

    def _write_config(self) -> None:
        self.storage.mkdir(parents=True, exist_ok=True)
        auth = ""
        if self.htpasswd is not None:
            (self.root / "htpasswd").write_text(self.htpasswd + "\n")
            auth = f"auth:\n  htpasswd:\n    realm: forkd-tests\n    path: {self.root / 'htpasswd'}\n"
        self.config.write_text(
            "version: 0.1\n"
            "log:\n  level: warn\n  accesslog:\n    disabled: true\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.storage}\n  delete:\n    enabled: true\n"
            f"http:\n  addr: 127.0.0.1:{self.port}\n" + auth
        )

    def start(self) -> Registry:
        """Start the server (on the port it had, if it ran before) and wait until it answers."""
        assert self.process is None, "the registry already runs"
        for _attempt in range(3):
            if not self.port:
                self.port = free_port()
            self._write_config()
            with self.log.open("ab") as log:
                self.process = subprocess.Popen(
                    ["docker-registry", "serve", str(self.config)], stdout=log, stderr=log, stdin=subprocess.DEVNULL
                )
            try:
                self._wait_ready()
                return self
            except RuntimeError:
                self.stop()
                self.port = 0  # taken meanwhile: another one
        raise RuntimeError(f"docker-registry did not start; its log: {self.log.read_text()[-2000:]}")

    @tenacity.retry(
        stop=tenacity.stop_after_delay(20),
        wait=tenacity.wait_fixed(0.05),
        retry=tenacity.retry_if_exception_type(OSError),
        reraise=True,
    )
    def _wait_ready(self) -> None:
        assert self.process is not None
        if self.process.poll() is not None:
            raise RuntimeError("docker-registry exited")
        try:
            urllib.request.urlopen(f"http://{self.host}/v2/", timeout=2).close()
        except urllib.error.HTTPError as exc:
            if exc.code != 401:  # an auth registry answers 401: it is up
                raise

    def stop(self) -> None:
        """Stop the server (its storage stays, so :meth:`start` brings the same images back)."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None

    @contextlib.contextmanager
    def stopped(self) -> Iterator[None]:
        """The registry is down inside the block and up again after it."""
        self.stop()
        try:
            yield
        finally:
            self.start()

    def blob_file(self, digest: str) -> Path:
        """Where the registry keeps blob ``digest`` (to damage it in a test)."""
        hexdigest = digest.split(":", 1)[1]
        return self.storage / "docker" / "registry" / "v2" / "blobs" / "sha256" / hexdigest[:2] / hexdigest / "data"

    def authfile(self, folder: Path, *, password: str = PASSWORD) -> Path:
        """A containers auth.json with this registry's credentials, as ``skopeo login`` writes it."""
        token = base64.b64encode(f"{USER}:{password}".encode()).decode()
        path = folder / "auth.json"
        path.write_text(json.dumps({"auths": {self.host: {"auth": token}}}))
        path.chmod(0o600)
        return path


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """One open registry for the session's tests (per xdist worker); do not stop it, use ``private_registry``."""
    if registry_problem():
        pytest.skip(registry_problem() or "")
    server = Registry(tmp_path_factory.mktemp("registry")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def private_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """A registry of the test's own, to stop, restart or damage."""
    if registry_problem():
        pytest.skip(registry_problem() or "")
    server = Registry(tmp_path_factory.mktemp("private-registry")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def auth_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """A registry that wants user :data:`USER` with :data:`PASSWORD` (htpasswd basic auth over plain HTTP)."""
    if registry_problem():
        pytest.skip(registry_problem() or "")
    line = htpasswd_line(USER, PASSWORD)
    if line is None:
        pytest.skip("no bcrypt here to write an htpasswd file (apt-get install apache2-utils, or Python <= 3.12)")
    server = Registry(tmp_path_factory.mktemp("auth-registry"), htpasswd=line).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def busybox_image(registry: Registry, tmp_path_factory: pytest.TempPathFactory) -> str:
    """``docker://127.0.0.1:PORT/forkd-tests/busybox:1``: the busybox-only image (see oci_images.BUSYBOX_FACTS)."""
    from oci_images import push, write_busybox_image

    written = write_busybox_image(tmp_path_factory.mktemp("busybox-image") / "layout", tag="1")
    reference = registry.reference("forkd-tests/busybox:1")
    push(written, reference)
    return reference


@pytest.fixture(scope="session")
def busybox_user_image(registry: Registry, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The busybox-only image whose config names ``User: app`` (uid 1000 in its /etc/passwd)."""
    from oci_images import push, write_busybox_image

    written = write_busybox_image(tmp_path_factory.mktemp("busybox-user-image") / "layout", tag="1", user="app")
    reference = registry.reference("forkd-tests/busybox-user:1")
    push(written, reference)
    return reference


@pytest.fixture(scope="session")
def debian_image(registry: Registry, tmp_path_factory: pytest.TempPathFactory) -> str:
    """``docker://127.0.0.1:PORT/forkd-tests/debian:1``: Debian with bash and python3 (the default image's packages)."""
    from oci_images import push, write_debian_image

    written = write_debian_image(tmp_path_factory.mktemp("debian-image") / "layout", tag="1")
    reference = registry.reference("forkd-tests/debian:1")
    push(written, reference)
    return reference
