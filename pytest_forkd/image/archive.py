"""A Debian release read straight from a mirror: signed Release file, Packages index, .deb files.

The chain of trust is apt's: the release's ``InRelease`` (or ``Release`` with
its detached ``Release.gpg``) must carry a good signature by a key of the
Debian archive keyring (checked with ``gpgv``, or ``sqv`` where apt uses it); the verified Release lists
the sha256 of the Packages index; the index lists the sha256 of every .deb.
Nothing is used before its link in that chain has been checked, so a mirror
(or a proxy in front of it) can make a build fail, never change what goes
into an image.

Everything fetched is cached under the package cache (:func:`paths.debs_dir`):
``<sha256>.deb`` files, the verified Packages index in a compact form named by
its own checksum, and each release's signed Release file, which lets a build
run offline (with the .debs it already has) when the mirror cannot be reached.
Files are written to temporary names and renamed once complete and checked,
so an interrupted or failed download never leaves a half-written file under
its final name.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import http.client
import json
import lzma
import os
import shutil
import subprocess
import tempfile
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable, Mapping, Sequence

from filelock import FileLock
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from ..errors import ImageError
from .index import FIELDS, Package, PackageIndex
from .mirror import HOW_TO_SET, Mirror, keyring

Progress = Callable[[str], None]

ARCHITECTURE = "amd64"
COMPONENT = "main"
#: Seconds a mirror may stay silent (connecting or between two reads) before an attempt fails.
TIMEOUT = 30.0
ATTEMPTS = 3
# Index compressions in order of preference: smallest download first.
INDEX_SUFFIXES: tuple[tuple[str, Callable[[bytes], bytes]], ...] = (
    (".xz", lzma.decompress),
    (".gz", gzip.decompress),
    (".bz2", bz2.decompress),
    ("", lambda data: data),
)
INDEX_FORMAT = 1  # bump when the cached index layout changes
DOWNLOAD_THREADS = 4


class SuiteMissing(Exception):
    """An optional suite (updates, security) is not on its mirror, or its mirror does not answer."""


class NotOnMirror(Exception):
    """The mirror answered that a file does not exist (HTTP 404, or a missing file:// path)."""


class Unreachable(Exception):
    """The mirror did not answer usably (refused, timed out, reset, HTTP 5xx)."""


def _transient(exc: BaseException) -> bool:
    return isinstance(exc, Unreachable)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    if isinstance(exc, urllib.error.URLError):
        return str(exc.reason)
    return str(exc) or type(exc).__name__


def _open(url: str) -> IO[bytes]:
    """Open ``url``; NotOnMirror for a missing file, Unreachable for everything else that fails."""
    try:
        # An HTTPResponse, or an addinfourl for file: URLs.
        response: IO[bytes] = urllib.request.urlopen(url, timeout=TIMEOUT)  # noqa: S310 - URLs checked by mirror.py
        return response
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code in (404, 410):
            raise NotOnMirror(_describe(exc)) from None
        raise Unreachable(_describe(exc)) from None
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, FileNotFoundError):
            raise NotOnMirror("no such file") from None
        raise Unreachable(_describe(exc)) from None
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise Unreachable(_describe(exc)) from None


def _with_retries(action: Callable[[], object]) -> object:
    retrying = Retrying(
        retry=retry_if_exception(_transient),
        stop=stop_after_attempt(ATTEMPTS),
        wait=wait_exponential(multiplier=0.5, max=4),
        reraise=True,
    )
    return retrying(action)


def fetch_bytes(url: str) -> bytes:
    """The whole content of ``url`` (small files: Release files, indexes), retried when transient."""

    def attempt() -> bytes:
        response = _open(url)
        try:
            return response.read()
        except (OSError, http.client.HTTPException) as exc:
            raise Unreachable(_describe(exc)) from None
        finally:
            response.close()

    return _with_retries(attempt)  # type: ignore[return-value]


