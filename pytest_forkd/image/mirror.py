"""Which Debian mirror the image builder downloads from.

In order: the ``FORKD_DEBIAN_MIRROR`` environment variable; the
``debian_mirror`` key of forkd.yaml's ``settings:`` section (the pytest
plugin and ``forkd image build`` pass it in); the first Debian archive in
the host's own apt sources (``/etc/apt/sources.list`` and the deb822
``/etc/apt/sources.list.d/*.sources``, plus one-line ``*.list`` files), so
that a Debian or Ubuntu-with-Debian-sources host needs no setting at all.
A host without any of these gets an error saying how to set one.

No mirror is built in: which mirror is reachable and fast differs from
network to network, and a hard-coded host name would be wrong for many
users (and for machines that may reach only a local proxy).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from ..errors import ImageError

MIRROR_ENV = "FORKD_DEBIAN_MIRROR"
SECURITY_MIRROR_ENV = "FORKD_DEBIAN_SECURITY_MIRROR"
KEYRING_ENV = "FORKD_DEBIAN_KEYRING"
# debian-archive-keyring's file; Debian 13 names it .pgp and keeps .gpg as a link.
DEFAULT_KEYRINGS = (
    Path("/usr/share/keyrings/debian-archive-keyring.gpg"),
    Path("/usr/share/keyrings/debian-archive-keyring.pgp"),
)
PROJECT_KEY = "settings.debian_mirror"
SCHEMES = ("http://", "https://", "file://")
# Suites of a Debian archive proper: a codename or stable/testing/unstable, not
# bookworm-security or bookworm-updates (other archives or partial suites).
ARCHIVE_SUITE = re.compile(r"^[a-z]+$")
HOW_TO_SET = (
    f"set {MIRROR_ENV}=<URL of a Debian archive, the directory holding dists/ and pool/> "
    "or `debian_mirror: <URL>` under `settings:` in forkd.yaml"
)


@dataclass(frozen=True)
class Mirror:
    """A Debian archive's base URL and where that choice came from (for messages)."""

    url: str
    origin: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", self.url.rstrip("/"))


_project_mirror: Mirror | None = None


def use_project_mirror(url: str | None, origin: str = f"forkd.yaml {PROJECT_KEY}") -> None:
    """Record forkd.yaml's mirror for this process (None forgets it); the environment still wins."""
    global _project_mirror
    _project_mirror = Mirror(check_url(url, origin), origin) if url else None


def check_url(url: str, origin: str) -> str:
    """``url`` when it is an http(s) or file URL, else an ImageError naming ``origin``."""
    if not url.startswith(SCHEMES):
        raise ImageError(
            f"{origin}: {url!r} is not a mirror URL; give an http://, https:// or file:// URL "
            "of a Debian archive (the directory holding dists/ and pool/)"
        )
    return url


def find_mirror(explicit: str | None = None, *, apt_root: Path = Path("/")) -> Mirror:
    """The mirror to use: ``explicit`` (a command-line option), the environment, forkd.yaml, apt's sources."""
    if explicit:
        return Mirror(check_url(explicit, "--mirror"), "--mirror")
    from_env = os.environ.get(MIRROR_ENV, "").strip()
    if from_env:
        return Mirror(check_url(from_env, MIRROR_ENV), MIRROR_ENV)
    if _project_mirror is not None:
        return _project_mirror
    found = host_apt_mirror(apt_root)
    if found is not None:
        return found
    raise ImageError(f"no Debian mirror is configured and the host has no Debian apt sources; {HOW_TO_SET}")


def find_security_mirror(main: Mirror, *, apt_root: Path = Path("/")) -> Mirror | None:
    """Where the release's security updates come from, or None when they are turned off.

    ``$FORKD_DEBIAN_SECURITY_MIRROR`` (``none`` turns them off), else the
    host's apt source for a ``*-security`` suite, else the archive next to
    the main one (``.../debian`` -> ``.../debian-security``, the layout of
    Debian's own mirror network). The builder skips the suite, saying so,
    when that archive does not have it.
    """
    configured = os.environ.get(SECURITY_MIRROR_ENV, "").strip()
    if configured.lower() == "none":
        return None
    if configured:
        return Mirror(check_url(configured, SECURITY_MIRROR_ENV), SECURITY_MIRROR_ENV)
    for uri, suites, path in _apt_entries(apt_root):
        if uri.startswith(("http://", "https://")) and any(suite.endswith("-security") for suite in suites):
            return Mirror(uri, f"the host's apt sources ({path})")
    if urlparse(main.url).path.strip("/"):
        return Mirror(main.url + "-security", f"next to {main.url}")
    return None


def host_apt_mirror(apt_root: Path = Path("/")) -> Mirror | None:
    """The first Debian archive named by the host's apt sources, or None."""
    for uri, suites, path in _apt_entries(apt_root):
        if uri.startswith(("http://", "https://")) and any(ARCHIVE_SUITE.match(suite) for suite in suites):
            return Mirror(uri, f"the host's apt sources ({path})")
    return None


def _apt_entries(apt_root: Path) -> list[tuple[str, list[str], Path]]:
    """(URI, suites, file) of every ``deb`` entry in the host's apt sources, in apt's order."""
    directory = apt_root / "etc/apt"
    files = [directory / "sources.list"]
    parts = directory / "sources.list.d"
    if parts.is_dir():
        files += sorted(path for path in parts.iterdir() if path.suffix in (".list", ".sources"))
    found = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        entries = _deb822_entries(text) if path.suffix == ".sources" else _one_line_entries(text)
        found += [(uri, suites, path) for uri, suites in entries]
    return found


def _one_line_entries(text: str) -> list[tuple[str, list[str]]]:
    """``deb [options] URI suite component...`` lines."""
    entries = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line.startswith("deb "):
            continue
        line = re.sub(r"\[[^]]*\]", " ", line)
        fields = line.split()
        if len(fields) >= 3:
            entries.append((fields[1], [fields[2]]))
    return entries


def _deb822_entries(text: str) -> list[tuple[str, list[str]]]:
    """Stanzas with ``Types: deb``, ``URIs:`` and ``Suites:`` (``Enabled: no`` ones skipped)."""
    entries = []
    for block in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        key = None
        for line in block.splitlines():
            if line.startswith("#"):
                continue
            if line[:1] in (" ", "\t") and key is not None:
                fields[key] += " " + line.strip()
                continue
            key, _, value = line.partition(":")
            key = key.strip().lower()
            fields[key] = value.strip()
        if "deb" not in fields.get("types", "").split() or fields.get("enabled", "yes").lower() == "no":
            continue
        suites = fields.get("suites", "").split()
        entries += [(uri, suites) for uri in fields.get("uris", "").split()]
    return entries


def keyring() -> Path:
    """The keyring that signs the Debian archive: ``$FORKD_DEBIAN_KEYRING`` or debian-archive-keyring's."""
    configured = os.environ.get(KEYRING_ENV, "").strip()
    if configured:
        path = Path(configured)
    else:
        path = next((candidate for candidate in DEFAULT_KEYRINGS if candidate.is_file()), DEFAULT_KEYRINGS[0])
    if not path.is_file():
        source = KEYRING_ENV if configured else "the debian-archive-keyring package"
        raise ImageError(
            f"no Debian archive keyring at {path} (from {source}): install debian-archive-keyring "
            f"(apt-get install debian-archive-keyring) or set {KEYRING_ENV} to a keyring file that signs the mirror"
        )
    return path
