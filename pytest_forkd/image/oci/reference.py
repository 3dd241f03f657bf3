"""Container image references: the transport names of the container tools, read as Docker reads them.

``docker://NAME[:TAG][@DIGEST]`` names an image in a registry; a bare name
(what framework configs and ``--forkd-image`` hand over) means the same.
Names are normalised as Docker normalises them, so that one image has one
canonical text to cache it under: ``python:3.12-slim`` is
``docker.io/library/python:3.12-slim``; a first component with a ``.`` or a
``:``, or equal to ``localhost``, is a registry (``127.0.0.1:5000/x``,
``ghcr.io/o/x``), anything else is a Docker Hub repository; ``latest`` is the
tag when neither a tag nor a digest is given.

The local transports keep skopeo's spelling: ``oci:DIR[:TAG]`` (an OCI image
layout), ``oci-archive:FILE[:TAG]`` (one as a tar), ``docker-archive:FILE``
(what ``docker save`` writes) and ``dockerfile:PATH`` (built on this host).
Their paths are made absolute when parsed: the canonical text of a reference
must mean the same from any working directory.

References come from configs and command lines, so hostile text (control
characters, absurd lengths, malformed digests) is refused here, with one line
that says what is wrong and shows the accepted forms. A transport forkd does
not know (``dokcer://x``, ``ocii:./dir``) is named as such, with the known
ones, rather than read as a malformed Docker name.

:func:`names_container_image` tells a container reference from a forkd image
name where both may be given (``forkd exec --image``): a transport, or any of
``/ : . @`` (which no image name holds), means a reference read as Docker
reads it; a plain word is an image name.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ...errors import InvalidArgument, did_you_mean

__all__ = ["TRANSPORTS", "ImageReference", "is_reference", "names_container_image", "parse_reference"]

TRANSPORTS = ("docker", "oci", "oci-archive", "docker-archive", "dockerfile")
#: The prefix each transport is written with, longest first so ``oci-archive:`` is not read as ``oci:``.
PREFIXES = (
    ("oci-archive:", "oci-archive"),
    ("docker-archive:", "docker-archive"),
    ("dockerfile:", "dockerfile"),
    ("docker://", "docker"),
    ("oci:", "oci"),
)
ACCEPTED_FORMS = (
    "NAME[:TAG][@sha256:DIGEST] (Docker Hub or REGISTRY/NAME), docker://NAME..., "
    "oci:DIR[:TAG], oci-archive:FILE[:TAG], docker-archive:FILE or dockerfile:PATH"
)
DEFAULT_REGISTRY = "docker.io"
DEFAULT_TAG = "latest"
#: Docker's limit on the registry/repository part of a name.
MAX_NAME_LENGTH = 255
#: Longer references are refused outright (a path on Linux is at most 4096 bytes).
MAX_REFERENCE_LENGTH = 4096

# The grammar of github.com/distribution/reference (regexp.go), which Docker and skopeo use.
_ALPHANUMERIC = r"[a-z0-9]+"
_SEPARATOR = r"(?:[._]|__|[-]+)"
_PATH_COMPONENT = re.compile(rf"{_ALPHANUMERIC}(?:{_SEPARATOR}{_ALPHANUMERIC})*")
_DOMAIN_LABEL = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = re.compile(rf"(?:{_DOMAIN_LABEL}(?:\.{_DOMAIN_LABEL})*|\[[a-fA-F0-9:]+\])(?::[0-9]{{1,5}})?")
_TAG = re.compile(r"[\w][\w.-]{0,127}")
_DIGEST = re.compile(r"sha256:[a-f0-9]{64}")
# An OCI layout's image name (org.opencontainers.image.ref.name), as containers/image accepts it.
_OCI_REF_NAME = re.compile(
    r"[A-Za-z0-9]+(?:(?:[-._:@+]|--)[A-Za-z0-9]+)*(?:/[A-Za-z0-9]+(?:(?:[-._:@+]|--)[A-Za-z0-9]+)*)*"
)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# What reads as a transport: a word, a colon, then a path or ``//`` (a Docker name never has a tag starting so).
_TRANSPORT_LIKE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):(?=/|~|\.)")
#: URL schemes: a registry named as a URL gets its own advice (see _parse_docker).
_URL_SCHEMES = ("http", "https")


@dataclass(frozen=True)
class ImageReference:
    """One parsed image reference; ``str()`` gives its canonical text, the key it is cached under."""

    transport: str  # one of TRANSPORTS
    # docker: "docker.io/library/python"; oci: a folder; oci-archive/docker-archive: a file; dockerfile: the Dockerfile
    location: str
    tag: str | None = None  # docker tag ("latest" when neither tag nor digest is given), oci/oci-archive image name
    digest: str | None = None  # docker "sha256:<hex>" pin

    def __str__(self) -> str:
        if self.transport == "docker":
            text = f"docker://{self.location}"
            if self.tag:
                text += f":{self.tag}"
            if self.digest:
                text += f"@{self.digest}"
            return text
        if self.tag:
            return f"{self.transport}:{self.location}:{self.tag}"
        if self.digest:  # dockerfile:PATH@sha256:KEY, one build of PATH (KEY: what it was built from)
            return f"{self.transport}:{self.location}@{self.digest}"
        return f"{self.transport}:{self.location}"

    @property
    def registry(self) -> str | None:
        """The registry host (and port) of a docker reference: ``docker.io``, ``127.0.0.1:5000``; None otherwise."""
        if self.transport != "docker":
            return None
        return self.location.split("/", 1)[0]

    @property
    def repository(self) -> str | None:
        """The repository of a docker reference without its registry (``library/python``); None otherwise."""
        if self.transport != "docker":
            return None
        return self.location.split("/", 1)[1]

    @property
    def is_local(self) -> bool:
        """True for the transports that read files on this host (everything but docker://)."""
        return self.transport != "docker"


def is_reference(text: str) -> bool:
    """True when ``text`` starts with a transport prefix (``docker://``, ``oci:``...).

    Bare names such as ``default`` or ``base`` are forkd image and snapshot
    names, not references, even though :func:`parse_reference` would read
    them as Docker Hub names.
    """
    return isinstance(text, str) and any(text.startswith(prefix) for prefix, _ in PREFIXES)


def names_container_image(text: str) -> bool:
    """True when ``text`` is a container reference rather than a forkd image name (``default``, ``tools``).

    A transport prefix says so (:func:`is_reference`), and so does any of
    ``/ : . @`` or ``://``: forkd image names hold none of them, and the bare
    references of ``--forkd-image`` and compose files (``127.0.0.1:5000/x:1``,
    ``python:3.12``) always hold one. A plain word (``busybox``) stays an image
    name; Docker Hub's image of that name is ``busybox:latest`` or ``docker://busybox``.
    """
    return isinstance(text, str) and (is_reference(text) or any(mark in text for mark in "/:.@"))


def parse_reference(text: str, *, bare: str | None = "docker") -> ImageReference:
    """Parse an image reference, raising InvalidArgument (one line) when it is malformed.

    ``bare="docker"``: a reference without a transport means ``docker://``
    (``python:3.12-slim``). ``bare=None``: a transport is required.
    """
    if not isinstance(text, str):
        raise InvalidArgument(f"an image reference must be text, not {type(text).__name__}; use {ACCEPTED_FORMS}")
    if not text.strip():
        raise InvalidArgument(f"the image reference is empty; use {ACCEPTED_FORMS}")
    if len(text) > MAX_REFERENCE_LENGTH:
        raise InvalidArgument(
            f"the image reference {_shown(text)} is {len(text)} characters long (at most {MAX_REFERENCE_LENGTH})"
        )
    control = _CONTROL.search(text)
    if control:
        raise InvalidArgument(
            f"the image reference {_shown(text)} contains the control character {control.group()!r}; "
            f"use {ACCEPTED_FORMS}"
        )
    for prefix, transport in PREFIXES:
        if text.startswith(prefix):
            rest = text[len(prefix) :]
            if transport == "docker":
                return _parse_docker(rest, text)
            return _parse_local(transport, rest, text)
    _refuse_unknown_transport(text)
    if bare is None:
        raise InvalidArgument(f"{_shown(text)} names no transport; use {ACCEPTED_FORMS}")
    if bare != "docker":
        raise ValueError(f"bare must be 'docker' or None, not {bare!r}")
    return _parse_docker(text, text)


def _refuse_unknown_transport(text: str) -> None:
    """InvalidArgument naming the transport when ``text`` starts like one forkd does not know (``dokcer://x``)."""
    match = _TRANSPORT_LIKE.match(text)
    if match is None or match.group(1).lower() in _URL_SCHEMES:
        return
    word = match.group(1)
    prefixes = {transport: prefix for prefix, transport in PREFIXES}
    if word in prefixes:  # a known transport wrongly joined (docker:/x); oci:/x was parsed before
        hint = f"write {prefixes[word]}..."
    else:
        hint = did_you_mean(word, TRANSPORTS).rstrip() or "check the spelling"
    raise InvalidArgument(
        f"unknown transport {word!r} in the image reference {_shown(text)} ({hint}); the transports are "
        f"{', '.join(prefixes[transport] for transport in TRANSPORTS)}, and a reference without one "
        "(NAME[:TAG], REGISTRY/NAME[:TAG]) means docker://"
    )


def _shown(text: str) -> str:
    """``text`` quoted for an error message: repr (so control characters show), cut when long."""
    return repr(text if len(text) <= 120 else text[:100] + "...")


def _fail(text: str, problem: str) -> InvalidArgument:
    return InvalidArgument(f"invalid image reference {_shown(text)}: {problem}; use {ACCEPTED_FORMS}")


def _parse_docker(rest: str, text: str) -> ImageReference:
    if not rest:
        raise _fail(text, "no image name")
    if any(character.isspace() for character in rest):
        raise _fail(text, "it contains white space")
    if "://" in rest:
        raise _fail(text, "a registry is named without a URL scheme: write docker://REGISTRY/NAME")
    name, at, digest = rest.partition("@")
    if at:
        if not _DIGEST.fullmatch(digest):
            raise _fail(text, f"the digest {digest[:80]!r} is not sha256: followed by 64 lowercase hex digits")
    # A tag follows the last ':' after the last '/', so that a registry port is not read as one.
    slash = name.rfind("/")
    colon = name.rfind(":")
    tag: str | None = None
    if colon > slash:
        name, tag = name[:colon], name[colon + 1 :]
        if not _TAG.fullmatch(tag):
            raise _fail(text, f"the tag {tag[:80]!r} is not 1-128 of A-Z a-z 0-9 _ . - (not starting with . or -)")
    if not name:
        raise _fail(text, "no image name")
    first, slash_found, remainder = name.partition("/")
    if slash_found and ("." in first or ":" in first or first == "localhost"):
        registry, path = first, remainder
        if not _DOMAIN.fullmatch(registry):
            raise _fail(text, f"{registry!r} is not a registry host[:port]")
    else:
        registry, path = DEFAULT_REGISTRY, name
    if registry == "index.docker.io":
        registry = DEFAULT_REGISTRY
    if registry == DEFAULT_REGISTRY and "/" not in path:
        path = f"library/{path}"
    for component in path.split("/"):
        if not _PATH_COMPONENT.fullmatch(component):
            problem = (
                "repository names must be lowercase"
                if component.lower() != component and _PATH_COMPONENT.fullmatch(component.lower())
                else f"{component[:80]!r} is not a repository name component (a-z 0-9 separated by . _ __ -)"
            )
            raise _fail(text, problem)
    location = f"{registry}/{path}"
    if len(location) > MAX_NAME_LENGTH:
        raise _fail(text, f"the name is {len(location)} characters long (at most {MAX_NAME_LENGTH})")
    if tag is None and not at:
        tag = DEFAULT_TAG
    return ImageReference("docker", location, tag=tag, digest=digest if at else None)


def _parse_local(transport: str, rest: str, text: str) -> ImageReference:
    if not rest:
        raise _fail(text, f"{transport}: needs a path")
    path, colon, tag = rest, "", ""
    build: str | None = None
    if transport == "dockerfile" and _DIGEST.fullmatch(rest.rpartition("@")[2]):
        path, _at, build = rest.rpartition("@")  # a build of the Dockerfile, keyed by its inputs (builders.py)
    if transport in ("oci", "oci-archive"):
        path, colon, tag = rest.partition(":")
        if colon and not _OCI_REF_NAME.fullmatch(tag):
            raise _fail(text, f"the image name {tag[:80]!r} after the path is not a valid OCI image name")
    elif ":" in path:
        raise _fail(text, f"a {transport}: path cannot contain ':' (skopeo reads what follows as an image name)")
    if not path:
        raise _fail(text, f"{transport}: needs a path")
    if transport == "dockerfile" and ":" in path:
        raise _fail(text, "a Dockerfile path cannot contain ':'")
    location = os.path.abspath(os.path.expanduser(path))
    if ":" in location:
        raise _fail(text, f"the absolute path {location!r} contains ':', which skopeo cannot read; move it")
    return ImageReference(transport, location, tag=tag or None, digest=build)