def fetch_file(url: str, destination: Path, size: int, sha256: str, what: str, mirror: Mirror) -> None:
    """Download ``url`` to ``destination`` through a temporary file, checking its size and sha256."""

    def attempt() -> None:
        response = _open(url)
        digest = hashlib.sha256()
        handle = tempfile.NamedTemporaryFile(dir=destination.parent, prefix=".part-", delete=False)
        try:
            with handle:
                while True:
                    try:
                        chunk = response.read(1 << 20)
                    except (OSError, http.client.HTTPException) as exc:
                        raise Unreachable(_describe(exc)) from None
                    if not chunk:
                        break
                    digest.update(chunk)
                    handle.write(chunk)
            got = os.path.getsize(handle.name)
            if got != size or digest.hexdigest() != sha256:
                raise ImageError(
                    f"{what} from {mirror.url} does not match the signed index (size {got}, sha256 "
                    f"{digest.hexdigest()[:16]}..., expected size {size}, sha256 {sha256[:16]}...): the mirror is "
                    f"corrupt or mid-update; retry later or use another mirror ({HOW_TO_SET})"
                )
            os.replace(handle.name, destination)
        finally:
            response.close()
            if os.path.exists(handle.name):
                os.unlink(handle.name)

    try:
        _with_retries(attempt)
    except NotOnMirror as exc:
        raise ImageError(
            f"{what} is listed in the release's index but missing from {mirror.url} ({exc}): the mirror is "
            f"incomplete or mid-update; retry later or use another mirror ({HOW_TO_SET})"
        ) from None
    except Unreachable as exc:
        raise _unreachable(mirror, str(exc)) from None


def _unreachable(mirror: Mirror, reason: str) -> ImageError:
    return ImageError(
        f"cannot download from the Debian mirror {mirror.url} (from {mirror.origin}): {reason}; "
        f"check the network or proxy, or use another mirror ({HOW_TO_SET})"
    )


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = tempfile.NamedTemporaryFile(dir=path.parent, prefix=".part-", delete=False)
    try:
        with handle:
            handle.write(data)
        os.replace(handle.name, path)
    finally:
        if os.path.exists(handle.name):
            os.unlink(handle.name)


# -- the signed Release file -------------------------------------------------------


@dataclass(frozen=True)
class ReleaseFile:
    """The verified Release of one suite: its identity and the checksums of its index files."""

    codename: str
    suite: str
    version: str
    date: str
    by_hash: bool
    sha256: Mapping[str, tuple[str, int]]  # path below dists/<release>/ -> (sha256, size)

    @classmethod
    def parse(cls, text: str) -> ReleaseFile:
        fields: dict[str, str] = {}
        checksums: dict[str, tuple[str, int]] = {}
        section = None
        for line in text.splitlines():
            if line[:1] in (" ", "\t"):
                if section == "SHA256":
                    parts = line.split()
                    if len(parts) == 3 and parts[1].isdigit():
                        checksums[parts[2]] = (parts[0].lower(), int(parts[1]))
                continue
            key, _, value = line.partition(":")
            section = key
            fields[key] = value.strip()
        return cls(
            codename=fields.get("Codename", ""),
            suite=fields.get("Suite", ""),
            version=fields.get("Version", ""),
            date=fields.get("Date", ""),
            by_hash=fields.get("Acquire-By-Hash", "").lower() == "yes",
            sha256=checksums,
        )


class BadSignature(Exception):
    """The verifier rejected the release file; the message is the verifier's own complaint."""


def verify_signature(signed: Path, *, detached: Path | None, keyring_path: Path) -> str:
    """The signed text of a release file after checking its signature against ``keyring_path``.

    gpgv is used where installed (Debian 12, Ubuntu), else sqv (Sequoia's
    verifier, which apt uses on Debian 13 instead of gpgv). BadSignature
    carries the verifier's complaint; a missing verifier is an ImageError.
    """
    output = signed.with_name(signed.name + ".verified")
    if (binary := shutil.which("gpgv")) is not None:
        command = [binary, "--quiet", "--keyring", str(keyring_path)]
        command += [str(detached), str(signed)] if detached else ["--output", str(output), str(signed)]
    elif (binary := shutil.which("sqv")) is not None:
        command = [binary, "--keyring", str(keyring_path)]
        command += (
            ["--signature-file", str(detached), str(signed)]
            if detached
            else ["--output", str(output), "--cleartext", str(signed)]
        )
    else:
        raise ImageError(
            "neither gpgv nor sqv is installed, and one is needed to check the Debian release's signature: "
            "install gpgv (apt-get install gpgv; other distributions ship it with GnuPG)"
        )
    completed = subprocess.run(command, capture_output=True, text=True, check=False)
    if completed.returncode != 0:
        lines = [line.removeprefix("gpgv: ") for line in completed.stderr.splitlines() if line.strip()]
        reason = next(
            (line for line in lines if "BAD" in line or "public key" in line or "no valid" in line.lower()),
            lines[-1] if lines else f"exit status {completed.returncode}",
        )
        raise BadSignature(f"{Path(binary).name}: {reason.strip()}")
    return (signed if detached else output).read_text(encoding="utf-8", errors="replace")


