"""A tiny Debian archive for tests: .deb files, a Packages index, a Release file signed with a throwaway key.

It is served over HTTP on 127.0.0.1 by :class:`ArchiveServer`, so the image
builder's mirror client, signature check and hash chain run exactly as
against a real mirror, without the network.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import lzma
import os
import shutil
import subprocess
import tarfile
import threading
from dataclasses import dataclass, field
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def ar_archive(members: list[tuple[str, bytes]]) -> bytes:
    """An ar archive (the .deb container) holding ``members`` in order."""
    out = bytearray(b"!<arch>\n")
    for name, data in members:
        header = f"{name:<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(data):<10}".encode() + b"`\n"
        out += header + data + (b"\n" if len(data) % 2 else b"")
    return bytes(out)


def tar_bytes(files: dict[str, bytes | str], *, symlinks: dict[str, str] | None = None) -> bytes:
    """An uncompressed tar of ``files`` (path -> content; a trailing '/' makes a directory) and symlinks."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for path, content in files.items():
            info = tarfile.TarInfo("./" + path.strip("/"))
            if path.endswith("/"):
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                archive.addfile(info)
                continue
            data = content.encode() if isinstance(content, str) else content
            info.size, info.mode = len(data), 0o755 if "/bin/" in path else 0o644
            archive.addfile(info, io.BytesIO(data))
        for path, target in (symlinks or {}).items():
            info = tarfile.TarInfo("./" + path.strip("/"))
            info.type, info.linkname = tarfile.SYMTYPE, target
            archive.addfile(info)
    return buffer.getvalue()


def make_deb(
    files: dict[str, bytes | str], *, compression: str = "xz", symlinks: dict[str, str] | None = None
) -> bytes:
    """A .deb whose data.tar holds ``files``, compressed with xz, gz, zst or nothing."""
    data = tar_bytes(files, symlinks=symlinks)
    if compression == "xz":
        data = lzma.compress(data)
    elif compression == "gz":
        data = gzip.compress(data)
    elif compression == "zst":
        data = subprocess.run(["zstd", "-q", "-c"], input=data, capture_output=True, check=True).stdout
    suffix = f".{compression}" if compression else ""
    control = gzip.compress(tar_bytes({"control": "Package: x\n"}))
    return ar_archive([("debian-binary", b"2.0\n"), ("control.tar.gz", control), (f"data.tar{suffix}", data)])


@dataclass
class FakePackage:
    name: str
    version: str = "1.0-1"
    depends: str = ""
    pre_depends: str = ""
    provides: str = ""
    architecture: str = "amd64"
    files: dict[str, bytes | str] = field(default_factory=dict)


class GnuPG:
    """A throwaway GnuPG home with one signing key; its agent is stopped by :meth:`close`."""

    def __init__(self, home: Path, name: str = "Fake Archive Key") -> None:
        self.home = home
        home.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.run("--quick-generate-key", "--passphrase", "", f"{name} <archive@invalid>", "ed25519", "sign", "never")

    def run(self, *args: str, input: bytes | None = None) -> bytes:
        completed = subprocess.run(
            ["gpg", "--homedir", str(self.home), "--batch", "--quiet", "--pinentry-mode", "loopback", *args],
            input=input,
            capture_output=True,
            check=True,
        )
        return completed.stdout

    def export_keyring(self, path: Path) -> Path:
        path.write_bytes(self.run("--export"))
        return path

    def clearsign(self, text: bytes) -> bytes:
        return self.run("--passphrase", "", "--clearsign", "--digest-algo", "SHA256", input=text)

    def detach_sign(self, text: bytes) -> bytes:
        return self.run("--passphrase", "", "--detach-sign", "--digest-algo", "SHA256", input=text)

    def close(self) -> None:
        subprocess.run(["gpgconf", "--homedir", str(self.home), "--kill", "all"], capture_output=True, check=False)


class FakeArchive:
    """An archive tree on disk: ``pool/`` with .debs, ``dists/<release>/`` with signed Release and Packages."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def publish(
        self,
        release: str,
        packages: list[FakePackage],
        signer: GnuPG,
        *,
        codename: str | None = None,
        in_release: bool = True,
        compression: str = "xz",
    ) -> None:
        stanzas = []
        for package in packages:
            deb = make_deb(package.files)
            relative = f"pool/main/{package.name[0]}/{package.name}/{package.name}_{package.version}_{package.architecture}.deb"
            (self.root / relative).parent.mkdir(parents=True, exist_ok=True)
            (self.root / relative).write_bytes(deb)
            lines = [
                f"Package: {package.name}",
                f"Version: {package.version}",
                f"Architecture: {package.architecture}",
                "Maintainer: Nobody <nobody@invalid>",
            ]
            if package.pre_depends:
                lines.append(f"Pre-Depends: {package.pre_depends}")
            if package.depends:
                lines.append(f"Depends: {package.depends}")
            if package.provides:
                lines.append(f"Provides: {package.provides}")
            lines += [
                f"Filename: {relative}",
                f"Size: {len(deb)}",
                f"SHA256: {hashlib.sha256(deb).hexdigest()}",
                "Description: test package",
                " with a continuation line: Depends: not-a-field",
            ]
            stanzas.append("\n".join(lines) + "\n")
        text = "\n".join(stanzas).encode()
        dists = self.root / "dists" / release
        index_dir = dists / "main" / "binary-amd64"
        index_dir.mkdir(parents=True, exist_ok=True)
        indexes = {"main/binary-amd64/Packages": text}
        if compression == "xz":
            indexes["main/binary-amd64/Packages.xz"] = lzma.compress(text)
        indexes["main/binary-amd64/Packages.gz"] = gzip.compress(text)
        for path, data in indexes.items():
            (dists / path).write_bytes(data)
        release_text = (
            f"Origin: Fake\nSuite: stable\nCodename: {codename or release}\nVersion: 99.1\n"
            "Date: Thu, 01 Jan 2026 00:00:00 UTC\nArchitectures: amd64\nComponents: main\nSHA256:\n"
            + "".join(f" {hashlib.sha256(data).hexdigest()} {len(data):>8} {path}\n" for path, data in indexes.items())
        ).encode()
        for name in ("InRelease", "Release", "Release.gpg"):
            (dists / name).unlink(missing_ok=True)
        if in_release:
            (dists / "InRelease").write_bytes(signer.clearsign(release_text))
        else:
            (dists / "Release").write_bytes(release_text)
            (dists / "Release.gpg").write_bytes(signer.detach_sign(release_text))

    def path_of(self, package: str) -> Path:
        return next(self.root.glob(f"pool/main/*/{package}/*.deb"))


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


class ArchiveServer:
    """Serves a directory over HTTP on 127.0.0.1; counts requests so tests can tell what was fetched."""

    def __init__(self, directory: Path) -> None:
        self.requests: list[str] = []
        server = self

        class Handler(_QuietHandler):
            def do_GET(self) -> None:
                server.requests.append(self.path)
                super().do_GET()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=str(directory)))
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


def gpg_available() -> bool:
    return all(shutil.which(tool) for tool in ("gpg", "gpgv", "gpgconf")) and os.name == "posix"
