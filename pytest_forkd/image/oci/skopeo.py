"""Running skopeo, and turning what it says on failure into one-line forkd errors.

skopeo (Debian's ``skopeo`` package) speaks the registry API v2 with token
auth, reads the credential files Docker and podman write
(``$REGISTRY_AUTH_FILE``, ``$XDG_RUNTIME_DIR/containers/auth.json``,
``~/.docker/config.json``), resolves manifest lists, reads Docker v2 and OCI
media types with gzip and zstd layers, and checks every blob against its
digest while it copies. forkd never hands it a credential: no ``--creds`` on a
command line, where ``ps`` would show it. Its error text is still scrubbed of
anything that looks like one before a forkd error quotes it.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

from ... import private
from ...errors import (
    DigestMismatch,
    ForkdError,
    ImageError,
    ImageNotFound,
    ImageToolMissing,
    RegistryAuthRequired,
    RegistryUnreachable,
)
from .store import unwritable_error

__all__ = ["classify", "last_message", "platform_of", "run", "scrub", "skopeo_binary", "start"]

#: Signature policies skopeo reads when it is given none; without one, forkd hands it its own.
POLICY_FILES = ("/etc/containers/policy.json", "~/.config/containers/policy.json")
ACCEPT_ANYTHING_POLICY = '{"default": [{"type": "insecureAcceptAnything"}]}\n'
MAX_QUOTED = 300
_PR_SET_PDEATHSIG = 1

_SECRETS = (
    (re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s:@]+:[^/\s@]+@"), r"\1***@"),  # URL user:password@
    (re.compile(r"(?i)\b(authorization:?\s*(?:basic|bearer)?\s*)[A-Za-z0-9+/=._~-]{6,}"), r"\1***"),
    (re.compile(r"(?i)\b(basic|bearer)\s+[A-Za-z0-9+/=._~-]{8,}"), r"\1 ***"),
    (
        re.compile(
            r'(?i)("?(?:password|passwd|secret|token|access_token|refresh_token|identitytoken|auth)"?\s*[=:]\s*"?)[^"\s&,}]+'
        ),
        r"\1***",
    ),
)


def skopeo_binary() -> str:
    """The skopeo program, or ImageToolMissing saying which package brings it."""
    found = shutil.which("skopeo")
    if found is None:
        raise ImageToolMissing(
            "container images are pulled with skopeo, which is not installed; install it "
            "(`apt-get install skopeo` on Debian and Ubuntu, `dnf install skopeo` on Fedora)"
        )
    return found


def scrub(text: str) -> str:
    """``text`` without anything that looks like a credential (URL passwords, tokens, auth headers)."""
    for pattern, replacement in _SECRETS:
        text = pattern.sub(replacement, text)
    return text


def last_message(stderr: str) -> str:
    """skopeo's own error in one line: the ``msg="..."`` of its last fatal log line, or its last line."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        match = re.search(r'level=(?:fatal|error) msg="(.*)"\s*$', line)
        if match:
            text = match.group(1).replace('\\"', '"')
            break
    else:
        text = lines[-1] if lines else "no message"
    text = re.sub(r'^(?:Error parsing image name|initializing source|parsing image name) "[^"]*": ', "", text)
    text = scrub(" ".join(text.split()))
    return text if len(text) <= MAX_QUOTED else text[: MAX_QUOTED - 3] + "..."


def _die_with_parent() -> None:
    """In the child: be killed when the process that started skopeo dies, so no copy outlives a killed pull."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def global_options(store: Path) -> list[str]:
    """Options before skopeo's command: a permissive signature policy only where the host has none."""
    if any(Path(os.path.expanduser(candidate)).is_file() for candidate in POLICY_FILES):
        return []
    policy = store / "policy.json"
    if not policy.is_file():
        private.make_dir(store)
        temporary = store / f".policy-{os.getpid()}.tmp"
        temporary.unlink(missing_ok=True)
        private.write_bytes(temporary, ACCEPT_ANYTHING_POLICY.encode())
        os.replace(temporary, policy)
    return ["--policy", str(policy)]