class Release:
    """One Debian release (``bookworm``) on one mirror, read and verified on demand."""

    def __init__(
        self,
        mirror: Mirror,
        name: str,
        cache: Path,
        progress: Progress,
        *,
        keyring_path: Path | None = None,
        architecture: str = ARCHITECTURE,
        component: str = COMPONENT,
        optional: bool = False,
    ) -> None:
        self.mirror = mirror
        self.name = name
        self.cache = cache
        self.progress = progress
        self.keyring_path = keyring_path
        self.architecture = architecture
        self.component = component
        self.optional = optional  # a missing or unreachable suite raises SuiteMissing rather than failing the build
        mirror_id = hashlib.sha256(mirror.url.encode()).hexdigest()[:12]
        self.release_dir = cache / "dists" / mirror_id / name
        self.release_file: ReleaseFile | None = None

    @property
    def where(self) -> str:
        return f"Debian {self.name} ({self.component}, {self.architecture}) on {self.mirror.url}"

    def dists_url(self, path: str) -> str:
        return f"{self.mirror.url}/dists/{self.name}/{path}"

    # -- Release ---------------------------------------------------------------
    def verified_release(self) -> ReleaseFile:
        """Fetch (or, offline, reuse) the release's signed Release file and check its signature."""
        if self.release_file is not None:
            return self.release_file
        keyring_path = self.keyring_path or keyring()
        self.cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.cache, prefix=".release-") as scratch:
            work = Path(scratch)
            try:
                fetched = self._fetch_signed(work)
            except Unreachable as exc:
                cached = self.release_dir / "InRelease"
                if not cached.is_file():
                    if self.optional:
                        raise SuiteMissing(f"{self.mirror.url} does not answer ({exc})") from None
                    raise _unreachable(self.mirror, str(exc)) from None
                self.progress(f"mirror unreachable ({exc}); using the {self.name} release file fetched before")
                shutil.copyfile(cached, work / "InRelease")
                fetched = (work / "InRelease", None)
            signed, detached = fetched
            try:
                text = verify_signature(signed, detached=detached, keyring_path=keyring_path)
            except BadSignature as exc:
                raise ImageError(
                    f"the {self.name} release file from {self.mirror.url} is not signed by a key of {keyring_path}: "
                    f"{exc}; the mirror serves altered or foreign files: use another mirror ({HOW_TO_SET}), or "
                    f"update debian-archive-keyring if the release is newer than the keyring"
                ) from None
            release = ReleaseFile.parse(text)
            if self.name not in (release.codename, release.suite):
                raise ImageError(
                    f"{self.dists_url('InRelease')} is signed but describes release {release.codename or '?'} "
                    f"(suite {release.suite or '?'}), not {self.name}: the mirror is misconfigured; use another "
                    f"mirror ({HOW_TO_SET})"
                )
            if detached is None:
                _write_atomically(self.release_dir / "InRelease", signed.read_bytes())
        self.release_file = release
        return release

    def _fetch_signed(self, work: Path) -> tuple[Path, Path | None]:
        """Download InRelease, or Release + Release.gpg when the mirror has no InRelease."""
        try:
            (work / "InRelease").write_bytes(fetch_bytes(self.dists_url("InRelease")))
            return work / "InRelease", None
        except NotOnMirror:
            pass
        try:
            (work / "Release").write_bytes(fetch_bytes(self.dists_url("Release")))
            (work / "Release.gpg").write_bytes(fetch_bytes(self.dists_url("Release.gpg")))
        except NotOnMirror:
            if self.optional:
                raise SuiteMissing(f"{self.mirror.url} has no dists/{self.name}") from None
            raise ImageError(
                f"the Debian mirror {self.mirror.url} (from {self.mirror.origin}) has no release {self.name!r} "
                f"(no dists/{self.name}/InRelease or Release): name an existing Debian release in the recipe's "
                f"`release:` field (such as bookworm or trixie), or use a mirror that carries it"
            ) from None
        return work / "Release", work / "Release.gpg"

    # -- Packages --------------------------------------------------------------
    def index(self) -> PackageIndex:
        """The release's Packages index for its architecture, verified against the Release file."""
        release = self.verified_release()
        base = f"{self.component}/binary-{self.architecture}/Packages"
        listed = [(suffix, decompress) for suffix, decompress in INDEX_SUFFIXES if base + suffix in release.sha256]
        if not listed:
            if self.optional:
                raise SuiteMissing(f"its release file lists no {base} index")
            raise ImageError(
                f"the {self.name} release on {self.mirror.url} lists no {base} index: this release has no "
                f"{self.component} component for {self.architecture}; use an amd64 Debian release such as bookworm"
            )
        suffix, decompress = listed[0]
        sha256, size = release.sha256[base + suffix]
        cached = self.cache / "indexes" / f"{sha256}.json"
        if cached.is_file():
            try:
                return _load_index(cached, self.where)
            except (ValueError, KeyError, TypeError):
                cached.unlink(missing_ok=True)  # unreadable (older format): fetch again
        self.progress(f"downloading the {self.name} package index ({size / 1e6:.1f} MB) from {self.mirror.url}")
        raw = self._fetch_index(base + suffix, sha256, size)
        try:
            text = decompress(raw).decode("utf-8", errors="replace")
        except (OSError, ValueError, EOFError, lzma.LZMAError) as exc:
            raise ImageError(
                f"{base}{suffix} from {self.mirror.url} does not decompress ({exc}); use another mirror ({HOW_TO_SET})"
            ) from None
        index = PackageIndex.parse(text, self.where)
        _write_atomically(cached, _dump_index(index))
        return index

    def _fetch_index(self, path: str, sha256: str, size: int) -> bytes:
        urls = [self.dists_url(path)]
        if self.release_file is not None and self.release_file.by_hash:
            directory = path.rsplit("/", 1)[0]
            urls.insert(0, self.dists_url(f"{directory}/by-hash/SHA256/{sha256}"))
        problem = ""
        for url in urls:
            try:
                data = fetch_bytes(url)
            except NotOnMirror as exc:
                problem = f"{url}: {exc}"
                continue
            except Unreachable as exc:
                raise _unreachable(self.mirror, str(exc)) from None
            digest = hashlib.sha256(data).hexdigest()
            if len(data) != size or digest != sha256:
                raise ImageError(
                    f"{path} from {self.mirror.url} does not match the checksum in the signed {self.name} release "
                    f"file (size {len(data)}, sha256 {digest[:16]}..., expected size {size}, sha256 {sha256[:16]}...): "
                    f"the mirror is corrupt or mid-update; retry later or use another mirror ({HOW_TO_SET})"
                )
            return data
        raise ImageError(
            f"the {self.name} release on {self.mirror.url} lists {path} but the mirror does not have it ({problem}); "
            f"retry later or use another mirror ({HOW_TO_SET})"
        )

    # -- .deb files ------------------------------------------------------------
    def download(self, packages: Sequence[Package]) -> dict[str, Path]:
        """Make sure each package's .deb is cached (by sha256); return name -> .deb path."""
        return download(packages, self.cache, self.progress, lambda package: self.mirror)


def download(
    packages: Sequence[Package], cache: Path, progress: Progress, mirror_of: Callable[[Package], Mirror]
) -> dict[str, Path]:
    """Make sure each package's .deb is cached (by sha256), fetched from ``mirror_of(package)``."""
    cache.mkdir(parents=True, exist_ok=True)
    paths = {package.name: cache / f"{package.sha256}.deb" for package in packages}
    with FileLock(cache / ".download.lock"):
        missing = [package for package in packages if not paths[package.name].is_file()]
        if not missing:
            progress(f"all {len(packages)} packages already downloaded in {cache}")
            return paths
        megabytes = sum(package.size for package in missing) / 1e6
        mirrors = sorted({mirror_of(package).url for package in missing})
        progress(f"downloading {len(missing)} packages ({megabytes:.1f} MB) from {', '.join(mirrors)}")
        with ThreadPoolExecutor(max_workers=DOWNLOAD_THREADS) as pool:
            futures = [
                pool.submit(
                    fetch_file,
                    f"{mirror_of(package).url}/{package.filename}",
                    paths[package.name],
                    package.size,
                    package.sha256,
                    package.filename.rsplit("/", 1)[-1],
                    mirror_of(package),
                )
                for package in missing
            ]
            for future in futures:
                future.result()
    return paths


def _dump_index(index: PackageIndex) -> bytes:
    rows = [
        [p.name, p.version, p.architecture, p.depends, p.provides, p.filename, p.size, p.sha256]
        for p in index.packages.values()
    ]
    return json.dumps({"format": INDEX_FORMAT, "fields": list(FIELDS), "packages": rows}).encode()


def _load_index(path: Path, where: str) -> PackageIndex:
    document = json.loads(path.read_bytes())
    if document["format"] != INDEX_FORMAT:
        raise ValueError("old index format")
    return PackageIndex((Package(*row) for row in document["packages"]), where)