def environment(store: Path) -> dict[str, str]:
    """skopeo's environment: the caller's (credential files are found through HOME and XDG_RUNTIME_DIR),
    with temporary files (an oci-archive unpacked before it is read) under the store, not /var/tmp."""
    env = dict(os.environ)
    temporary = private.make_dir(store / "tmp")
    env["TMPDIR"] = str(temporary)
    if os.getuid() != 0 and not env.get("XDG_RUNTIME_DIR"):
        # Without XDG_RUNTIME_DIR, skopeo reads /run/containers/UID/auth.json, and fails outright when
        # /run/containers is root's (0700, once root ran podman): give it a runtime folder of this user's.
        try:
            os.stat(f"/run/containers/{os.getuid()}")
        except PermissionError:
            env["XDG_RUNTIME_DIR"] = str(private.make_dir(store / "run"))
        except OSError:
            pass
    return env


def start(arguments: Sequence[str], store: Path, stderr_file: Path) -> subprocess.Popen[bytes]:
    """Start ``skopeo ARGUMENTS`` with stderr to ``stderr_file`` and a private umask (the store is 0700/0600)."""
    command = [skopeo_binary(), *global_options(store), *arguments]
    with private.private_umask(), stderr_file.open("wb") as stderr:
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=environment(store),
            preexec_fn=_die_with_parent,  # noqa: PLW1509 - prctl only, no locks taken
        )


def run(arguments: Sequence[str], store: Path, *, timeout: float = 300) -> tuple[int, bytes, str]:
    """Run ``skopeo ARGUMENTS`` to the end: (exit status, stdout, stderr)."""
    command = [skopeo_binary(), *global_options(store), *arguments]
    try:
        with private.private_umask():
            completed = subprocess.run(
                command,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                env=environment(store),
                timeout=timeout,
                preexec_fn=_die_with_parent,  # noqa: PLW1509
            )
    except subprocess.TimeoutExpired:
        return 124, b"", f"timed out after {timeout:g} s"
    return completed.returncode, completed.stdout, completed.stderr.decode(errors="replace")


def classify(stderr: str, *, source: str, registry: str | None, store: Path) -> ForkdError:
    """The forkd error for a skopeo failure on ``source`` (a canonical reference), from its stderr."""
    message = last_message(stderr)
    lowered = message.lower()
    digest = re.search(r"expected (sha256:[a-f0-9]{64})", message) or re.search(r"(sha256:[a-f0-9]{64})", message)
    unwritable = unwritable_error(message, store, f"pulling {source}")
    if unwritable is not None:  # a full filesystem, a quota, or a read-only one
        return unwritable
    if "digest did not match" in lowered or "digest mismatch" in lowered or "does not match digest" in lowered:
        named = digest.group(1) if digest else "a blob"
        return DigestMismatch(
            f"digest mismatch pulling {source}: the content of {named} does not hash to its digest "
            "(tampered with or corrupted at the source); nothing was stored"
        )
    if registry is not None:
        if any(
            marker in lowered
            for marker in (
                "unauthorized",
                "authentication required",
                "requested access to the resource is denied",
                "invalid username/password",
                "access denied",
                "denied:",
            )
        ):
            return RegistryAuthRequired(
                f"{registry} refused {source} without valid credentials ({message}); log in with "
                f"`skopeo login {registry}`, `docker login {registry}` or `podman login {registry}` "
                "(or check the name: some registries answer this for repositories that do not exist)"
            )
        if (
            any(
                marker in lowered
                for marker in ("manifest unknown", "name unknown", "repository name not known", "not found")
            )
            and "pinging" not in lowered
        ):
            return ImageNotFound(
                f"{source}: no such repository or tag in {registry} ({message}); check the name and the tag"
            )
        if any(
            marker in lowered
            for marker in (
                "connection refused",
                "no such host",
                "i/o timeout",
                "network is unreachable",
                "no route to host",
                "pinging container registry",
                "tls:",
                "x509",
                "timeout",
                "connection reset",
                "eof",
            )
        ):
            return RegistryUnreachable(f"registry {registry} is unreachable pulling {source}: {message}")
    elif "no such file or directory" in lowered or "no descriptor found" in lowered or "not found" in lowered:
        return ImageNotFound(f"{source}: {message}; check the path and the image name")
    return ImageError(f"pulling {source} failed: {message}")


def platform_of(entry: dict[str, object]) -> str:
    """``os/architecture[/variant]`` of a manifest list entry."""
    platform = entry.get("platform")
    if not isinstance(platform, dict):
        return "unknown platform"
    parts = [str(platform.get("os", "?")), str(platform.get("architecture", "?"))]
    if platform.get("variant"):
        parts.append(str(platform["variant"]))
    return "/".join(parts)
